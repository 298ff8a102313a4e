"""The KV pool's memory: zeros that cost neither time nor memory until a block is written.

``torch.zeros`` clears every byte of the pool at start-up (about half a second of one core for
the default 1 GiB pool here) and so makes all of it resident at once, used or not. On the CPU the
pool is a private anonymous mapping instead, whose pages the kernel hands out already zeroed on
their first write, so the server starts without clearing anything and its resident memory grows
with the blocks it fills. The mapping keeps base-size pages (``pages.py``): with 2 MiB pages a
block's first write in each layer clears and holds 2 MiB where the block needs kilobytes (the
first step of a 1B model took 0.5-0.7 s more on a 2-core VM, 16 layers, K and V). The mapping
starts on a page, so the pool is aligned as torch's own tensors are (64 bytes) and more. The
values are the same zeros either way. Other devices keep ``torch.zeros``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from prefixserve.model.pages import base_page_area

logger = logging.getLogger(__name__)


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                ) -> torch.Tensor:
    """A contiguous tensor of zeros of ``shape`` and ``dtype`` on ``device``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    available = _available_bytes()
    if available is not None and nbytes > available:
        logger.warning("the KV pool (%d MiB) is larger than the memory available now (%d MiB): "
                       "the process may run out of memory as its blocks fill; a smaller "
                       "--kv-cache-memory or --num-blocks avoids it", nbytes >> 20,
                       available >> 20)
    try:
        area = base_page_area(nbytes)
    except (OSError, OverflowError) as exc:
        raise ValueError(f"the KV pool ({nbytes >> 20} MiB) cannot be allocated: the system "
                         "refuses that much memory; use a smaller --kv-cache-memory or "
                         "--num-blocks") from exc
    raw = np.frombuffer(area, dtype=np.uint8, count=nbytes)  # holds the mapping
    return torch.from_numpy(raw).view(dtype).view(shape)


def _available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
