"""What ``prefixserve estimate`` shows: a rich table, a JSON file and a two-panel plot."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from prefixserve.tools.estimate.results import CacheResult, Estimate


def _count(n: int) -> str:
    """``12,031``; ``144.8M`` from ten million on, ``6.0G`` from ten billion on."""
    if n >= 10_000_000_000:
        return f"{n / 1e9:.1f}G"
    return f"{n / 1e6:.1f}M" if n >= 10_000_000 else f"{n:,}"


def _short(n: float) -> str:
    """Three significant digits with a K/M/G suffix: ``16K``, ``7.69M``."""
    for suffix, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.3g}"


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _capacity_label(result: CacheResult) -> str:
    return "infinite" if result.infinite else f"{result.capacity_blocks:,} blocks"


def _describe_blocks(estimate: Estimate) -> str:
    workload = estimate.workload
    bs = workload.block_size
    text = f"{_count(workload.num_prompt_blocks)} full prompt blocks of {bs} tokens"
    tbs = workload.trace_block_size
    if tbs is not None and workload.expansion > 1:
        text += f" (trace blocks of {tbs} split in {workload.expansion})"
    elif tbs is not None and tbs < bs:
        text += f" (trace blocks of {tbs} merged by {bs // tbs})"
    distinct = estimate.infinite.distinct_blocks
    if distinct is not None:
        text += f", {_count(distinct)} distinct"
    return text


def _window_text(estimate: Estimate) -> str:
    n = len(estimate.workload.requests)
    warmup = estimate.settings.warmup_requests
    if not warmup:
        return f"Figures over all {n:,} requests"
    return (f"Figures over requests {warmup + 1:,}-{n:,} (after a warm-up of "
            f"{estimate.warmup_fraction:.0%})")


def build_table(estimate: Estimate) -> Table:
    """One row per cache: size, hit rates, tokens saved, speed-up bound, hit share."""
    bs = estimate.workload.block_size
    kv_bytes = estimate.kv_bytes_per_token
    show_too_large = any(r.requests_too_large for r in estimate.results)
    table = Table(title=f"What prefix caching would buy (blocks of {bs} tokens)",
                  title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1),
                  collapse_padding=True, pad_edge=False, show_edge=False)
    headers = ["KV cache\nblocks", "\ntokens"]
    if kv_bytes:
        headers.append("\nmemory")
    headers += ["hit rate\nblocks", "hit rate\ntokens", "tokens\nsaved", "speed-up\nbound",
                "requests\nwith hit"]
    tiered = estimate.settings.tier_capacity is not None
    if tiered:
        headers += ["tier hits\ntokens", "pool+tier\ntokens"]
    if show_too_large:
        headers.append("too\nlarge")
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    for result in estimate.results:
        if result.capacity_blocks is None:  # the infinite cache
            cells = ["infinite", "-"] + (["-"] if kv_bytes else [])
        else:
            tokens = result.capacity_blocks * bs
            cells = [f"{result.capacity_blocks:,}", _short(tokens)]
            if kv_bytes:
                cells.append(_bytes(tokens * kv_bytes))
        bound = result.speedup_bound
        cells += [
            f"{result.block_hit_rate:.1%}",
            f"{result.token_hit_rate:.1%}",
            _short(result.hit_tokens),
            "inf" if math.isinf(bound) else f"{bound:.2f}x",
            f"{result.hit_request_share:.1%}",
        ]
        if tiered:
            cells += (["-", "-"] if result.infinite else
                      [f"{result.tier_token_hit_rate:.1%}",
                       f"{result.token_hit_rate + result.tier_token_hit_rate:.1%}"])
        if show_too_large:
            cells.append(f"{result.requests_too_large:,}")
        table.add_row(*cells, style="bold" if result.infinite else None)
    return table


def print_report(estimate: Estimate, console: Console | None = None) -> None:
    """Prints what was read, the table, and how long it took (120 columns wide when the
    output is not a terminal)."""
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=120)
    workload = estimate.workload
    name = os.path.basename(workload.path)
    console.print(
        f"[bold]{name}[/]: {workload.format}, {len(workload.requests):,} requests, "
        f"{_count(workload.num_prompt_tokens)} prompt tokens "
        f"(mean {workload.num_prompt_tokens / len(workload.requests):,.0f}), "
        f"{_describe_blocks(estimate)}.", highlight=False)
    if workload.bad_lines:
        console.print(f"Skipped {workload.bad_lines:,} bad lines, e.g. "
                      f"{workload.bad_line_examples[0]}", highlight=False)
    concurrency = estimate.settings.concurrency
    load = ("one request at a time" if concurrency == 1
            else f"{concurrency} requests resident, released in arrival order")
    console.print(f"{_window_text(estimate)}; {load}. Partial last blocks are never cached; "
                  "the infinite cache is the upper bound.", highlight=False)
    if estimate.settings.pin_top or estimate.settings.ttl is not None:
        console.print(f"Explicit caching: pin-top {estimate.settings.pin_top}, ttl "
                      f"{estimate.settings.ttl} s at priority {estimate.settings.ttl_priority}.",
                      highlight=False)
    console.print(build_table(estimate))
    console.print("speed-up bound: 1/(1-h), h the hit rate by tokens (prefill only).",
                  highlight=False)
    if estimate.settings.tier_capacity is not None:
        console.print(f"tier hits: prompt tokens found in a second tier of "
                      f"{estimate.settings.tier_capacity:,} blocks past each pool's own hit "
                      "(loaded, not computed; the hit rates and the bound before them are the "
                      "pool's alone).", highlight=False)
    if any(r.requests_too_large for r in estimate.results):
        console.print("too large: requests needing more blocks than the pool holds (the "
                      "engine could not run them): counted with no hit, cache untouched.",
                      highlight=False)
    seconds = estimate.replay_seconds
    rate = estimate.replayed_blocks / seconds if seconds else 0.0
    workers = (f", largest worker {estimate.worker_peak_rss_mib:,.0f} MiB"
               if estimate.worker_peak_rss_mib else "")
    console.print(
        f"Read in {estimate.read_seconds:.1f} s; replayed {_count(estimate.replayed_blocks)} "
        f"block lookups ({len(estimate.results)} caches) in {seconds:.1f} s with "
        f"{estimate.jobs} process(es): {rate:,.0f} blocks/s. Peak memory "
        f"{estimate.peak_rss_mib:,.0f} MiB{workers}.", highlight=False)


def _result_json(result: CacheResult, estimate: Estimate) -> dict[str, Any]:
    bs = estimate.workload.block_size
    kv_bytes = estimate.kv_bytes_per_token
    tokens = None if result.capacity_blocks is None else result.capacity_blocks * bs
    bound = result.speedup_bound
    return {
        "infinite": result.infinite,
        "capacity_blocks": result.capacity_blocks,
        "capacity_tokens": tokens,
        "capacity_bytes": tokens * kv_bytes if tokens is not None and kv_bytes else None,
        "requests": result.requests,
        "requests_with_hit": result.requests_with_hit,
        "requests_too_large": result.requests_too_large,
        "query_blocks": result.query_blocks,
        "hit_blocks": result.hit_blocks,
        "query_tokens": result.query_tokens,
        "hit_tokens": result.hit_tokens,
        "block_hit_rate": result.block_hit_rate,
        "token_hit_rate": result.token_hit_rate,
        "prefill_tokens_saved": result.hit_tokens,
        "speedup_bound": None if math.isinf(bound) else bound,
        "hit_request_share": result.hit_request_share,
        "tier_hit_blocks": result.tier_hit_blocks,
        "tier_hit_tokens": result.tier_hit_tokens,
        "tier_token_hit_rate": result.tier_token_hit_rate,
        "distinct_blocks": result.distinct_blocks,
        "replayed_blocks": result.replayed_blocks,
        "seconds": result.seconds,
        "rolling": {"requests": [i for i, _ in result.rolling],
                    "block_hit_rate": [h for _, h in result.rolling]},
    }


def to_json(estimate: Estimate) -> dict[str, Any]:
    """Every figure of the estimate as plain JSON data."""
    workload = estimate.workload
    settings = estimate.settings
    seconds = estimate.replay_seconds
    return {
        "input": {
            "path": workload.path,
            "format": workload.format,
            "requests": len(workload.requests),
            "prompt_tokens": workload.num_prompt_tokens,
            "prompt_blocks": workload.num_prompt_blocks,
            "block_size": workload.block_size,
            "trace_block_size": workload.trace_block_size,
            "expansion": workload.expansion,
            "chained_here": workload.chained_here,
            "bad_lines": workload.bad_lines,
            "bad_line_examples": workload.bad_line_examples,
        },
        "settings": {
            "concurrency": settings.concurrency,
            "warmup_fraction": estimate.warmup_fraction,
            "warmup_requests": settings.warmup_requests,
            "rolling_window": settings.window,
            "kv_bytes_per_token": estimate.kv_bytes_per_token,
            "pin_top": settings.pin_top,
            "ttl": settings.ttl,
            "ttl_priority": settings.ttl_priority,
            "tier_capacity_blocks": settings.tier_capacity,
        },
        "caches": [_result_json(r, estimate) for r in estimate.results],
        "timing": {
            "read_seconds": estimate.read_seconds,
            "replay_seconds": seconds,
            "replayed_blocks": estimate.replayed_blocks,
            "blocks_per_second": estimate.replayed_blocks / seconds if seconds else None,
            "processes": estimate.jobs,
            "peak_rss_mib": estimate.peak_rss_mib,
            "worker_peak_rss_mib": estimate.worker_peak_rss_mib,
        },
        **({"lora": [dataclasses.asdict(f) for f in estimate.lora]} if estimate.lora else {}),
    }


def write_json(estimate: Estimate, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_json(estimate), f, indent=2)
        f.write("\n")


def write_plot(estimate: Estimate, path: str) -> None:
    """Two panels: hit rate against pool size (the infinite cache as a line) and the rolling
    hit rate over the replay, one curve per cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workload = estimate.workload
    finite = estimate.finite
    colors = plt.get_cmap("viridis")([i / max(1, len(finite)) for i in range(len(finite))])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    _plot_sizes(left, estimate, colors)
    _plot_rolling(right, estimate, colors)
    fig.suptitle(f"{os.path.basename(workload.path)}: {len(workload.requests):,} requests, "
                 f"block size {workload.block_size}", fontsize=12)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _plot_sizes(left: Any, estimate: Estimate, colors: Any) -> None:
    """The left panel: hit rate against pool size, the infinite cache as a line."""
    from matplotlib.ticker import PercentFormatter

    bs = estimate.workload.block_size
    finite, infinite = estimate.finite, estimate.infinite
    sizes = [r.capacity_blocks for r in finite if r.capacity_blocks is not None]  # all of them
    token_rates = [r.token_hit_rate for r in finite]
    left.axhline(infinite.token_hit_rate, color="black", linestyle=":", linewidth=1.5,
                 label=f"infinite cache (upper bound): {infinite.token_hit_rate:.1%}")
    left.plot(sizes, token_rates, color="tab:blue", linewidth=2, label="hit rate by tokens")
    left.plot(sizes, [r.block_hit_rate for r in finite], color="grey", linestyle="--",
              linewidth=1, marker=".", label="hit rate by blocks")
    left.scatter(sizes, token_rates, c=colors, s=70, zorder=3, edgecolors="white")
    for result in finite:
        label = f"{result.token_hit_rate:.1%}"
        if result.requests_too_large:
            label += f"\n({result.requests_too_large:,} too large)"
        left.annotate(label, (result.capacity_blocks, result.token_hit_rate), ha="center",
                      textcoords="offset points", xytext=(0, 9), fontsize=9)
    left.set_xscale("log")
    left.minorticks_off()
    left.set_xticks(sizes, [f"{size:,}\n{_short(size * bs)} tok" for size in sizes])
    if len(sizes) == 1:
        left.set_xlim(sizes[0] / 3, sizes[0] * 3)
    left.set_ylim(0, min(1.0, max([infinite.token_hit_rate, *token_rates]) * 1.2 + 0.02))
    left.yaxis.set_major_formatter(PercentFormatter(1.0))
    left.set_xlabel(f"KV cache size (blocks of {bs} tokens)")
    left.set_ylabel("prefix-cache hit rate")
    left.set_title(f"Hit rate against KV cache size ({_window_text(estimate).lower()})",
                   fontsize=10)
    left.grid(True, which="major", alpha=0.3)
    left.legend(loc="upper left", fontsize=9)


def _plot_rolling(right: Any, estimate: Estimate, colors: Any) -> None:
    """The right panel: the rolling hit rate over the replay, one curve per cache."""
    from matplotlib.ticker import PercentFormatter

    warmup = estimate.settings.warmup_requests
    if warmup:
        right.axvspan(0, warmup, color="grey", alpha=0.12, label="warm-up (not counted)")
    for result, color in zip(estimate.finite, colors, strict=True):
        xs, ys = zip(*result.rolling, strict=True)
        right.plot(xs, ys, color=color, linewidth=1.4, label=_capacity_label(result))
    xs, ys = zip(*estimate.infinite.rolling, strict=True)
    right.plot(xs, ys, color="black", linestyle=":", linewidth=1.5, label="infinite")
    right.set_ylim(0, 1.0)
    right.yaxis.set_major_formatter(PercentFormatter(1.0))
    right.set_xlim(0, len(estimate.workload.requests))
    right.set_xlabel("requests replayed (file order)")
    right.set_ylabel(f"hit rate by blocks, last {estimate.settings.window:,} requests")
    right.set_title("Rolling hit rate over the replay", fontsize=10)
    right.grid(True, alpha=0.3)
    right.legend(loc="upper left", fontsize=9)
