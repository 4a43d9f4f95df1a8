"""A linear model held as arrays: the ILP's variables, rows and objective, ready for HiGHS without pulp.

The ILP of a 70B model on a 2-D mesh has some 44,000 variables and 40,000
rows, and is built several times per plan (one problem per set of
regathered kinds, `autotp.solve.regather`). As pulp expressions, building it
and handing it to HiGHS took more than half of the solve (17 s of pulp
arithmetic and 7 s of pulp's model transfer in a 40 s solve of Llama-2-70B
at batch 8). Here an expression is two flat lists, a row is appended to
compressed-row arrays as it is added, and `autotp.solve.backends` passes
the arrays to HiGHS in one call (or, for CBC, to pulp).

`Var` and `Lin` support the arithmetic the ILP writes (``3 * x + y - 2``,
`total`); rows are added by `Model.ge`, `Model.le` and `Model.eq`, never by
comparison operators, so a variable stays an ordinary hashable object.
"""

from __future__ import annotations

import math

INF = math.inf
_NUMBERS = (int, float)  # not numbers.Real: its isinstance check costs more than the arithmetic it guards


class Lin:
    """``sum(coef * x[index]) + const``: term lists, concatenated as expressions add (duplicates merged in rows)."""

    __slots__ = ("index", "coef", "const")

    def __init__(self, index: list | None = None, coef: list | None = None, const: float = 0.0):
        # the lists are taken, not copied: no operation changes a list in place, so expressions may share them
        self.index = [] if index is None else index
        self.coef = [] if coef is None else coef
        self.const = float(const)

    def __add__(self, other) -> "Lin":
        other = as_lin(other)
        return Lin(self.index + other.index, self.coef + other.coef, self.const + other.const)

    __radd__ = __add__

    def __sub__(self, other) -> "Lin":
        return self + (-1.0) * as_lin(other)

    def __rsub__(self, other) -> "Lin":
        return as_lin(other) + (-1.0) * self

    def __neg__(self) -> "Lin":
        return (-1.0) * self

    def __mul__(self, scalar) -> "Lin":
        if not isinstance(scalar, _NUMBERS):
            raise TypeError("a linear expression is multiplied by a number only")
        s = float(scalar)
        return Lin(self.index, [c * s for c in self.coef], self.const * s)

    __rmul__ = __mul__


class Var:
    """Column ``index`` of ``model``; its value is read after a solve (bounds: `Model.set_bounds`)."""

    __slots__ = ("model", "index")

    def __init__(self, model: "Model", index: int):
        self.model, self.index = model, index

    def lin(self) -> Lin:
        return Lin([self.index], [1.0])

    def __add__(self, other) -> Lin:
        return self.lin() + other

    __radd__ = __add__

    def __sub__(self, other) -> Lin:
        return self.lin() - other

    def __rsub__(self, other) -> Lin:
        return as_lin(other) - self.lin()

    def __neg__(self) -> Lin:
        return Lin([self.index], [-1.0])

    def __mul__(self, scalar) -> Lin:
        if not isinstance(scalar, _NUMBERS):
            raise TypeError("a variable is multiplied by a number only")
        return Lin([self.index], [float(scalar)])

    __rmul__ = __mul__

    def value(self) -> float | None:
        values = self.model.values
        return None if values is None else float(values[self.index])


def as_lin(x) -> Lin:
    if isinstance(x, Lin):
        return x
    if isinstance(x, Var):
        return x.lin()
    if isinstance(x, _NUMBERS):
        return Lin(None, None, float(x))
    raise TypeError(f"not a linear expression: {x!r}")


def total(items) -> Lin:
    """The sum of variables, expressions and numbers (pulp's ``lpSum``), built in one pass."""
    index, coef, const = [], [], 0.0
    for item in items:
        if isinstance(item, Var):
            index.append(item.index)
            coef.append(1.0)
        elif isinstance(item, Lin):
            index += item.index
            coef += item.coef
            const += item.const
        else:
            const += float(item)
    return Lin(index, coef, const)


