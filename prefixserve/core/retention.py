"""Retention: how long, and how firmly, a request asks the prefix cache to keep its blocks.

A retention is a list of token ranges, each with a **priority** (0 to 100, higher is kept longer;
``DEFAULT_PRIORITY`` for blocks nobody asked about, as in TensorRT-LLM) and a **duration** in
seconds (None: no expiry) after which the blocks fall back to the default priority. The whole
prompt is one range from 0 to None (the prompt's end).

Rules (docs/explicit-caching.md):

* A block takes a range's retention only when the block ends at or before the range's end: a
  block that runs past it holds tokens the range does not cover, so no request sharing exactly
  that range's prefix could reuse it.
* **Chain-aware**: a block's retention is the highest over every range that covers it *or ends
  after it* (a later block is useless without its ancestors; ``start`` is accepted for
  TensorRT-LLM's shape but a range keeps the whole prefix up to its end), so along one
  request's chain priorities and durations never increase from head to tail, and at equal
  recency a tail goes first.
* Ranges are prompt tokens only; generated tokens keep the default priority.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PRIORITY = 35
"""The priority of a block no request asked to keep (TensorRT-LLM's default too)."""

MIN_PRIORITY = 0
MAX_PRIORITY = 100
PIN_PRIORITY = MAX_PRIORITY + 1
"""What a pinned block reports as its level: above every priority a request may ask for. A pin
holds a reference, so a pinned block is never in a free list at all."""

NO_EXPIRY = float("inf")

CACHE_CONTROL_PRIORITY = 80
"""The priority of an Anthropic ``cache_control`` breakpoint (the server's and the
estimator's)."""

CACHE_CONTROL_TTLS = {"5m": 300.0, "1h": 3600.0}
"""The ``cache_control`` TTLs, in seconds ("5m" is the default)."""


class PinBudgetError(ValueError):
    """A pin would take more blocks than the pin budget (``max_pinned_fraction`` of the pool)."""


@dataclass(frozen=True, slots=True)
class RetentionRange:
    """Tokens ``[start, end)`` of the prompt (``end`` None: to the prompt's end) to keep at
    ``priority`` for ``duration`` seconds after each use (None: until evicted by priority)."""

    start: int = 0
    end: int | None = None
    priority: int = DEFAULT_PRIORITY
    duration: float | None = None

    def __post_init__(self) -> None:
        if not MIN_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"retention priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], "
                             f"got {self.priority}")
        if self.start < 0 or (self.end is not None and self.end <= self.start):
            raise ValueError(f"retention range [{self.start}, {self.end}) is empty or negative")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"retention duration must be positive seconds or None, "
                             f"got {self.duration}")


@dataclass(frozen=True, slots=True)
class Retention:
    """A request's retention: its ranges (any order, may overlap)."""

    ranges: tuple[RetentionRange, ...]

    @classmethod
    def whole_prompt(cls, priority: int, duration: float | None = None) -> Retention:
        return cls((RetentionRange(0, None, priority, duration),))

    def block_retentions(self, num_prompt_tokens: int, block_size: int, first: int, end: int
                         ) -> list[tuple[int, float]]:
        """``(priority, duration)`` of blocks ``first .. end - 1`` (duration ``NO_EXPIRY`` for
        none); ``(DEFAULT_PRIORITY, 0.0)`` for a block no range covers or ends after."""
        spans = [(num_prompt_tokens if r.end is None else min(r.end, num_prompt_tokens),
                  r.priority, NO_EXPIRY if r.duration is None else r.duration)
                 for r in self.ranges]
        out = []
        for index in range(first, end):
            block_end = (index + 1) * block_size
            best: tuple[int, float] | None = None
            for span_end, priority, duration in spans:
                if span_end >= block_end and (best is None or (priority, duration) > best):
                    best = (priority, duration)
            out.append(best or (DEFAULT_PRIORITY, 0.0))
        return out


def as_retention(value: Retention | Sequence[RetentionRange] | None) -> Retention | None:
    """A ``Retention`` from itself, a list of ranges, or None."""
    if value is None or isinstance(value, Retention):
        return value
    return Retention(tuple(value))
