"""Weights kept block-quantized in memory, and the layers that multiply with them.

Six packed formats, each GGUF's own byte layout: **Q4_0** (4-bit, a scale per block of 32:
4.5 bits per weight), **Q4_1** (4-bit, a scale and an offset per block: 5 bits per weight) and
**Q8_0** (8-bit, a scale per block: 8.5 bits per weight), see ``kernels/quant.c``; **Q4_K**
(super-blocks of 256: 4.5 bits per weight), **Q5_K** (5.5 bits) and **Q6_K** (6.56 bits), see
``kernels/kquant.c``. A GGUF tensor maps to them as follows (:func:`pack_gguf`):

* Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K are kept byte for byte (the model computes what the
  file holds); Q5_0 becomes Q8_0 exactly (bytes q - 16);
* the other 2-4-bit types (Q2_K, Q3_K, IQ4...) are dequantized and requantized to Q4_1;
* the other 5-8-bit types (Q5_1, Q8_1, Q8_K) are requantized to Q8_0 (the loader's log
  names every requantized tensor type);
* float tensors (F32, F16, BF16) stay dense (:data:`DENSE_TYPES`).

The K-quant formats take the 16-bit integer kernels only (``kernels/kquant.c``: a 512-bit
one-row kernel, and for more rows a row-invariant one that expands a few weight rows to floats
and reads each activation row once for them) and expand-and-GEMM for prefill; the bfloat16
batch and AMX kernels take Q4_0, Q4_1 and Q8_0 (Q4_0 read as Q4_1 with the offset ``-8 *
scale``: its products are bit for bit those of the same weight converted to Q4_1).

``--weights int8|int4`` requantizes every matmul weight to Q8_0 or Q4_1 (:func:`pack_float`).

:class:`QuantLinear` picks its kernel by the number of rows M of the input: up to
:data:`SMALL_M` rows (decode steps) it runs the integer kernel over the packed blocks; above it
(prefill), on every AVX2 build (256 or 512 bits), the panel kernel (``kernels/panel.c``: the
same 16-bit products, blocked for many rows; 1.2-1.5x expand-and-GEMM's speed at 512 rows and
1.5-2x at 32-64 on Zen 3 and an AMX Xeon, ``benchmarks/prefill_products.py``), elsewhere (ARM,
a build without AVX2) it expands slices of the weight to float32 and calls torch's float
GEMM, faster there than the integer kernel (``benchmarks/bench_quant.py`` measures the
crossover). A bfloat16 model (the
``--dtype auto`` choice on CPUs with AVX512-BF16 or AMX) expands them to bfloat16 instead and
calls the bfloat16 GEMM that its dense weights would: on such a CPU (AMD Zen 5) the float32 GEMM
took 4x as long, and prefill ran at 0.40x the dense path (benchmarks/RESULTS.md). On a CPU with
AVX512-BF16 a bfloat16 input of 8 (the library's ``bf16_batch_rows()``) to :data:`SMALL_M` rows
takes the bfloat16 batch kernel (``gemm_bf16_batch``: weight blocks expanded to bfloat16 in
registers, ``vdpbf16ps``), about twice as fast there as the 16-bit one. On a CPU with AMX-BF16
(Intel Xeon, Sapphire Rapids and later) a bfloat16 input of ``amx_rows()`` (4; Q4_0 weights:
``amx_q4_0_rows()``, 8) to :data:`AMX_MAX` rows takes the tile kernel instead (``gemm_bf16_amx``:
the same expanded blocks, 16 weight rows by 16 activation rows per ``tdpbf16ps``), which beat
both other kernels at every such row count there (fewer rows: the 16-bit kernel, one row after
another, :attr:`QuantLinear.amx_from`); above that, up to :data:`AMX_LARGE_MAX_ROWS` rows and
:data:`AMX_LARGE_MAX_OUTPUTS` outputs, the large-row tile kernel (``gemm_bf16_amx_large``: each
weight expanded once per product, the activation rows read in place), which beats
expand-and-GEMM there.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from prefixserve.model.pages import huge_page_area
from prefixserve.model.weights import quant_kernels
from prefixserve.model.weights.dtypes import cpu_has_native_bfloat16
from prefixserve.model.weights.quant_kernels import (
    FMT_Q4_0,
    FMT_Q4_0S,
    FMT_Q4_1,
    FMT_Q4_K,
    FMT_Q5_K,
    FMT_Q6_K,
    FMT_Q8_0,
)

#: Weights per quantization block.
BLOCK = 32
#: Bytes per block of each packed format.
BLOCK_BYTES = {FMT_Q4_0: 18, FMT_Q4_0S: 18, FMT_Q4_1: 20, FMT_Q8_0: 34}
FORMAT_NAMES = {FMT_Q4_0: "Q4_0", FMT_Q4_0S: "Q4_0 (stream layout)", FMT_Q4_1: "Q4_1",
                FMT_Q8_0: "Q8_0", FMT_Q4_K: "Q4_K", FMT_Q5_K: "Q5_K", FMT_Q6_K: "Q6_K"}
#: The K-quant formats: super-blocks of SUPER_BLOCK weights, of SUPER_BLOCK_BYTES bytes.
K_FORMATS = frozenset({FMT_Q4_K, FMT_Q5_K, FMT_Q6_K})
SUPER_BLOCK = 256
SUPER_BLOCK_BYTES = {FMT_Q4_K: 144, FMT_Q5_K: 176, FMT_Q6_K: 210}


def row_bytes(fmt: int, cols: int) -> int:
    """Bytes of one packed row of ``cols`` weights in ``fmt``."""
    if fmt in K_FORMATS:
        return cols // SUPER_BLOCK * SUPER_BLOCK_BYTES[fmt]
    return cols // BLOCK * BLOCK_BYTES[fmt]

#: Products with at most this many input rows use the integer kernel: on AVX2 (Zen 3) it beat
#: expand-and-GEMM up to 16 rows for every weight shape of the default model, and lost at 64
#: (``benchmarks/bench_quant.py`` part 1).
SMALL_M = 16
#: A bfloat16 input of up to this many rows takes the bfloat16 batch kernel (from the library's
#: ``bf16_batch_rows``): on Zen 4 it beat expand-and-GEMM at 16, 32, 48 and 64 rows for the
#: default model's weights (30 layers and the head: 20.5 vs 40.3 ms at 16 rows, 34.2 vs 52.5
#: at 32, 64.7 vs 76.8 at 64; gate_up even at 64), which steps verifying drafts have.
BF16_BATCH_MAX = 64
#: A bfloat16 input of up to this many rows takes the AMX kernel where the library has one
#: (from ``amx_rows()`` rows); above it, expand-and-GEMM, whose GEMM runs on the tiles too
#: (oneDNN) and expands each weight once, not once per 64 rows. On an Intel Xeon with AMX
#: (``benchmarks/bench_quant.py --parts 7``) the kernel was faster for every weight of the
#: default model at 128 rows (0.75-0.97x the time), slower for four of five at 192.
AMX_MAX = 128
#: From AMX_MAX to AMX_LARGE_MAX_ROWS rows a bfloat16 product takes the large-row AMX kernel
#: (``gemm_bf16_amx_large``: each weight expanded once per product into the tiles' layout, the
#: activations read where they lie, 2 x 2 tiles) while rows x outputs stay within
#: AMX_LARGE_MAX_OUTPUTS; beyond either, expand-and-GEMM. On an Intel Xeon with AMX
#: (``benchmarks/bench_quant.py --parts 8``; RESULTS.md) the kernel took
#: 0.43-0.80x expand-and-GEMM's time at 160 and 256 rows for every weight of the default model
#: and of Gemma 3, and 0.54-0.95x at 1,024 rows for weights of up to 960 outputs; but
#: 1.11-1.27x for 1,536 and 3,072 outputs at 1,024 rows, where oneDNN's GEMM runs nearer the
#: tiles' peak, and 1.2-2.3x for every shape at 2,000 rows, whose activations no longer stay in
#: a core's L2 cache while each pair of weight groups reads them all.
AMX_LARGE_MAX_ROWS = 1024
AMX_LARGE_MAX_OUTPUTS = 1 << 20
#: Bits activations are rounded to (per block of 32) in the integer kernel: 16 keeps greedy
#: tokens those of the float32 reference (8, llama.cpp's choice on CPUs, is ~1.5x faster but
#: moved 4% of top-1 tokens on text in ``benchmarks/bench_quant.py``).
ACTIVATION_BITS = 16
#: Float32 elements of a weight slice expanded at a time for a large product (8 MiB: smaller
#: slices slowed the GEMM down in measurements).
_SLICE_ELEMENTS = 1 << 21

# GGML type ids (gguf.constants.GGMLQuantizationType) by how they are kept.
_Q4_0, _Q4_1, _Q5_0, _Q8_0, _Q4_K, _Q5_K, _Q6_K = 2, 3, 6, 8, 12, 13, 14
#: GGUF K-quant types kept as they are, and their packed format.
_KEPT_K = {_Q4_K: FMT_Q4_K, _Q5_K: FMT_Q5_K, _Q6_K: FMT_Q6_K}
DENSE_TYPES = frozenset({0, 1, 24, 25, 26, 27, 28, 30})  # floats and plain integers
_FOUR_BIT_OR_LESS = frozenset({10, 11, 12, 16, 17, 18, 19, 20, 21, 22, 23, 29, 34, 35, 39, 40, 41})


@dataclass
class PackedWeight:
    """A ``[rows, cols]`` weight as packed blocks: ``data`` is uint8 ``[rows, row_bytes]``.
    ``copied``: its bytes are a copy made at load outside the model's arena (a fused Q4_0
    stack, which may take the stream layout), not the file's pages, so that
    :class:`QuantLinear` moves them into its :class:`WeightArena` where it has one."""

    fmt: int
    data: torch.Tensor
    cols: int
    copied: bool = False

    def __post_init__(self) -> None:
        # The kernels step through rows by their byte length: the data must be contiguous.
        self.data = self.data.contiguous()

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)


@dataclass
class PackedParts:
    """A fused projection (QKV, gate/up) whose parts are packed in different formats, each kept
    as it is (:class:`SplitQuantLinear`): e.g. a Q4_K_M file's Q6_K V beside its Q4_K Q and K."""

    parts: list[PackedWeight]

    def __post_init__(self) -> None:
        if len({p.cols for p in self.parts}) != 1:
            raise ValueError("cannot fuse packed weights of different widths")

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def cols(self) -> int:
        return self.parts[0].cols


