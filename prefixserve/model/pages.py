"""Anonymous memory of base-size pages: zeros that cost neither time nor memory until written.

The KV pool (``kv_pool.py``) and tensors dequantized from a GGUF file (``weights/gguf_file.py``)
live in private anonymous mappings advised against transparent huge pages
(``MADV_NOHUGEPAGE``). numpy asks for huge pages on its large arrays, and a huge page costs at
its first touch: the kernel clears 2 MiB (and keeps it resident where a KV block needs
kilobytes), and where ``transparent_hugepage/defrag`` is ``madvise`` (a common default) it
compacts memory to find one. On a 2-core VM a KV block's first write in each layer took 20-45
ms that way, and Gemma 3's dense load twice as long. A kernel without transparent huge pages
refuses the advice (EINVAL): there is nothing to avoid then.

Imports nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import mmap


def base_page_area(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` bytes (at least one), zeros until written,
    page-aligned, advised against transparent huge pages where the kernel has them. Raises what
    ``mmap.mmap`` raises (``OSError``, ``OverflowError``) where the system refuses the memory."""
    area = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    with contextlib.suppress(AttributeError, OSError):
        area.madvise(mmap.MADV_NOHUGEPAGE)
    return area
