"""A small reader for GGUF files: metadata and tensor index, with lazy dequantisation.

It parses the header with ``struct`` (much faster than ``gguf.GGUFReader`` on a 49k-token
vocabulary) and imports neither torch nor, until a tensor is read, numpy or ``gguf``, so the
tokenizer can use it in processes that have no torch.

Format (GGUF v2/v3, little endian): magic ``GGUF``, uint32 version, uint64 tensor count,
uint64 metadata count, the metadata key/value pairs, the tensor infos, padding to
``general.alignment`` (default 32), then the tensor data. Tensor dims are stored fastest-varying
first (ggml order); :attr:`GGUFTensorInfo.shape` gives them in numpy/torch order.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixserve.model.pages import base_page_area

if TYPE_CHECKING:
    import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format of one scalar.
_SCALAR_FORMATS: dict[int, str] = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING = 8
_ARRAY = 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file.

    ``shape`` is in numpy/torch order (slowest-varying dim first), ``ggml_type`` the raw
    ``GGMLQuantizationType`` value and ``offset`` the absolute byte offset of its data.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


class _Cursor:
    """Sequential little-endian reader over a buffer."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary: 262,144 for Gemma 3), read in one tight
        loop: what :meth:`string` does, without a call per string."""
        buf, pos = self.buf, self.pos
        out: list[str] = []
        length_at = struct.Struct("<Q").unpack_from
        append = out.append
        for _ in range(count):
            (length,) = length_at(buf, pos)
            pos += 8
            append(buf[pos:pos + length].decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.unpack("I")
            count = self.unpack("Q")
            if item_type == _STRING:
                return self._strings(count)
            if item_type in _SCALAR_FORMATS:
                fmt = f"<{count}{_SCALAR_FORMATS[item_type]}"
                items = list(struct.unpack_from(fmt, self.buf, self.pos))
                self.pos += struct.calcsize(fmt)
                return items
            return [self.value(item_type) for _ in range(count)]
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        raise ValueError(f"unknown GGUF metadata value type {vtype}")


class GGUFFile:
    """An opened GGUF file: ``metadata`` (key -> Python value) and ``tensors`` (name -> info).

    The file is mapped private and copy-on-write (``mmap.ACCESS_COPY``): :meth:`read_raw` gives
    writable numpy views of its pages, which stay the page cache's pages, shared with every
    process that maps the file, as long as nothing writes them (nothing does: a write would
    give this process its own copy of the page). The map lives while this object or any view
    of it does. :meth:`read_tensor` dequantises one tensor into a float32 numpy array;
    :meth:`release` drops pages this process has read and no longer needs from its resident
    set. Parsing the header needs neither numpy nor torch.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        cur = _Cursor(self._map)
        if self._map[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.unpack("I")
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version}")
        n_tensors = cur.unpack("Q")
        n_kv = cur.unpack("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("I")
            dims = [cur.unpack("Q") for _ in range(n_dims)]
            ggml_type = cur.unpack("I")
            offset = cur.unpack("Q")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        self.data_start = -(-cur.pos // alignment) * alignment
        """Where the tensor data begins: the bytes before it are the header (metadata, index)."""
        self.tensors: dict[str, GGUFTensorInfo] = {
            name: GGUFTensorInfo(name, shape, ggml_type, self.data_start + offset)
            for name, shape, ggml_type, offset in infos
        }

    def _rows(self, name: str) -> tuple[int, int]:
        """Tensor ``name``'s stored rows and bytes per row (see :meth:`read_raw`)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        info = self.tensors[name]
        block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        rows = 1
        for dim in info.shape[:-1]:
            rows *= dim
        return rows, info.shape[-1] // block_elems * block_bytes

    def span(self, name: str) -> tuple[int, int]:
        """Bytes ``[start, stop)`` of the file that hold tensor ``name``."""
        rows, row_bytes = self._rows(name)
        start = self.tensors[name].offset
        return start, start + rows * row_bytes

    def release(self, start: int, stop: int) -> None:
        """Drops the pages that lie wholly inside bytes ``[start, stop)`` of the file from this
        process's resident set (``madvise(MADV_DONTNEED)``; pages that only partly overlap the
        range stay).

        No view sees a change: the pages are unwritten file pages, and a later read faults
        them back in from the page cache (or the file). Does nothing where the platform has
        no ``madvise``.
        """
        advise = getattr(self._map, "madvise", None)
        if advise is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = -(-max(start, 0) // mmap.PAGESIZE) * mmap.PAGESIZE
        last = min(stop, len(self._map)) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            advise(mmap.MADV_DONTNEED, first, last - first)

    def read_raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s stored bytes as a uint8 view ``[rows, row_bytes]`` of the map.

        Rows run along the last (fastest-varying) dim; a quantized row is a whole number of
        blocks. The view holds the map (its numpy base is the ``mmap`` object), so it stays
        valid after this object is gone, and so does a torch tensor made from it with
        ``torch.from_numpy``. It is writable (a private map) but must not be written: see the
        class docstring.
        """
        import numpy as np

        rows, row_bytes = self._rows(name)
        start = self.tensors[name].offset
        raw = np.frombuffer(self._map, dtype=np.uint8, count=rows * row_bytes, offset=start)
        return raw.reshape(rows, row_bytes)

    def read_tensor(self, name: str) -> np.ndarray:
        """Dequantise tensor ``name`` to a new float32 array of shape ``info.shape``."""
        import numpy as np
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        if info.ggml_type == _Q8_0:
            return _dequantize_q8_0(self.read_raw(name)).reshape(info.shape)
        values = dequantize(self.read_raw(name), GGMLQuantizationType(info.ggml_type))
        return np.array(values, dtype=np.float32).reshape(info.shape)


_Q8_0 = 8
"""GGMLQuantizationType.Q8_0: blocks of a float16 scale and 32 int8 values."""
_Q8_0_CHUNK = 1 << 16
"""Blocks dequantized at a time (2 MiB of bytes, 8 MiB of float32)."""


def _dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 rows ``raw`` as float32, each value ``float32(d) * q`` rounded once, as gguf's own
    ``dequantize`` computes it (bit for bit), without its per-group Python overhead: Gemma 3's
    262,144 x 640 embedding took 11.8 s there, a fraction of a second here."""
    import numpy as np

    blocks = raw.reshape(-1, 34)
    # base-size pages, not numpy's array (pages.py: Gemma 3's dense load took 7.3-8.2 s with
    # numpy's, 3.6-3.7 s so); the array holds the mapping
    area = base_page_area(blocks.shape[0] * 32 * 4)
    out = np.frombuffer(area, np.float32, blocks.shape[0] * 32).reshape(blocks.shape[0], 32)
    for start in range(0, blocks.shape[0], _Q8_0_CHUNK):
        part = blocks[start:start + _Q8_0_CHUNK]
        scales = np.ascontiguousarray(part[:, :2]).view(np.float16).astype(np.float32)
        np.multiply(part[:, 2:].view(np.int8), scales, out=out[start:start + _Q8_0_CHUNK])
    return out.reshape(raw.shape[0], -1)
