"""The figures of a run, from its per-request records.

Per request: TTFT (time to the first token event), TPOT (``(e2e - ttft) / (output tokens - 1)``,
only for requests with at least two output tokens), the inter-token latencies (gaps between
token events) and the end-to-end latency. Output tokens are the server's ``completion_tokens``
when it reports usage, else the token events counted.

For the run: the distribution (mean, p50, p90, p99, in milliseconds) of TTFT, TPOT and e2e over
the successful requests, and of ITL over all their gaps; request and token throughput over the
run's duration (first request sent to last one finished); the share of prompt tokens served from
the cache (``cached_tokens`` / ``prompt_tokens`` over the requests whose usage reports it; None
when none does); the successful requests that produced fewer tokens than asked for (a server
that stopped at an end-of-text token, or cut a stream short); errors and a few of their
messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
MAX_ERROR_EXAMPLES = 5


@dataclass(kw_only=True)
class Measurement:
    """What the client saw of one request. Latencies are seconds from sending it (None when it
    failed, ``error`` saying why); the ``*_tokens`` fields are the server's usage (None when
    not reported)."""

    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    token_events: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    def measured(self) -> dict[str, Any]:
        """The fields of this class alone, to build another kind of measurement from."""
        return {f.name: getattr(self, f.name) for f in fields(Measurement)}


@dataclass(kw_only=True)
class RequestRecord(Measurement):
    """One request of a run: where it sits in the dataset, when it was sent (``start``, seconds
    from the run's start), how many tokens the benchmark sent (``prompt_len``) and asked for
    (``output_len``), and its measurement."""

    session: int
    turn: int
    group: int
    start: float
    prompt_len: int
    output_len: int

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.e2e is not None

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.token_events

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.e2e is not None and self.ttft is not None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def end(self) -> float | None:
        return None if self.e2e is None else self.start + self.e2e

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


def distribution(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """Count, mean and percentiles of ``values_s`` (seconds), in milliseconds (None if empty)."""
    out: dict[str, float | int | None] = {"count": len(values_s)}
    if not values_s:
        out.update({"mean": None, **{f"p{p}": None for p in PERCENTILES}})
        return out
    values = np.asarray(values_s, dtype=np.float64) * 1000.0
    out["mean"] = float(values.mean())
    for p, value in zip(PERCENTILES, np.percentile(values, PERCENTILES), strict=True):
        out[f"p{p}"] = float(value)
    return out


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The run's figures (see the module docstring) as a JSON-ready dict."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    starts = [r.start for r in records]
    ends = [r.end for r in done if r.end is not None]
    duration = max(ends) - min(starts) if ends else 0.0
    prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done)
    output = sum(r.output_tokens for r in done)
    reported = [r for r in done if r.cached_tokens is not None and r.prompt_tokens is not None]
    reported_prompt = sum(r.prompt_tokens or 0 for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)

    def per_second(count: float) -> float | None:
        return count / duration if duration > 0 else None

    return {
        "requests": len(records),
        "completed": len(done),
        "errors": len(failed),
        "short_outputs": sum(r.output_tokens < r.output_len for r in done),
        "error_examples": sorted({r.error or "no token" for r in failed})[:MAX_ERROR_EXAMPLES],
        "duration_s": duration,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output),
        "total_token_throughput": per_second(prompt + output),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": cached if reported else None,
        "cached_share": cached / reported_prompt if reported_prompt else None,
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "e2e_ms": distribution([r.e2e for r in done if r.e2e is not None]),
    }