def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack packed weights of one format and width along rows (a fused projection)."""
    fmt, cols = parts[0].fmt, parts[0].cols
    if any(p.fmt != fmt or p.cols != cols for p in parts):
        raise ValueError("cannot fuse packed weights of different formats or widths")
    return PackedWeight(fmt, torch.cat([p.data for p in parts]), cols)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def pack_float(weight: np.ndarray, fmt: int) -> PackedWeight:
    """Quantize a float ``[rows, cols]`` array (cols a multiple of 32) to ``fmt``.

    Q8_0: scale = max |w| / 127 per block, q = round(w / scale). Q4_1: scale = (max - min) / 15,
    offset = min, q = round((w - offset) / scale) in [0, 15]. Q4_0: scale = -e / 8 for the
    block's value e of largest magnitude (so e is stored exactly as q = 0), q = round(w / scale)
    + 8 in [0, 15]. Each rounds with the fp16 scale that is stored, so the stored blocks decode
    to the nearest grid point.
    """
    rows, cols = weight.shape
    blocks = weight.astype(np.float32).reshape(rows, cols // BLOCK, BLOCK)
    if fmt == FMT_Q4_0:
        return _pack_q4_0(blocks, cols)
    if fmt == FMT_Q8_0:
        scale = (np.abs(blocks).max(axis=-1) / 127.0).astype(np.float16).astype(np.float32)
        inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
        q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
        out = np.concatenate((_fp16_bytes(scale), q.view(np.uint8)), axis=-1)
    else:
        low, high = blocks.min(axis=-1), blocks.max(axis=-1)
        scale = ((high - low) / 15.0).astype(np.float16).astype(np.float32)
        offset = low.astype(np.float16).astype(np.float32)
        inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
        q = np.clip(np.rint((blocks - offset[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
        nibbles = q[..., :16] | (q[..., 16:] << 4)
        out = np.concatenate((_fp16_bytes(scale), _fp16_bytes(offset), nibbles), axis=-1)
    return PackedWeight(fmt, torch.from_numpy(np.ascontiguousarray(out).reshape(rows, -1)), cols)


def _pack_q4_0(blocks: np.ndarray, cols: int) -> PackedWeight:
    """Float blocks ``[rows, cols / 32, 32]`` as Q4_0 (see :func:`pack_float`)."""
    rows = blocks.shape[0]
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], -1)[..., 0]
    scale = (extreme / -8.0).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    q = np.clip(np.rint(blocks * inv[..., None]) + 8, 0, 15).astype(np.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    out = np.concatenate((_fp16_bytes(scale), nibbles), axis=-1)
    return PackedWeight(FMT_Q4_0, torch.from_numpy(np.ascontiguousarray(out).reshape(rows, -1)),
                        cols)


def q4_0_to_q4_1(raw: np.ndarray, cols: int) -> PackedWeight:
    """Q4_0 blocks (fp16 d, 16 nibble bytes; w = d * (q - 8)) as Q4_1 (offset -8 d), exactly."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, cols // BLOCK, 18)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0]
    offset = _fp16_bytes(scale.astype(np.float32) * -8.0)
    out = np.concatenate((blocks[..., :2], offset, blocks[..., 2:]), axis=-1)
    return PackedWeight(FMT_Q4_1, torch.from_numpy(np.ascontiguousarray(out).reshape(rows, -1)),
                        cols)


