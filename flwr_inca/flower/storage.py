"""Node-local storage of a party's round data, and the unit noise it drew ahead.

A party keeps its value (written once, when it joins the round) and every state it computes, as an
immutable version per iteration, so that retries and stragglers are harmless. :class:`DirectoryStore`
is the deployment's store (files private to the node); :class:`MemoryStore` serves tests and
single-process simulations; :class:`StoredNoise` reads the noise drawn ahead row by row.

Everything a node stores is private: directories 0700, files 0600 (:func:`make_private_dirs`), under a
root that :func:`check_private_root` accepts only if it belongs to this user and nobody else can write
to it (a predictable name under a shared temp directory could otherwise be prepared by another user).
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import time
import zlib
from pathlib import Path
from typing import Protocol

import numpy as np

from .._io import atomic_write_bytes

__all__ = ["NodeStore", "MemoryStore", "DirectoryStore", "StoredNoise", "make_private_dirs",
           "check_private_root", "remove_stale_runs"]


def make_private_dirs(path: str | os.PathLike[str]) -> None:
    """Create ``path`` and each missing parent with mode 0700 (``os.makedirs`` gives the parents it creates
    the default mode, usually 0755)."""
    missing = []
    current = os.path.abspath(os.fspath(path))
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass


def check_private_root(path: str | os.PathLike[str], *, default: bool = False) -> None:
    """Make sure node secrets may live under ``path``: create it (0700) if missing; refuse, with a
    ``PermissionError`` naming the path and what is wrong, a path that is not a directory, belongs to
    another user, or is writable by group or others. ``default``: the predictable default root under the
    shared temp directory, which only this package uses: a symbolic link there is refused too (it could
    have been planted), and group and others lose their read and search bits."""
    path = os.fspath(path)
    make_private_dirs(path)
    st = os.lstat(path) if default else os.stat(path)
    where = f"node state directory {path}"
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(f"{where} is a symbolic link: refusing to keep node secrets there; remove it, or "
                              "choose a directory with IncaClient(state_dir=...) or FLWR_INCA_STATE_DIR")
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{where} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{where} belongs to user id {st.st_uid}, not to this user ({os.getuid()}): "
                              "refusing to keep node secrets there; choose another with "
                              "IncaClient(state_dir=...) or FLWR_INCA_STATE_DIR")
    if st.st_mode & 0o022:
        who = " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "others")) if st.st_mode & bit)
        raise PermissionError(f"{where} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}): refusing to "
                              f"keep node secrets there; run chmod 700 {path} or choose another directory "
                              "(IncaClient(state_dir=...) or FLWR_INCA_STATE_DIR)")
    if default and st.st_mode & 0o077:
        os.chmod(path, 0o700)


SCAN_MARK = ".stale-scan"  # under the root: its mtime is when runs were last scanned for staleness


def remove_stale_runs(root: str | os.PathLike[str], keep: str, older_than: float,
                      every: float | None = None) -> list[str]:
    """Remove the ``run-*`` directories under ``root`` other than ``keep`` in which nothing changed for
    more than ``older_than`` seconds (the data of runs that ended without telling their nodes, e.g.
    killed); returns their names. Runs in progress write every mixing step, so they are never that old.

    Every node calls this when it joins a round, so the scan runs at most once every ``every`` seconds
    per root (default ``min(older_than / 10, 600)``): the mtime of ``<root>/.stale-scan`` says when the
    last one ran, for every node and process sharing the root. Without that, each of n nodes walked every
    file of every run left under the root at each join (a round of 100 nodes took 3x longer with 143
    runs' leftovers). A run directory's walk also stops at its first recent file."""
    every = min(older_than / 10, 600.0) if every is None else float(every)
    mark = os.path.join(root, SCAN_MARK)
    now = time.time()
    try:
        if now - os.stat(mark).st_mtime < every:
            return []
    except FileNotFoundError:
        pass  # no scan yet under this root
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    try:  # claim this scan first: nodes joining meanwhile see a fresh mark and skip theirs
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT, 0o600))
        os.utime(mark, (now, now))
    except OSError:
        pass
    removed = []
    cutoff = now - older_than
    for entry in entries:
        if not entry.name.startswith("run-") or entry.name == keep or not entry.is_dir(follow_symlinks=False):
            continue
        if not _changed_since(entry.path, cutoff):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _changed_since(path: str, cutoff: float) -> bool:
    """Whether ``path`` or anything under it was modified after ``cutoff`` (stops at the first such)."""
    if os.lstat(path).st_mtime >= cutoff:
        return True
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                if os.lstat(os.path.join(top, name)).st_mtime >= cutoff:
                    return True
            except FileNotFoundError:
                pass
    return False


class NodeStore(Protocol):
    """Node-local storage of a party's round data (every item is immutable once written).

    ``save_value`` starts a round: it drops all round data kept so far, of any round, including an
    earlier instance of the same round number (a restarted strategy numbers rounds from 1 again, and
    its secrets are fresh: nothing cached for the old instance may be used). ``save_blob``/``load_blob``
    keep named items of the round (the roster, caches); ``load_blob_range`` reads ``size`` bytes of one
    from ``offset`` (None if the item is missing or shorter).
    """

    def save_value(self, round: int, value: np.ndarray) -> None: ...
    def load_value(self, round: int) -> np.ndarray | None: ...
    def save_state(self, round: int, version: int, data: bytes) -> None: ...
    def load_state(self, round: int, version: int) -> bytes | None: ...
    def save_blob(self, round: int, name: str, data: bytes) -> None: ...
    def load_blob(self, round: int, name: str) -> bytes | None: ...
    def load_blob_range(self, round: int, name: str, offset: int, size: int) -> bytes | None: ...


class MemoryStore:
    """In-process store (tests, single-process simulations)."""

    def __init__(self) -> None:
        self.values: dict[int, np.ndarray] = {}
        self.states: dict[tuple[int, int], bytes] = {}
        self.blobs: dict[tuple[int, str], bytes] = {}

    def save_value(self, round: int, value: np.ndarray) -> None:
        self.values.clear()
        self.states.clear()
        self.blobs.clear()
        self.values[round] = np.array(value, dtype=np.float64)

    def load_value(self, round: int) -> np.ndarray | None:
        return self.values.get(round)

    def save_state(self, round: int, version: int, data: bytes) -> None:
        self.states[(round, version)] = data

    def load_state(self, round: int, version: int) -> bytes | None:
        return self.states.get((round, version))

    def save_blob(self, round: int, name: str, data: bytes) -> None:
        self.blobs[(round, name)] = data

    def load_blob(self, round: int, name: str) -> bytes | None:
        return self.blobs.get((round, name))

    def load_blob_range(self, round: int, name: str, offset: int, size: int) -> bytes | None:
        blob = self.blobs.get((round, name))
        return None if blob is None or len(blob) < offset + size else blob[offset:offset + size]


class DirectoryStore:
    """Files under ``root`` (private to the node: mode 0700).

    Layout: ``round-<r>/value.f64``, ``round-<r>/states.bin`` and other named items (``<name>.bin``;
    ``noise.bin`` holds the unit noise drawn ahead, as secret as the value). Joining a round removes
    all earlier round data. Named items are replaced atomically. The states of a round (all of one
    size) share one file of checksummed slots, one per version, written in place: a mixing step then
    creates no file, which costs more than the rest of its storage I/O. A slot that a crash left torn
    fails its checksum and reads as missing. Nothing is fsynced: what a crash loses is restored
    through the relay.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = os.fspath(root)  # plain strings on the hot path: pathlib costs more than the I/O

    @property
    def root(self) -> Path:
        return Path(self._root)

    def _file(self, round: int, name: str) -> str:
        return os.path.join(self._root, f"round-{round}", name)

    def save_value(self, round: int, value: np.ndarray) -> None:
        make_private_dirs(self.root)
        os.chmod(self.root, 0o700)  # also when it existed: the round data is the node's secret
        for old in self.root.glob("round-*"):  # every earlier round, this number included
            shutil.rmtree(old, ignore_errors=True)
        value = np.ascontiguousarray(value, dtype=np.float64)
        make_private_dirs(os.path.join(self._root, f"round-{round}"))
        atomic_write_bytes(self._file(round, "value.f64"), value.tobytes())

    def remove(self) -> None:
        """Remove everything this store holds (the node's data of this run)."""
        shutil.rmtree(self._root, ignore_errors=True)

    def load_value(self, round: int) -> np.ndarray | None:
        data = self._read(self._file(round, "value.f64"))
        return None if data is None else np.frombuffer(data, dtype=np.float64).copy()

    # states.bin: a header (u64 slot size), then at 8 + version * slot a slot holding
    # (u32 CRC-32 of the state, u32 its length, the state)
    _SLOT_HEAD = struct.Struct("<II")

    def save_state(self, round: int, version: int, data: bytes) -> None:
        if version < 0:
            raise ValueError(f"state version must be >= 0, got {version}")
        path = self._file(round, "states.bin")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # the round's directory does not exist yet
            make_private_dirs(os.path.dirname(path))
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            slot = self._SLOT_HEAD.size + len(data)
            head = os.pread(fd, 8, 0)
            if len(head) < 8:  # a new file (concurrent creators write the same header)
                os.pwrite(fd, struct.pack("<Q", slot), 0)
            elif struct.unpack("<Q", head)[0] != slot:
                raise ValueError("states of one round must all have the same size")
            os.pwrite(fd, self._SLOT_HEAD.pack(zlib.crc32(data), len(data)) + data, 8 + version * slot)
        finally:
            os.close(fd)

    def load_state(self, round: int, version: int) -> bytes | None:
        try:
            fd = os.open(self._file(round, "states.bin"), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            head = os.pread(fd, 8, 0)
            if len(head) < 8 or version < 0:
                return None
            (slot,) = struct.unpack("<Q", head)
            record = os.pread(fd, slot, 8 + version * slot)
        finally:
            os.close(fd)
        if len(record) != slot:
            return None
        crc, size = self._SLOT_HEAD.unpack_from(record)
        data = record[self._SLOT_HEAD.size:]
        return data if size == len(data) and zlib.crc32(data) == crc else None  # never written, or torn

    def save_blob(self, round: int, name: str, data: bytes) -> None:
        # atomic, not durable: what a crash loses is restored through the relay
        atomic_write_bytes(self._file(round, f"{name}.bin"), data, durable=False)

    def load_blob(self, round: int, name: str) -> bytes | None:
        return self._read(self._file(round, f"{name}.bin"))

    def load_blob_range(self, round: int, name: str, offset: int, size: int) -> bytes | None:
        try:
            fd = os.open(self._file(round, f"{name}.bin"), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        return data if len(data) == size else None

    @staticmethod
    def _read(path: str) -> bytes | None:
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None


class StoredNoise:
    """:class:`PartyNoise`'s cache for one party, round and mixing step: unit draws made ahead into node
    storage (:func:`draw_noise_ahead`), read by row; a missing row is drawn on demand.

    Reading row k also reads row k + 1, which D_Inc's next request asks for (it cancels eta_k and
    injects eta_(k+1) in the same step): one read per step.
    """

    def __init__(self, store: NodeStore, round: int) -> None:
        self.store, self.round = store, round
        self.rows: dict[tuple[int, int], np.ndarray] = {}
        self.absent = False  # nothing drawn ahead: draw on demand without asking storage again

    def get(self, key: tuple[int, int]) -> np.ndarray | None:
        if key in self.rows:
            return self.rows[key]
        if self.absent:
            return None
        k, d = key
        row = 8 * d
        data = self.store.load_blob_range(self.round, "noise", k * row, 2 * row)
        if data is None:  # the last row, or nothing drawn ahead
            data = self.store.load_blob_range(self.round, "noise", k * row, row)
        if data is None:
            self.absent = True
            return None
        draws = np.frombuffer(data, dtype=np.float64)
        for j in range(len(draws) // d):
            self.rows[(k + j, d)] = draws[j * d:(j + 1) * d]
        return self.rows[key]

    def __setitem__(self, key: tuple[int, int], draw: np.ndarray) -> None:
        self.rows[key] = draw
