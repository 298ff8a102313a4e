"""Where prefixserve keeps what it builds or computes once per machine."""

from __future__ import annotations

import os


def cache_root() -> str:
    """``$PREFIXSERVE_CACHE_DIR``, default ``~/.cache/prefixserve``: built kernels, assembled
    models and file digests live in folders below it."""
    return os.environ.get("PREFIXSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "prefixserve")
