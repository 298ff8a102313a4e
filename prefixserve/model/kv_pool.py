"""The KV pool's memory: zeros that cost neither time nor memory until a block is written.

``torch.zeros`` clears every byte of the pool at start-up (about 0.3 s of one core for the
default 1 GiB pool here) and so makes all of it resident at once, used or not. On the CPU the
pool is taken instead from ``calloc`` (numpy's zeros): an allocation of this size is a fresh
anonymous mapping, whose pages the kernel hands out already zeroed on their first write, so the
server starts without clearing anything and its resident memory grows with the blocks it
fills. The values are the same zeros either way. Other devices keep ``torch.zeros``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

ALIGNMENT = 64
"""Bytes the pool's first element is aligned to, as torch's own CPU allocator aligns (glibc
returns a mapping's memory 16 bytes past the page start)."""


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                ) -> torch.Tensor:
    """A contiguous tensor of zeros of ``shape`` and ``dtype`` on ``device``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + ALIGNMENT, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGNMENT
    return torch.from_numpy(raw[skip:skip + nbytes]).view(dtype).view(shape)
