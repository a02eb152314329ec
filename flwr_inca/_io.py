"""Small I/O helpers shared by traces, the privacy ledger and node-local storage."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, see :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same directory, fsync, rename.

    A crash leaves either the old file or the new one, never a half-written file. ``durable=False``
    skips the fsyncs (readers never see a partial file, but a power loss may lose the write): for
    caches that can be rebuilt, written often (node-local party states), so the temporary name is
    simply unique per process and thread, which keeps concurrent writers apart.
    """
    if not durable:
        _replace_quickly(os.fspath(path), data)
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # persist the rename itself
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(dir_fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(dir_fd)


def _replace_quickly(target: str, data: bytes) -> None:
    # plain strings: this runs on every mixing step of a node, where pathlib costs more than the I/O
    head, name = os.path.split(target)
    tmp = os.path.join(head, f".{name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        fh = open(tmp, "wb")
    except FileNotFoundError:  # the directory does not exist yet
        os.makedirs(head or ".", exist_ok=True)
        fh = open(tmp, "wb")
    try:
        with fh:
            fh.write(data)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
