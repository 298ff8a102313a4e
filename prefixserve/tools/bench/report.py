"""What ``prefixserve bench`` shows and keeps: a table of runs side by side, the JSON document
of a run, and the TTFT CDF plot.

A run document (``FORMAT``) holds ``label``, ``created``, ``base_url``, ``dataset`` (name and
parameters), ``load`` (rate, concurrency, prompt type, options sent), ``summary`` (see
``metrics.summarize``), ``perfect_cache`` (see ``predict.perfect_cache``), ``server_metrics``
(the change of the server's Prometheus counters over the run, when it exports any) and
``records`` (one per request, see ``metrics.RequestRecord``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

FORMAT = "prefixserve-bench/1"

PREFIX_CACHE_COUNTERS = (
    # older runs: the token counters had these names (the ones below then counted blocks)
    ("prefixserve:prefix_cache_query_tokens_total", "prefixserve:prefix_cache_hit_tokens_total"),
    ("prefixserve:prefix_cache_queries_total", "prefixserve:prefix_cache_hits_total"),
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
)
"""(queries, hits) prefix-cache counters in tokens, as prefixserve (either ``--metrics-prefix``)
and vLLM name them; ``server_hit_rate`` reads the first pair a run document holds."""


def write_run(document: dict[str, Any], path: str) -> None:
    """Writes a run document as JSON (infinities and NaNs as null)."""
    with open(path, "w", encoding="utf-8") as out:
        json.dump(_finite(document), out, indent=1)
        out.write("\n")


def read_run(path: str) -> dict[str, Any]:
    """Reads a run document; raises ``ValueError`` when the file is not one."""
    with open(path, encoding="utf-8") as source:
        document = json.load(source)
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"{path}: not a prefixserve bench result (no \"format\": \"{FORMAT}\")")
    return document


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _load(document: dict[str, Any]) -> str:
    load = document["load"]
    rate = load.get("request_rate")
    concurrency = load.get("max_concurrency")
    params = document["dataset"].get("params") or {}
    if params.get("time_scale") is not None and not params.get("compress_arrivals"):
        parts = [f"arrivals at the trace's times x{params['time_scale']:g}"]
    else:
        parts = [f"rate {rate:g}/s" if rate is not None else "rate inf"]
    parts.append(f"max {concurrency} in flight" if concurrency else "no limit")
    return ", ".join(parts)


def server_hit_rate(document: dict[str, Any]) -> float | None:
    """Token hit rate of the server's own prefix-cache counters over the run."""
    metrics = document.get("server_metrics") or {}
    for queries_name, hits_name in PREFIX_CACHE_COUNTERS:
        queries = metrics.get(queries_name)
        if queries is not None:
            return metrics.get(hits_name, 0.0) / queries if queries else None
    return None


Row = tuple[str, Callable[[dict[str, Any]], str], Callable[[dict[str, Any]], float | None] | None]
"""A table row: its name, how a run's cell reads, and the value compared with the first run's
(None: no ratio shown)."""


def _summary(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda d: d["summary"].get(key)


def _latency(metric: str, stat: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda d: d["summary"][metric].get(stat)


def _number_cell(value: Callable[[dict[str, Any]], float | None]
                 ) -> Callable[[dict[str, Any]], str]:
    """The cell of a row showing ``value`` as a number."""
    return lambda d: _number(value(d))


def _rows() -> list[Row]:
    rows: list[Row] = [
        ("server", lambda d: d["base_url"], None),
        ("dataset", lambda d: d["dataset"]["name"], None),
        ("load", _load, None),
        ("prompts sent as", lambda d: d["load"].get("prompt_type", "-"), None),
        ("requests ok / failed",
         lambda d: f"{d['summary']['completed']} / {d['summary']['errors']}", None),
        ("outputs shorter than asked", lambda d: str(d["summary"].get("short_outputs", "-")),
         None),
        ("duration (s)", lambda d: _number(d["summary"]["duration_s"], 2), None),
        ("requests/s", lambda d: _number(d["summary"]["request_throughput"], 3),
         _summary("request_throughput")),
        ("output tokens/s", lambda d: _number(d["summary"]["output_throughput"]),
         _summary("output_throughput")),
        ("total tokens/s", lambda d: _number(d["summary"]["total_token_throughput"]),
         _summary("total_token_throughput")),
        ("prompt tokens from cache", lambda d: _share(d["summary"]["cached_share"]), None),
        ("server token hit rate", lambda d: _share(server_hit_rate(d)), None),
        ("perfect cache would serve",
         lambda d: _share((d.get("perfect_cache") or {}).get("token_hit_rate")), None),
    ]
    for metric, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                         ("e2e_ms", "E2E")):
        for stat in ("mean", "p50", "p90", "p99"):
            value = _latency(metric, stat)
            rows.append((f"{name} {stat} (ms)", _number_cell(value),
                         value if stat == "mean" else None))
    return rows


def build_table(documents: Sequence[dict[str, Any]]) -> Table:
    """One column per run; throughput and mean latencies of later runs also show their ratio
    to the first run's."""
    table = Table(title="prefixserve bench", title_justify="left", box=box.SIMPLE_HEAD,
                  padding=(0, 1), collapse_padding=True, pad_edge=False, show_edge=False)
    table.add_column("")
    for document in documents:
        table.add_column(document.get("label") or "run", justify="right")
    for name, cell, compared in _rows():
        cells = [cell(d) for d in documents]
        if compared is not None and documents:
            base = compared(documents[0])
            for i, document in enumerate(documents[1:], 1):
                value = compared(document)
                if base and value is not None:
                    cells[i] += f" ({value / base:.2f}x)"
        table.add_row(name, *cells)
    return table


def print_runs(documents: Sequence[dict[str, Any]], console: Console | None = None) -> None:
    """Prints the table and each run's error examples."""
    console = console or Console()
    console.print(build_table(documents))
    for document in documents:
        examples = document["summary"].get("error_examples") or []
        if examples:
            console.print(f"[bold]{document.get('label') or 'run'}[/bold]: "
                          f"{document['summary']['errors']} failed requests, e.g.:")
            for example in examples:
                console.print(f"  {example}", markup=False, highlight=False)


def plot_ttft_cdf(documents: Sequence[dict[str, Any]], path: str) -> None:
    """Writes the CDF of each run's TTFT (successful requests) to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for document in documents:
        ttfts = sorted(r["ttft"] * 1000.0 for r in document["records"]
                       if r.get("error") is None and r.get("ttft") is not None)
        if not ttfts:
            continue
        fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        axes.step(ttfts, fractions, where="post", label=document.get("label") or "run")
    axes.set_xscale("log")
    axes.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xlabel("time to first token (ms, log scale)")
    axes.set_ylabel("share of requests")
    axes.set_ylim(0, 1.02)
    axes.grid(True, which="both", alpha=0.3)
    scenarios = sorted({f"{d['dataset']['name']} ({_load(d)})" for d in documents})
    axes.set_title(f"TTFT CDF: {'; '.join(scenarios)}", fontsize="medium")
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