class Model:
    """Columns (bounds, integrality), rows in compressed-row form, a linear objective to minimise.

    After a solve (`autotp.solve.backends`): ``status`` (``"Optimal"``,
    ``"Infeasible"``, ``"Not Solved"``, ...), ``has_solution`` (an optimum,
    or an incumbent held when a time limit stopped the search), ``values``
    and ``objective_value``. ``start`` maps columns to a starting value
    (the warm start of a time-limited solve). ``relaxed`` caches the
    solver object of the LP relaxation, so relaxations solved one after
    another (branches that differ in bounds) start from the last basis.
    ``labels`` names rows a caller changes later (`set_row_bounds`): the
    ILP's memory limit, lifted for a relaxation without it. ``zero_one``
    marks the columns that are 0 or 1 in every plan worth finding: the
    binaries, and continuous columns the binaries force to 0 or 1
    (`var`), which reduced-cost fixing may pin (`autotp.solve.fixing`).
    """

    def __init__(self):
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.zero_one: list[bool] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.starts: list[int] = [0]
        self.row_index: list[int] = []
        self.row_coef: list[float] = []
        self.cost: list[float] = []
        self.offset = 0.0
        self.start: dict[int, float] = {}
        self.status = "Not Solved"
        self.has_solution = False
        self.proven = False  # the solution is an optimum, not an incumbent a time limit stopped at
        self.values = None
        self.objective_value: float | None = None
        self.relaxed = None
        self.labels: dict[str, list[int]] = {}

    @property
    def n_vars(self) -> int:
        return len(self.lower)

    @property
    def n_rows(self) -> int:
        return len(self.row_lower)

    def var(self, low: float = 0.0, up: float = INF, binary: bool = False, zero_one: bool = False) -> Var:
        """A new column. ``zero_one``: continuous, but 0 or 1 in every plan worth finding (an edge's pair of
        choices, one-hot as its two groups' binaries are; a fan-out item at the least its uses allow); binaries
        are so too."""
        if binary:
            low, up = max(low, 0.0), min(up, 1.0)
        self.lower.append(float(low))
        self.upper.append(float(up))
        self.integer.append(binary)
        self.zero_one.append(binary or zero_one)
        self.cost.append(0.0)
        return Var(self, len(self.lower) - 1)

    def vars(self, count: int, zero_one: bool = False) -> list[Var]:
        """``count`` new continuous columns from 0 up, at once (a model has some 36,000 edge pairs)."""
        first = self.n_vars
        self.lower += [0.0] * count
        self.upper += [INF] * count
        self.integer += [False] * count
        self.zero_one += [zero_one] * count
        self.cost += [0.0] * count
        return [Var(self, j) for j in range(first, first + count)]

    def set_bounds(self, index: int, low: float, up: float) -> None:
        self.lower[index], self.upper[index] = float(low), float(up)
        if self.relaxed is not None:
            self.relaxed.changeColBounds(index, float(low), float(up))

    def set_row_bounds(self, row: int, low: float, up: float) -> None:
        self.row_lower[row], self.row_upper[row] = float(low), float(up)
        if self.relaxed is not None:
            self.relaxed.changeRowBounds(row, float(low), float(up))

    def ge(self, a, b=0.0) -> int:
        """The row ``a >= b``; its number."""
        return self._row(a, b, 0.0, INF)

    def le(self, a, b=0.0) -> int:
        """The row ``a <= b``; its number."""
        return self._row(a, b, -INF, 0.0)

    def eq(self, a, b=0.0) -> int:
        """The row ``a == b``; its number."""
        return self._row(a, b, 0.0, 0.0)

    def _row(self, a, b, low: float, up: float) -> int:
        """``low <= a - b <= up``, the constants moved to the bounds."""
        a, b = as_lin(a), as_lin(b)
        return self.row(a.index + b.index, a.coef + [-c for c in b.coef], low - (a.const - b.const),
                        up - (a.const - b.const))

    def row(self, index: list[int], coef: list[float], low: float, up: float) -> int:
        """``low <= sum(coef * x[index]) <= up`` from the columns and coefficients themselves: what `ge`, `le` and
        `eq` come down to, called directly where a model has tens of thousands of rows (`autotp.solve.ilp`)."""
        if len(set(index)) != len(index):  # a variable named twice: one entry, its coefficients summed
            merged: dict[int, float] = {}
            for i, c in zip(index, coef):
                merged[i] = merged.get(i, 0.0) + c
            index, coef = list(merged), list(merged.values())
        if 0.0 in coef:
            kept = [(i, c) for i, c in zip(index, coef) if c != 0.0]
            index, coef = [i for i, _ in kept], [c for _, c in kept]
        self.row_index += index
        self.row_coef += coef
        self.starts.append(len(self.row_index))
        self.row_lower.append(low)
        self.row_upper.append(up)
        return self.n_rows - 1

    def minimise(self, objective) -> None:
        lin = as_lin(objective)
        self.cost = [0.0] * self.n_vars
        for i, c in zip(lin.index, lin.coef):
            self.cost[i] += c
        self.offset = lin.const
