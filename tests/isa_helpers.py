"""Which instruction sets this CPU has, for tests that build the C kernels for another one."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil

import pytest

from prefixserve.model.weights import quant_kernels

#: Flags that build a kernel file for this CPU without its AVX-512 forms (the AVX2 ones).
AVX2_BUILD = ("-mno-avx512f",)


def cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split()[2:]}
    except OSError:
        return set()


def has_avx512_and_avx2() -> bool:
    """Whether the native build is an AVX-512 one that leaves AVX2 kernels out."""
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "avx512f"} <= cpu_flags()


def kernels_or_skip() -> ctypes.CDLL:
    """The packed-weight kernel library. Where it cannot be built the test skips only if this
    machine has no C compiler: with one, a build error (a kernel that does not compile on this
    CPU) fails the test instead of hiding every kernel test behind a skip."""
    built = quant_kernels.kernels()
    if built is not None:
        return built
    error = f"quantized kernels unavailable: {quant_kernels.build_error()}"
    if os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"):
        pytest.fail(error)
    pytest.skip(error)


def panel_build() -> bool:
    """Whether the native kernel library multiplies float32 products of more than SMALL_M
    rows in panels (``kernels/panel.c``: 16-bit activations, every AVX2 build)
    rather than expanding the weight for a float32 GEMM."""
    built = quant_kernels.kernels()
    return built is not None and built.panel_rows() > 0