def _q5_0_to_q8_0(raw: np.ndarray, cols: int) -> PackedWeight:
    """Q5_0 blocks (fp16 d, 32 high bits, 16 nibble bytes; w = d * (q - 16), q < 32) as Q8_0
    (the same d, the bytes q - 16), exactly."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, cols // BLOCK, 22)
    high = blocks[..., 2:6].copy().view(np.uint32)  # [rows, blocks, 1]
    bits = (high >> np.arange(32, dtype=np.uint32)) & 1
    nibbles = blocks[..., 6:]
    low = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1)
    q = (low | (bits.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    out = np.concatenate((blocks[..., :2], q.view(np.uint8)), axis=-1)
    return PackedWeight(FMT_Q8_0, torch.from_numpy(np.ascontiguousarray(out).reshape(rows, -1)),
                        cols)


def pack_gguf(raw: np.ndarray, ggml_type: int, cols: int,
              values: Callable[[], np.ndarray], target: int | None = None) -> PackedWeight | None:
    """A GGUF tensor's packed form, or None when it stays dense (float types, odd widths).

    ``raw`` is the tensor's bytes as uint8 ``[rows, row_bytes]``; ``values()`` its float32
    values ``[rows, cols]``, called only for a tensor that is requantized. ``target`` forces a
    format (``--weights int8|int4``: float tensors are quantized too); None keeps the file's
    precision class as the module docstring lists.
    """
    if cols % BLOCK or (target is None and ggml_type in DENSE_TYPES):
        return None
    if target is None and ggml_type in _KEPT_K and cols % SUPER_BLOCK == 0:
        return PackedWeight(_KEPT_K[ggml_type], torch.from_numpy(raw), cols)
    if ggml_type == _Q4_1 and target in (None, FMT_Q4_1):
        return PackedWeight(FMT_Q4_1, torch.from_numpy(raw), cols)
    if ggml_type == _Q8_0 and target in (None, FMT_Q8_0):
        return PackedWeight(FMT_Q8_0, torch.from_numpy(raw), cols)
    if ggml_type == _Q4_0 and target is None:
        return PackedWeight(FMT_Q4_0, torch.from_numpy(raw), cols)
    if ggml_type == _Q4_0 and target == FMT_Q4_1:
        return q4_0_to_q4_1(raw, cols)
    if ggml_type == _Q5_0 and target in (None, FMT_Q8_0):
        return _q5_0_to_q8_0(raw, cols)
    if target is None:
        target = FMT_Q4_1 if ggml_type in _FOUR_BIT_OR_LESS else FMT_Q8_0
    return pack_float(values(), target)


def dequantize_packed(weight: PackedWeight) -> torch.Tensor:
    """The float32 ``[rows, cols]`` values of ``weight`` (through the kernel library)."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    _library().dequantize(weight.data.data_ptr(), weight.fmt, weight.cols, None, 0, weight.rows,
                          out.data_ptr())
    return out


