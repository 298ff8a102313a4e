"""Which floating-point type the weights and the KV cache use (``--dtype``, and
``--kv-cache-dtype`` for the cache when it should differ).

``"auto"`` (the default) picks bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX
tiles: about twice as fast as float32 and half the memory), and float32 elsewhere: on a CPU
without those instructions bfloat16 products are emulated, which measured 6-11x slower than
float32 for the default model's matmuls at 256 rows, 1.2-1.7x at one row, on an AVX2-only AMD
EPYC (``benchmarks/bench_dtype.py``, benchmarks/RESULTS.md). Any other device gets bfloat16.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = ("auto", *DTYPES)


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU has bfloat16 matmul instructions (AVX512-BF16 or AMX tiles)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon, Sapphire Rapids and later), on which
    torch's bfloat16 GEMMs and attention run (oneDNN)."""
    return bool(torch.cpu._is_amx_tile_supported())


def resolve_kv_cache_dtype(name: str, activations: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for ``name`` (one of ``DTYPE_NAMES``): ``"auto"`` is the
    activations' dtype; float16 or bfloat16 beside float32 activations halve the bytes a
    decode step reads (K/V are rounded as they are written, and read back as float32)."""
    return activations if name == "auto" else DTYPES[name]


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """The torch dtype for ``name`` (one of ``DTYPE_NAMES``) on ``device``."""
    if name != "auto":
        return DTYPES[name]
    if device != "cpu" or cpu_has_native_bfloat16():
        return torch.bfloat16
    return torch.float32
