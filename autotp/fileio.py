"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Every file autotp writes (plans, calibration profiles, CLI JSON, checkpoints)
goes through here. The data is written to a temporary file in the *same*
directory (so the final ``os.replace`` is a rename on one filesystem, which is
atomic on POSIX and Windows), flushed and fsynced, then renamed over the
target. If anything fails before the rename, the temporary file is removed and
the previous file at ``path`` is left untouched.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator, Union

PathLike = Union[str, "os.PathLike[str]"]


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` on success.

    The caller writes whatever it likes to the yielded path (a file opened by
    name, ``torch.save``, ...). If the ``with`` body raises, the temporary file
    is deleted and ``path`` keeps its previous content (or stays absent).
    The parent directory is created if missing.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(target.parent)


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_path`)."""
    atomic_write_bytes(path, text.encode(encoding))


def _fsync_file(path: Path) -> None:
    """Flush the file's data to disk so the rename never exposes an empty file after a crash."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    """Persist the rename itself; a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