def _library() -> ctypes.CDLL:
    lib = quant_kernels.kernels()
    if lib is None:
        raise RuntimeError(f"quantized kernels unavailable: {quant_kernels.build_error()}")
    return lib


class WeightArena:
    """Room for a model's packed weights that are copies (the stream layout's, fused stacks)
    in mappings of transparent huge pages (:func:`~prefixserve.model.pages.huge_page_area`):
    a decode step streams every weight from end to end, and base-size pages cost a TLB miss
    every 4 KiB of it. ``chunk`` bytes a mapping, handed out in order, each piece on a 64-byte
    boundary; a piece that does not fit the rest of the current mapping starts a new one (the
    rest, never written, takes no memory). The pieces sit side by side, so small weights (the
    default model's) share huge pages instead of each leaving one partly unused."""

    def __init__(self, chunk: int = 256 << 20) -> None:
        self.chunk = chunk
        self._area: mmap.mmap | None = None
        self._used = self._end = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` uninitialized bytes (uint8), a storage of their own (``module_bytes``
        counts them, not the mapping), which keeps the mapping alive."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        start = -(-self._used // 64) * 64
        if self._area is None or start + nbytes > self._end:
            size = max(self.chunk, nbytes)
            self._area, start = huge_page_area(size)
            self._end = start + size
        self._used = start + nbytes
        return torch.frombuffer(self._area, dtype=torch.uint8, count=nbytes, offset=start)

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """An uninitialized contiguous tensor of ``tensor``'s dtype and shape (:meth:`take`)."""
        nbytes = tensor.numel() * tensor.element_size()
        return self.take(nbytes).view(tensor.dtype).view(tensor.shape)


def _moved(weight: PackedWeight, arena: WeightArena) -> PackedWeight:
    """``weight``'s bytes copied into ``arena`` (the old ones are freed with ``weight``)."""
    data = arena.empty_like(weight.data)
    data.copy_(weight.data)
    return PackedWeight(weight.fmt, data, weight.cols)


def stream_layout(weight: PackedWeight, lib: ctypes.CDLL,
                  arena: WeightArena | None = None) -> PackedWeight:
    """A Q4_0 weight's bytes moved into the stream layout (``kernels/stream.c``): a copy in
    memory (taken from ``arena`` where given), where the file's layout may be pages of the
    mapped file. The one-row kernel (a decode step of one sequence, or row after row up to 7)
    reads it at the memory's speed; every other product unpacks groups of four rows. Both give
    the file layout's results exactly."""
    data = torch.empty_like(weight.data) if arena is None else arena.empty_like(weight.data)
    lib.repack_q4_0s(weight.data.data_ptr(), weight.rows, weight.cols, data.data_ptr())
    return PackedWeight(FMT_Q4_0S, data, weight.cols)


def share_amx_rows(layers: nn.Module) -> None:
    """Gives every :class:`QuantLinear` in ``layers`` (a model's decoder layers) the largest
    ``amx_from`` among them (K-quant ones keep 0: never). The fused decode step rounds the rows
    of all its products one way, to bfloat16 for the tiles or to 16 bits, from one row count
    (``DecodeModel.amx_from``), and each product of an eager step must take the tiles from
    that count too to give the same bits: 8 rows where any weight of the stack is Q4_0, else
    4."""
    linears = [m for m in layers.modules() if isinstance(m, QuantLinear) and m.amx_from > 0]
    shared = max((m.amx_from for m in linears), default=0)
    for module in linears:
        module.amx_from = shared


class QuantLinear(nn.Module):
    """``y = x W^T (+ b)`` with W packed (:class:`PackedWeight`); output in the input's dtype.

    ``qweight`` is a non-persistent buffer (it follows ``.to()`` but is not in the state dict);
    ``bias`` is an ordinary parameter or None.
    """

    qweight: torch.Tensor

    def __init__(self, weight: PackedWeight, bias: bool = False, stream: bool = True,
                 arena: WeightArena | None = None) -> None:
        super().__init__()
        self._lib = _library()
        if stream and weight.fmt == FMT_Q4_0 and self._lib.q4_0s_fits(weight.rows, weight.cols):
            weight = stream_layout(weight, self._lib, arena)
        elif weight.copied and arena is not None:
            weight = _moved(weight, arena)
        self.fmt = weight.fmt
        self.in_features = weight.cols
        self.out_features = weight.rows
        self.register_buffer("qweight", weight.data, persistent=False)
        self.bias = nn.Parameter(torch.empty(weight.rows)) if bias else None
        self.activation_bits = ACTIVATION_BITS
        kquant = self.fmt in K_FORMATS  # 16-bit integer kernels and expand-and-GEMM only
        self.bf16_batch_from = 0 if kquant else self._lib.bf16_batch_rows()
        """Rows from which a bfloat16 input of at most BF16_BATCH_MAX rows takes the bfloat16
        batch kernel: the library's threshold (8; 0 where it has no such kernel, no
        AVX512-BF16), the one the fused decode step uses too."""
        q4_0 = self.fmt in (FMT_Q4_0, FMT_Q4_0S)
        self.amx_from = 0 if kquant else (self._lib.amx_q4_0_rows() if q4_0
                                          else self._lib.amx_rows())
        """Rows from which a bfloat16 input of at most AMX_MAX rows takes the AMX kernel (0
        where the library has none: no AMX, or the OS refused the tile state): 4, or 8 for a
        Q4_0 weight, whose one-row kernel in the stream layout takes up to 7 rows for less
        (``amx_rows``, ``amx_q4_0_rows`` in ``kernels/quant.c``); see
        :func:`share_amx_rows`."""
        self.native_bf16 = cpu_has_native_bfloat16()
        """Whether a bfloat16 prefill multiplies in bfloat16 (where the CPU has the instructions;
        elsewhere torch emulates them, slower than the float32 GEMM)."""
        self.row_invariant = False
        """True: one kernel at every row count (bfloat16 rows: the bfloat16 batch kernel where
        the library has it and ``invariant_batch_kernel`` is set; other rows: the 16-bit
        integer kernel), so that a row's result does not depend on how many rows the product
        has (the deterministic mode; see :mod:`prefixserve.model.attention.batch_invariant`)."""
        self.panel = self._lib.panel_rows() > 0
        """Whether a float32 product of more than SMALL_M rows takes the panel kernel
        (``kernels/panel.c``: every AVX2 build) rather than expand-and-GEMM."""
        self.amx_large_max_outputs = AMX_LARGE_MAX_OUTPUTS
        """Rows x outputs up to which more than AMX_MAX bfloat16 rows take the large-row AMX
        kernel (0: never)."""
        self.invariant_batch_kernel = True
        """Which kernel ``row_invariant`` keeps for bfloat16 rows: the batch kernel (faster
        from a few rows on), or the integer kernel (False: faster for one row over a large
        weight, the choice for an output head, whose products have one row per sequence)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        small = flat.shape[0] <= SMALL_M or self.row_invariant
        bf16 = flat.dtype == torch.bfloat16 and flat.device.type == "cpu"
        if bf16 and self._amx_rows(flat.shape[0]):
            y = self._bf16_amx(flat.contiguous())
        elif bf16 and self._amx_large_rows(flat.shape[0]):
            y = self._bf16_amx_large(flat.contiguous())
        elif bf16 and self._bf16_batch_rows(flat.shape[0]):
            y = self._bf16_batch(flat.contiguous())
        elif bf16 and not small and self.native_bf16:
            y = self._large(flat.contiguous(), torch.bfloat16)
        else:
            if flat.dtype != torch.float32 or not flat.is_contiguous():
                flat = flat.float().contiguous()
            y = self._small(flat) if small else self._prefill(flat)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _rounded(self, x: torch.Tensor, wide: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The rows of x rounded per block of 32 to 16 (wide) or 8 bits: the integers, their
        block scales followed by the block sums, and the address of the sums."""
        rows, cols = x.shape
        blocks = rows * cols // BLOCK
        xq = torch.empty(rows * cols, dtype=torch.int16 if wide else torch.int8)
        scales = torch.empty(2 * blocks, dtype=torch.float32)
        sums_ptr = scales.data_ptr() + 4 * blocks
        quantize = self._lib.quantize_q16 if wide else self._lib.quantize_q8
        quantize(x.data_ptr(), rows, cols, xq.data_ptr(), scales.data_ptr(), sums_ptr)
        return xq, scales, sums_ptr

    def _small(self, x: torch.Tensor) -> torch.Tensor:
        """The integer kernel: activations rounded per block to 16 (or 8) bits, then products."""
        rows, cols = x.shape
        wide = self.activation_bits == 16 or self.fmt in K_FORMATS
        xq, scales, sums_ptr = self._rounded(x, wide)
        y = torch.empty((rows, self.out_features), dtype=torch.float32)
        if not wide:
            gemm = self._lib.gemm_quant
        else:  # the batch kernel is faster from 8 rows, but its rows depend on the row count
            gemm = self._lib.gemm_quant16 if self.row_invariant else self._lib.gemm_quant16_batch
        gemm(self.qweight.data_ptr(), self.fmt, self.out_features, cols, xq.data_ptr(),
             scales.data_ptr(), sums_ptr, rows, y.data_ptr(), self.out_features)
        return y

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        """A float32 product of more than SMALL_M rows: the panel kernel where the library has
        it (``kernels/panel.c``: activations rounded per block to 16 bits as in
        :meth:`_small`), else expand-and-GEMM."""
        if not self.panel:
            return self._large(x, torch.float32)
        rows, cols = x.shape
        xq, scales, sums_ptr = self._rounded(x, True)
        y = torch.empty((rows, self.out_features), dtype=torch.float32)
        if self._lib.gemm_panel(self.qweight.data_ptr(), self.fmt, self.out_features, cols,
                                xq.data_ptr(), scales.data_ptr(), sums_ptr, rows,
                                y.data_ptr(), self.out_features) != 0:
            return self._large(x, torch.float32)  # memory lacking for the panels
        return y

    def _amx_rows(self, rows: int) -> bool:
        """Whether a bfloat16 input of ``rows`` rows takes the AMX kernel: where the library
        has it (``amx_from`` > 0), from ``amx_from`` to ``AMX_MAX`` rows, never in the
        deterministic mode (which keeps the batch kernel at every row count)."""
        return (not self.row_invariant and self.activation_bits == 16
                and 0 < self.amx_from <= rows <= AMX_MAX)

    def _bf16_amx(self, x: torch.Tensor) -> torch.Tensor:
        """The AMX kernel: weight blocks expanded to bfloat16 tiles, the bfloat16 rows as
        they are, sums in float32 (``kernels/quant.c``, ``gemm_bf16_amx``)."""
        rows, cols = x.shape
        n = self.out_features
        y = torch.empty((rows, n), dtype=torch.float32)
        packed = torch.empty(self._lib.amx_packed_words(rows, cols), dtype=torch.int32)
        self._lib.gemm_bf16_amx(self.qweight.data_ptr(), self.fmt, n, cols, x.data_ptr(), rows,
                                packed.data_ptr(), y.data_ptr(), n)
        return y

    def _amx_large_rows(self, rows: int) -> bool:
        """Whether a bfloat16 input of ``rows`` rows takes the large-row AMX kernel: where the
        library has AMX, from AMX_MAX to AMX_LARGE_MAX_ROWS rows, up to
        ``amx_large_max_outputs`` rows x outputs, never in the deterministic mode."""
        return (not self.row_invariant and self.activation_bits == 16 and self.amx_from > 0
                and AMX_MAX < rows <= AMX_LARGE_MAX_ROWS
                and rows * self.out_features <= self.amx_large_max_outputs)

    def _bf16_amx_large(self, x: torch.Tensor) -> torch.Tensor:
        """The large-row AMX kernel: bfloat16 outputs, float32 sums rounded once
        (``kernels/quant.c``, ``gemm_bf16_amx_large``)."""
        rows, cols = x.shape
        n = self.out_features
        y = torch.empty((rows, n), dtype=torch.bfloat16)
        self._lib.gemm_bf16_amx_large(self.qweight.data_ptr(), self.fmt, n, cols, x.data_ptr(),
                                      rows, y.data_ptr(), n)
        return y

    def _bf16_batch_rows(self, rows: int) -> bool:
        """Whether a bfloat16 input of ``rows`` rows takes the bfloat16 batch kernel, where
        the library has it and activations have 16 bits: from ``bf16_batch_from`` to
        ``BF16_BATCH_MAX`` rows, or at every row count in the deterministic mode (a row's
        sums there are the same whatever the row count: each output is one accumulator's
        blocks in order, then the same reduction, see ``kernels/quant.c``)."""
        if self.bf16_batch_from == 0 or self.activation_bits != 16:
            return False
        if self.row_invariant:
            return self.invariant_batch_kernel
        return self.bf16_batch_from <= rows <= BF16_BATCH_MAX

    def _bf16_batch(self, x: torch.Tensor) -> torch.Tensor:
        """The bfloat16 batch kernel: weight blocks expanded to bfloat16 in registers, the
        bfloat16 rows as they are, sums in float32; in slices of ``BF16_BATCH_MAX`` rows (a
        slice's activations stay in the core's cache while the weights stream past)."""
        rows, cols = x.shape
        n = self.out_features
        y = torch.empty((rows, n), dtype=torch.float32)
        for first in range(0, rows, BF16_BATCH_MAX):
            m = min(BF16_BATCH_MAX, rows - first)
            self._lib.gemm_bf16_batch(self.qweight.data_ptr(), self.fmt, n, cols,
                                      x[first].data_ptr(), m, y[first].data_ptr(), n)
        return y

    def _large(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Slices of the weight expanded to ``dtype`` (float32, or bfloat16 for a bfloat16
        model: the dense path's GEMM, native on CPUs with AVX512-BF16 or AMX), then torch's
        GEMM in that dtype."""
        n, k = self.out_features, self.in_features
        step = max(1, _SLICE_ELEMENTS // k)
        if step >= n:
            return x @ self._expand(0, n, dtype).t()
        y = torch.empty((x.shape[0], n), dtype=dtype)
        for first in range(0, n, step):
            last = min(n, first + step)
            y[:, first:last] = x @ self._expand(first, last, dtype).t()
        return y

    def _expand(self, first: int, last: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = torch.empty((last - first, self.in_features), dtype=dtype)
        expand = self._lib.dequantize_bf16 if dtype == torch.bfloat16 else self._lib.dequantize
        expand(self.qweight.data_ptr(), self.fmt, self.in_features, None, first, last - first,
               out.data_ptr())
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={FORMAT_NAMES[self.fmt]}, bias={self.bias is not None}")


class SplitQuantLinear(nn.Module):
    """``y = x W^T (+ b)`` for a fused projection whose parts are packed in different formats
    (:class:`PackedParts`): each part a :class:`QuantLinear` of its own rows (``parts``), their
    outputs side by side. The fused decode step takes the parts as they are (``decode.c``,
    ``team_parts``)."""

    def __init__(self, weight: PackedParts, bias: bool = False, stream: bool = True,
                 arena: WeightArena | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(QuantLinear(part, stream=stream, arena=arena)
                                   for part in weight.parts)
        self.in_features = weight.cols
        self.out_features = weight.rows
        self.bias = nn.Parameter(torch.empty(weight.rows)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def part_layers(self) -> list[QuantLinear]:
        """The parts, in the order of their output columns."""
        return [cast(QuantLinear, part) for part in self.parts]

    def extra_repr(self) -> str:
        formats = ", ".join(f"{FORMAT_NAMES[p.fmt]} x {p.out_features}" for p in self.part_layers())
        return f"in_features={self.in_features}, parts=[{formats}], bias={self.bias is not None}"


class QuantEmbedding(nn.Module):
    """A token embedding with packed rows; also the tied output head (:meth:`logits`)."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype, stream: bool = True,
                 arena: WeightArena | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.head = QuantLinear(weight, stream=stream, arena=arena)
        self._lib = self.head._lib

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        out = torch.empty((flat.numel(), self.embedding_dim), dtype=torch.float32)
        self._lib.dequantize(self.head.qweight.data_ptr(), self.head.fmt, self.embedding_dim,
                             flat.data_ptr(), 0, flat.numel(), out.data_ptr())
        return out.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def module_bytes(module: nn.Module) -> int:
    """Bytes held by a module's parameters and buffers (each storage counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += tensor.untyped_storage().nbytes()
    return total
