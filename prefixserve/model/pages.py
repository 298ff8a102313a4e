"""Anonymous memory by page size: base-size pages (zeros that cost neither time nor memory
until written) for what is written piecemeal, huge pages for what is streamed whole.

The KV pool (``kv_pool.py``) and tensors dequantized from a GGUF file (``weights/gguf_file.py``)
live in private anonymous mappings advised against transparent huge pages
(``MADV_NOHUGEPAGE``). numpy asks for huge pages on its large arrays, and a huge page costs at
its first touch: the kernel clears 2 MiB (and keeps it resident where a KV block needs
kilobytes), and where ``transparent_hugepage/defrag`` is ``madvise`` (a common default) it
compacts memory to find one. On a 2-core VM a KV block's first write in each layer took 20-45
ms that way, and Gemma 3's dense load twice as long. A kernel without transparent huge pages
refuses the advice (EINVAL): there is nothing to avoid then.

Packed weights that are copies (fused stacks, the stream layout's) go the other way: every
decode step reads them from end to end, and with base-size pages that is a TLB miss every 4
KiB. In mappings advised for transparent huge pages (``MADV_HUGEPAGE``, :func:`huge_page_area`)
the weights of a 1B Q4_0 model streamed at 97% of the machine's read rate instead of 80%
(Xeon, ``benchmarks/real_size.py``; ``benchmarks/RESULTS.md``).

Imports nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap

HUGE_PAGE = 2 << 20
"""The transparent huge page size of x86-64 Linux (the alignment :func:`huge_page_area` gives)."""


def base_page_area(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` bytes (at least one), zeros until written,
    page-aligned, advised against transparent huge pages where the kernel has them. Raises what
    ``mmap.mmap`` raises (``OSError``, ``OverflowError``) where the system refuses the memory."""
    area = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    with contextlib.suppress(AttributeError, OSError):
        area.madvise(mmap.MADV_NOHUGEPAGE)
    return area


def huge_page_area(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with room for ``nbytes`` bytes from a ``HUGE_PAGE``
    boundary, and that boundary's offset in it: zeros until written. The whole huge pages of
    those bytes are advised for transparent huge pages where the kernel has them; the rest
    (a tail, or all of fewer than ``HUGE_PAGE`` bytes) keeps base-size pages, so that no huge
    page holds more unused than used bytes. A kernel without transparent huge pages refuses
    the advice, and every page stays base-size. Raises what ``mmap.mmap`` raises where the
    system refuses the memory."""
    area = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    first = ctypes.c_char.from_buffer(area)
    start = -ctypes.addressof(first) % HUGE_PAGE
    del first  # the export would keep the map from closing
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole:
        with contextlib.suppress(AttributeError, OSError):
            area.madvise(mmap.MADV_HUGEPAGE, start, whole)
    return area, start
