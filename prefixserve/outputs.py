"""What the engine hands back for a request: plain values, importable without torch.

Every layer may import this module (docs/architecture.md); it imports nothing else of
prefixserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]
"""Why a sequence stopped: a stop token or string, its length limit, or an abort."""


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token and its 1-based rank (1 = most likely; ties share a rank)."""

    logprob: float
    rank: int


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()`` seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence: its text and token ids (the whole of them, or only what is new
    since the last output when streaming), why it stopped, and its logprobs when asked for."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of a request: its prompt (``prompt_token_ids`` is the engine's own list: read it,
    do not modify it), one ``CompletionOutput`` per sequence (``n``), how
    many prompt tokens came from the prefix cache, and its timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens_by_tier: dict[str, int] | None = None
    """With cache tiers: ``num_cached_tokens`` split into ``pool`` and each tier (``disk``,
    ``redis``) the blocks were loaded from for this request; None without tiers."""
