"""Small I/O helpers shared by traces, the privacy ledger and node-local storage."""

from __future__ import annotations

import os
import re
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_text", "file_lock", "remove_temp_files"]


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
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(tmp, flags, 0o600)  # private, as mkstemp's: node data is secret
    except FileNotFoundError:  # the directory does not exist yet
        os.makedirs(head or ".", mode=0o700, exist_ok=True)
        fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


@contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive OS lock (``flock``; ``msvcrt.locking`` on Windows) on the sidecar file
    ``<path>.lock`` (created if needed, mode 0600, never removed: removing it would let two processes
    lock two different files).

    The lock belongs to the open file, so it excludes other processes and other threads alike, and the
    OS releases it when its holder dies, even by ``kill -9``.
    """
    lock = os.fspath(path) + ".lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except FileNotFoundError:  # the directory does not exist yet
        os.makedirs(os.path.dirname(lock) or ".", exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _lock_exclusive(fd)
        yield
    finally:
        os.close(fd)  # releases the lock


def _lock_exclusive(fd: int) -> None:
    """Block until this process holds the exclusive lock of the open file ``fd``. Imported here, not at
    module import: ``fcntl`` exists only on POSIX, and the package must import everywhere."""
    if os.name == "nt":  # pragma: no cover - exercised on Windows only
        import msvcrt

        while True:  # LK_LOCK gives up after 10 s of retries: retry until the holder releases it
            try:
                msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
                return
            except OSError:
                continue
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)


def remove_temp_files(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files that :func:`atomic_write_bytes` left beside ``path`` when its writer was
    killed between creating and renaming one; returns them.

    Call it only while no writer of ``path`` can be active (e.g. holding :func:`file_lock` when every
    writer writes under it): a temporary file of a writer in progress would be removed too. Only names
    of the two forms the writers use (``.<name>.<8 random chars>.tmp``, ``.<name>.<pid>-<thread>.tmp``)
    are touched.
    """
    target = Path(path)
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.([a-z0-9_]{{8}}|\d+-\d+)\.tmp$")
    removed = []
    try:
        names = os.listdir(target.parent)
    except FileNotFoundError:
        return removed
    for name in names:
        if pattern.match(name):
            try:
                os.unlink(target.parent / name)
                removed.append(target.parent / name)
            except FileNotFoundError:
                pass
    return removed
