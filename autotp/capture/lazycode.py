"""A captured module's Python written when it is first needed, not at the end of every capture.

`autotp.capture.normalize` ends with one recompile, which writes the Python
of every node: 0.4 to 0.6 s for the 80 layers of Llama-2-70B (5,677 ops),
a fifth of a capture. `autotp.plan` captures two to six times and never runs
what it captures (it reads the graph), and `autotp.lower` recompiles the
rank program it makes. So the code is written when the module is first
run, or its code read or printed, as torch's `_LazyGraphModule` does.

That class wraps a module by copying it, and fx's copy registers every
buffer as persistent: a consolidated checkpoint of a trained Llama then held
its rotary embedding's ``inv_freq``, which ``load_state_dict(strict=True)``
refused. Here the module itself changes: fx gives each `GraphModule` a class
of its own (`GraphModule.__new__`), whose ``forward``, ``code`` and
``__str__`` are pointed at versions that recompile first.
`GraphModule.recompile` puts the real ``forward`` back (pickling and
``deepcopy`` recompile too), so the module runs as it would have.
"""

from __future__ import annotations

import torch.fx as fx

_OWN_CLASS = "GraphModuleImpl"  # the name of the class fx makes for each GraphModule


def recompile_when_needed(gm: fx.GraphModule) -> None:
    """Mark ``gm``'s code stale, to be written when ``gm`` is first run or its code read (at once where fx did
    not give ``gm`` a class of its own)."""
    cls = type(gm)
    if cls.__qualname__.rsplit(".", 1)[-1] != _OWN_CLASS:
        gm.recompile()
        return
    cls.forward = _stale_forward
    cls.code = property(_code)
    cls.__str__ = _str


def _stale(gm: fx.GraphModule) -> bool:
    return type(gm).forward is _stale_forward


def _stale_forward(self, *args, **kwargs):
    """The first run: the code written, then run through the new ``forward`` directly (the module's hooks have
    run already, for this call)."""
    self.recompile()
    return type(self).forward(self, *args, **kwargs)


def _written(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``, its code written if it was stale."""
    if _stale(gm):
        gm.recompile()
    return gm


def _code(self) -> str:
    return _written(self)._code


def _str(self) -> str:
    return fx.GraphModule.__str__(_written(self))
