"""``prefixserve estimate`` per LoRA adapter: hit rates by ``lora_id``, and what splitting costs.

A LoRA id is an extra key of every block (``docs/prefix-cache.md`` section 2): the same prompt under
two adapters shares nothing. For a token or text log whose records name a ``lora_id``, the
infinite cache is replayed twice more: once as the engine keys blocks (each adapter, and the
base model, in its own namespace) and once with the LoRA ids left out (as if every request ran
on one model). Per ``lora_id`` (``None``: the base model) the report gives the requests, the
prompt tokens, the token hit rate in its own namespace and the rate it would have with shared
blocks; the difference, in prompt tokens that must be computed again, is what splitting the
traffic across adapters costs. (Figures of the infinite cache: with a finite pool the adapters
also compete for its blocks, which the pool rows of the main table include.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prefixserve.core import PrefixCacheStats
from prefixserve.tools.estimate.replay import replay_infinite
from prefixserve.tools.estimate.results import ReplaySettings
from prefixserve.tools.trace_formats import Workload

__all__ = ["LoRAFigures", "lora_figures", "print_lora_report"]


@dataclass
class LoRAFigures:
    """One ``lora_id``'s figures over the measured requests (after the warm-up)."""

    lora_id: int | str | None
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    shared_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def shared_hit_rate(self) -> float:
        return self.shared_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def lost_tokens(self) -> int:
        return self.shared_hit_tokens - self.hit_tokens


def _hits_per_request(workload: Workload, settings: ReplaySettings) -> dict[int, int]:
    hits: dict[int, int] = {}

    def note(index: int, stats: PrefixCacheStats) -> None:
        if index >= settings.warmup_requests:
            hits[index] = stats.hit_tokens

    replay_infinite(workload, settings, on_request=note)
    return hits


def lora_figures(workload: Workload, settings: ReplaySettings) -> list[LoRAFigures] | None:
    """Figures per ``lora_id`` (base model first, then in order of appearance), or None when
    no request names one."""
    requests = workload.requests
    if all(r.lora_id is None for r in requests):
        return None
    split = _hits_per_request(workload, settings)
    shared_requests = [dataclasses.replace(r, ids=r.shared_ids) if r.shared_ids is not None
                       else r for r in requests]
    shared = _hits_per_request(dataclasses.replace(workload, requests=shared_requests),
                               settings)
    figures: dict[int | str | None, LoRAFigures] = {None: LoRAFigures(None)}
    for index in split:
        request = requests[index]
        entry = figures.setdefault(request.lora_id, LoRAFigures(request.lora_id))
        entry.requests += 1
        entry.prompt_tokens += request.num_prompt_tokens
        entry.hit_tokens += split[index]
        entry.shared_hit_tokens += shared[index]
    return [f for f in figures.values() if f.requests]


def print_lora_report(figures: list[LoRAFigures]) -> None:
    """The per-adapter table and the total cost of the split."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    table = Table(title="Per LoRA adapter (infinite cache)", title_justify="left")
    for column in ("lora_id", "requests", "prompt tokens", "hit rate", "hit rate if shared",
                   "tokens lost to the split"):
        table.add_column(column, justify="left" if column == "lora_id" else "right")
    for f in figures:
        table.add_row("base model" if f.lora_id is None else str(f.lora_id), f"{f.requests:,}",
                      f"{f.prompt_tokens:,}", f"{f.hit_rate:.1%}", f"{f.shared_hit_rate:.1%}",
                      f"{f.lost_tokens:,}")
    console.print(table)
    prompt = sum(f.prompt_tokens for f in figures)
    lost = sum(f.lost_tokens for f in figures)
    split = sum(f.hit_tokens for f in figures)
    console.print(f"Splitting by adapter: {split / prompt:.1%} of prompt tokens from the cache, "
                  f"{(split + lost) / prompt:.1%} if all requests shared one namespace; "
                  f"{lost:,} more prompt tokens to compute.", highlight=False)
