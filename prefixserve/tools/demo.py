"""A demo of the prefix cache: the worked example of the design, replayed through the core."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from prefixserve.core import CacheRequest, KVCacheManager


def run_demo(block_size: int = 4) -> None:
    """Four prompts share a 16-token prefix and differ in a 4-token question; prints, for each,
    the tokens served from the cache and the tokens computed."""
    manager = KVCacheManager(num_blocks=64, block_size=block_size)
    prefix = list(range(1000, 1016))
    table = Table(title=f"Prefix cache at work (block size {block_size})")
    for column in ("request", "prompt tokens", "from cache", "computed"):
        table.add_column(column, justify="right")
    total = computed_total = 0
    for i in range(4):
        request = CacheRequest(f"q{i}", prefix + [2000 + 4 * i + j for j in range(4)])
        blocks, cached = manager.get_computed_blocks(request)
        manager.allocate_slots(request, request.num_tokens - cached, blocks)
        manager.free(request)
        manager.free_block_hashes(request)
        computed = request.num_tokens - cached
        total += request.num_tokens
        computed_total += computed
        table.add_row(request.request_id, str(request.num_tokens), str(cached), str(computed))
    table.add_row("all", str(total), str(total - computed_total), str(computed_total))
    console = Console()
    console.print(table)
    console.print(f"Prefill tokens saved: {total - computed_total} of {total} "
                  f"({(total - computed_total) / total:.0%}).")
