"""The disk tier: one file per block record, least recently used evicted past a size budget.

Layout: ``DIR/<namespace hex>/<first two hex digits of the key>/<key hex>.kv``. A namespace is
one model identity (``engine/tier_manager.py``), so another model, dtype or block size never
reads these files. A record is written to a temporary file and renamed into place, so a reader
sees a whole file or none; a file torn or damaged anyway (a crash before the data reached the
disk, a bad sector) fails the record's checksum and is a miss, counted and deleted.

The index (key -> size, in LRU order) lives in memory and is rebuilt at start from the files,
oldest modification time first; a load touches the file's time so that the order survives a
restart. A write that finds the file system full (``ENOSPC``, ``EDQUOT``, or ``EFBIG`` past a
file size limit) removes what it wrote and raises ``TierFull``; one that may not write (a
read-only file system or folder: ``EROFS``, ``EACCES``, ``EPERM``) raises ``TierReadOnly``:
either way the chain stops the writes for a while and the lookups go on. A record larger than
the whole budget is skipped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

from prefixserve.core.tiers import KVTier, TierFull, TierReadOnly

_SUFFIX = ".kv"
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_NO_WRITE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


class DiskTier(KVTier):
    """Block records as files under ``root`` (created if missing), at most ``capacity`` bytes."""

    name = "disk"

    def __init__(self, root: str, namespace: str, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"the disk tier's size must be positive, got {capacity}")
        self.root = os.path.join(root, namespace)
        self.capacity = capacity
        os.makedirs(self.root, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self.used = 0
        self._scan()

    def _scan(self) -> None:
        """Rebuilds the index from the files, oldest first; leftover temporary files go."""
        found: list[tuple[float, bytes, int]] = []
        for entry in os.scandir(self.root):
            if not entry.is_dir():
                continue
            for file in os.scandir(entry.path):
                if not file.name.endswith(_SUFFIX):
                    _unlink(file.path)  # a temporary file of a write that never finished
                    continue
                try:
                    key = bytes.fromhex(file.name[: -len(_SUFFIX)])
                    stat = file.stat()
                except (ValueError, OSError):
                    continue
                found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used += size
        self._shrink(0)

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.root, name[:2], name + _SUFFIX)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def load_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            try:
                with open(path, "rb") as file:
                    record = file.read()
            except OSError:
                self._forget(key)
                out.append(None)
                continue
            with contextlib.suppress(OSError):  # a read-only folder still serves its records
                os.utime(path)
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
            out.append(record)
        return out

    def store_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for done, (key, record) in enumerate(items):
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
                    continue
                if len(record) > self.capacity:
                    continue
                self._shrink(len(record))
            try:
                self._write(key, record)
            except TierFull as exc:
                exc.stored = done
                raise
            with self._lock:
                self._index[key] = len(record)
                self.used += len(record)

    def _write(self, key: bytes, record: bytes) -> None:
        """Writes ``record`` whole or not at all (temporary file, then rename); raises
        ``TierFull`` (no room), ``TierReadOnly`` (no right to write) or OSError after removing
        what it wrote."""
        path = self._path(key)
        temp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(temp, "wb") as file:
                file.write(record)
            os.replace(temp, path)
        except OSError as exc:
            _unlink(temp)
            if exc.errno in _NO_ROOM:
                raise TierFull(f"{errno.errorcode[exc.errno]}: {exc.strerror}") from exc
            if exc.errno in _NO_WRITE:
                raise TierReadOnly(f"{errno.errorcode[exc.errno]}: {exc.strerror}") from exc
            raise

    def _shrink(self, room: int) -> None:
        """Deletes least recently used files until ``room`` more bytes fit (lock held)."""
        while self._index and self.used + room > self.capacity:
            key, size = self._index.popitem(last=False)
            self.used -= size
            _unlink(self._path(key))

    def evict_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._forget(key)
            _unlink(self._path(key))

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used -= size

    def __len__(self) -> int:
        return len(self._index)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
