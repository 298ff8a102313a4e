"""The quantized-weight CPU kernels (``kernels/quant.c``): built at first use, loaded with ctypes.

The C file is compiled once per source version, flags and CPU (``-O3 -march=native -fopenmp``,
then ``$PREFIXSERVE_KERNEL_FLAGS``) into
``$PREFIXSERVE_CACHE_DIR/kernels`` (default ``~/.cache/prefixserve/kernels``); later processes
load the cached library. A build writes to a temporary name and renames it, so concurrent
processes never load a half-written file. :func:`kernels` returns None where no C compiler is
found or the build fails (the loader then keeps weights dequantized, see
:mod:`prefixserve.model.weights.quant`); :func:`build_error` says why.

The library links the OpenMP runtime that torch has already loaded (same soname), so its
parallel loops and torch's share one thread pool and one ``torch.set_num_threads`` setting.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prefixserve.model.cache_paths import cache_root

_SOURCE = Path(__file__).parent.parent / "kernels" / "quant.c"

#: Format codes shared with the C file.
FMT_Q4_1 = 0
FMT_Q8_0 = 1
FMT_Q4_K = 2
FMT_Q6_K = 3
FMT_Q4_0 = 4
FMT_Q5_K = 5
#: Q4_0 in the stream layout (``kernels/stream.c``): the one-row product's, made at load.
FMT_Q4_0S = 6


@dataclass
class KernelLibrary:
    """One C file of ``kernels/``, built and loaded at the first :meth:`get` (once per process):
    ``declare`` sets its functions' argument types. :meth:`get` returns None where it cannot
    be built or loaded, and ``error`` then says why."""

    source: Path
    declare: Callable[[ctypes.CDLL], None]
    flags: tuple[str, ...] = ()
    """Compiler flags after the default ones (e.g. ``-mno-avx512f``, to build another ISA's
    kernels for a test)."""
    lib: ctypes.CDLL | None = None
    tried: bool = False
    error: str | None = None

    def get(self) -> ctypes.CDLL | None:
        if not self.tried:
            self.tried = True
            try:
                lib = load_library(self.source, self.flags)
                self.declare(lib)
                self.lib = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", None) or str(exc)
                self.error = f"{type(exc).__name__}: {detail}".strip()
        return self.lib


def cache_dir() -> Path:
    """Where built kernels are kept (``$PREFIXSERVE_CACHE_DIR/kernels``)."""
    return Path(cache_root()) / "kernels"


def _cpu_signature() -> str:
    """Something that changes when ``-march=native`` would produce different code."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    parts.append(line.strip())
                    if len(parts) >= 3:
                        break
    except OSError:
        pass
    return "\n".join(parts)


def _flags() -> list[str]:
    """The compiler flags of every kernel build: ``-march=native`` where the compiler takes it,
    then ``$PREFIXSERVE_KERNEL_FLAGS`` (e.g. ``-mno-avx512f``: the AVX2 kernels on an AVX-512
    machine, to measure them or to match other machines of a fleet)."""
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11"]
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        flags.append("-march=native")
    return flags + shlex.split(os.environ.get("PREFIXSERVE_KERNEL_FLAGS", ""))


def _build(compiler: str, target: Path, source: Path = _SOURCE,
           extra: tuple[str, ...] = ()) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_flags(), *extra, str(source), "-o", tmp, "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quantize_q8.argtypes = [p, i64, i64, p, p, p]
    lib.quantize_q8.restype = None
    lib.gemm_quant.argtypes = [p, c_int, i64, i64, p, p, p, i64, p, i64]
    lib.gemm_quant.restype = None
    lib.dequantize.argtypes = [p, c_int, i64, p, i64, i64, p]
    lib.dequantize.restype = None
    lib.dequantize_bf16.argtypes = [p, c_int, i64, p, i64, i64, p]
    lib.dequantize_bf16.restype = None
    lib.bf16_batch_rows.argtypes = []
    lib.bf16_batch_rows.restype = c_int
    lib.gemm_bf16_batch.argtypes = [p, c_int, i64, i64, p, i64, p, i64]
    lib.gemm_bf16_batch.restype = None
    lib.quantize_q16.argtypes = [p, i64, i64, p, p, p]
    lib.quantize_q16.restype = None
    lib.gemm_quant16.argtypes = [p, c_int, i64, i64, p, p, p, i64, p, i64]
    lib.gemm_quant16.restype = None
    lib.gemm_quant16_batch.argtypes = lib.gemm_quant16.argtypes
    lib.gemm_quant16_batch.restype = None
    lib.amx_rows.argtypes = []
    lib.amx_rows.restype = c_int
    lib.amx_q4_0_rows.argtypes = []
    lib.amx_q4_0_rows.restype = c_int
    lib.amx_packed_words.argtypes = [i64, i64]
    lib.amx_packed_words.restype = i64
    lib.gemm_bf16_amx.argtypes = [p, c_int, i64, i64, p, i64, p, p, i64]
    lib.gemm_bf16_amx.restype = None
    lib.gemm_bf16_amx_large.argtypes = [p, c_int, i64, i64, p, i64, p, i64]
    lib.gemm_bf16_amx_large.restype = None
    lib.q4_0s_fits.argtypes = [i64, i64]
    lib.q4_0s_fits.restype = c_int
    lib.repack_q4_0s.argtypes = [p, i64, i64, p]
    lib.repack_q4_0s.restype = None
    lib.panel_rows.argtypes = []
    lib.panel_rows.restype = c_int
    lib.gemm_panel.argtypes = lib.gemm_quant16.argtypes
    lib.gemm_panel.restype = c_int
    lib.panel_peak.argtypes = [i64]
    lib.panel_peak.restype = ctypes.c_double
    # Asks Linux for the AMX tile state now, once, before any thread multiplies on tiles.
    lib.amx_rows()


def load_library(source: Path, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (once per source version, flags and CPU) and load the C file ``source`` of
    ``kernels/``, with the compiler flags ``extra`` after the default ones; raises OSError,
    RuntimeError or SubprocessError when that fails. The caller declares the argument types.
    (Other kernel files, e.g. the batch-invariant ones, are built the same way as
    ``quant.c``.)"""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    text = _source_text(source)
    flags = " ".join([*_flags(), *extra])
    key = hashlib.sha256(text + flags.encode() + _cpu_signature().encode())
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        if compiler is None:
            raise RuntimeError(f"no C compiler (cc or gcc) found to build {source.name}")
        _build(compiler, target, source, extra)
    import torch  # noqa: F401  (load torch's OpenMP runtime first, so the kernels share it)

    return ctypes.CDLL(str(target))


def _source_text(source: Path) -> bytes:
    """The bytes of ``source`` and of the files of ``kernels/`` it includes (``#include
    "name"``), so that a change to an included file builds the library again."""
    text = source.read_bytes()
    for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE):
        text += _source_text(source.with_name(name.decode()))
    return text


_quant = KernelLibrary(_SOURCE, _declare)


def kernels() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None if it cannot be built."""
    return _quant.get()


def build_error() -> str | None:
    """Why :func:`kernels` returned None (None while it has not been tried or it worked)."""
    return _quant.error
