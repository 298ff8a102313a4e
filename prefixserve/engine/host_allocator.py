"""glibc's allocator set up for an engine on the CPU: large activations reuse freed memory.

A prompt step allocates and frees tensors of megabytes by the hundred (each layer's
activations, the GEMMs' outputs). With glibc's defaults, part of them are mapped anew from
the kernel (its dynamic mmap threshold) or trimmed back to it when freed, so the next step
page-faults the same memory in again, zero-filled: on an Intel Xeon with AMX a 1,024-token
bfloat16 prompt ran at ~2,250 tok/s, and at ~3,000 with the settings below, for packed and
dense weights alike (benchmarks/RESULTS.md). llama.cpp allocates its
compute buffers once; this gets the engine most of that without owning its allocations.

:func:`keep_freed_memory` makes two process-wide settings through ``mallopt``: allocations
of up to 32 MiB (glibc's largest threshold) come from the heaps instead of fresh mappings,
and freed heap memory is kept for reuse instead of being returned to the kernel. The
process's resident size then stays at its peak (a step's working set: tens to hundreds of
MB). Where the environment already sets either threshold (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, or ``glibc.malloc.*_threshold`` in ``GLIBC_TUNABLES``), or the C
library is not glibc, nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""Largest allocation served from the heaps (glibc's ``DEFAULT_MMAP_THRESHOLD_MAX``)."""
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Apply the settings of this module's docstring; True when they are in effect (also
    after an earlier call), False where the user's environment or the platform decides."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(name in os.environ for name in USER_SETTINGS) or any(
            f"glibc.malloc.{name}" in tunables for name in ("mmap_threshold", "trim_threshold")):
        logger.debug("malloc thresholds left as the environment sets them")
        return False
    libc = ctypes.CDLL(None)
    # -1 as the trim threshold is SIZE_MAX to glibc (mallopt takes an int): never trim
    return (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, -1) == 1)
