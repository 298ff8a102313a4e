"""Retention values pinned exactly (``prefixserve/core/retention.py``, docs/explicit-caching.md):
the accepted priority and range bounds with their error messages, the whole-prompt range, the
per-block ``(priority, duration)`` including the default for uncovered blocks, and
``as_retention``."""

from __future__ import annotations

import pytest

from prefixserve.core.retention import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MIN_PRIORITY,
    NO_EXPIRY,
    Retention,
    RetentionRange,
    as_retention,
)

pytestmark = pytest.mark.fast


def test_priority_bounds_0_and_100_are_both_accepted() -> None:
    """Priorities run from 0 to 100 inclusive; catches either bound made exclusive."""
    assert (MIN_PRIORITY, MAX_PRIORITY) == (0, 100)
    assert RetentionRange(priority=0).priority == 0
    assert RetentionRange(priority=100).priority == 100
    assert Retention.whole_prompt(0).ranges[0].priority == 0
    assert Retention.whole_prompt(100).ranges[0].priority == 100


@pytest.mark.parametrize("priority", [-1, 101])
def test_priority_outside_0_to_100_is_rejected_with_the_range(priority: int) -> None:
    """Catches a bound widened by one or an error that omits the allowed range."""
    with pytest.raises(ValueError, match=rf"^retention priority must be in \[0, 100\], got "
                                         rf"{priority}$"):
        RetentionRange(priority=priority)


@pytest.mark.parametrize("start, end", [(-1, None), (4, 4), (8, 4)])
def test_empty_or_negative_range_is_rejected(start: int, end: int | None) -> None:
    """Catches an empty ``[s, s)`` or negative range accepted."""
    with pytest.raises(ValueError, match=rf"^retention range \[{start}, {end}\) is empty or "
                                         r"negative$"):
        RetentionRange(start=start, end=end)


@pytest.mark.parametrize("duration", [0.0, -5.0])
def test_non_positive_duration_is_rejected(duration: float) -> None:
    """Catches a zero or negative duration accepted."""
    with pytest.raises(ValueError, match=r"^retention duration must be positive seconds or "
                                         rf"None, got {duration}$"):
        RetentionRange(duration=duration)


def test_whole_prompt_is_one_range_from_token_0_to_the_prompt_end() -> None:
    """Catches a whole-prompt range that starts anywhere but token 0."""
    retention = Retention.whole_prompt(80, 300.0)
    assert retention == Retention((RetentionRange(0, None, 80, 300.0),))
    (only,) = retention.ranges
    assert (only.start, only.end, only.priority, only.duration) == (0, None, 80, 300.0)
    assert Retention.whole_prompt(60).ranges == (RetentionRange(0, None, 60, None),)


def test_blocks_past_every_range_get_the_default_priority_and_no_duration() -> None:
    """A block no range covers or ends after is ``(DEFAULT_PRIORITY, 0.0)``; catches another
    duration for it."""
    retention = Retention((RetentionRange(0, 8, 90, 60.0),))
    # 20 prompt tokens, blocks of 4: blocks 0 and 1 end at or before token 8, 2..4 run past it.
    assert retention.block_retentions(20, 4, 0, 5) == [
        (90, 60.0), (90, 60.0), (DEFAULT_PRIORITY, 0.0), (DEFAULT_PRIORITY, 0.0),
        (DEFAULT_PRIORITY, 0.0)]
    assert retention.block_retentions(20, 4, 3, 5) == [(35, 0.0), (35, 0.0)]


def test_no_ranges_means_every_block_is_default() -> None:
    """An empty retention keeps nothing longer: every block ``(35, 0.0)``."""
    assert Retention(()).block_retentions(12, 4, 0, 3) == [(35, 0.0)] * 3


def test_block_retention_is_the_highest_over_ranges_ending_at_or_after_it() -> None:
    """Chain-aware maximum: a later, higher range lifts its whole prefix; no duration means
    ``NO_EXPIRY``; a range ending past the prompt counts to the prompt's end."""
    retention = Retention((RetentionRange(0, 4, 50, 10.0),
                           RetentionRange(6, 12, 70, None),
                           RetentionRange(0, 100, 40, 5.0)))
    # 14 prompt tokens, blocks of 4 end at 4, 8, 12, 16 (block 3 is not a full prompt block).
    assert retention.block_retentions(14, 4, 0, 4) == [
        (70, NO_EXPIRY), (70, NO_EXPIRY), (70, NO_EXPIRY), (DEFAULT_PRIORITY, 0.0)]
    # the open-ended range stops at the prompt's end too: block 3 (tokens 12..15) is past it
    open_ended = Retention.whole_prompt(60, 30.0)
    assert open_ended.block_retentions(14, 4, 0, 4) == [(60, 30.0)] * 3 + [(35, 0.0)]
    assert open_ended.block_retentions(16, 4, 0, 4) == [(60, 30.0)] * 4


def test_equal_priority_prefers_the_longer_duration() -> None:
    """At equal priority the longer duration wins, whatever the ranges' order."""
    short = RetentionRange(0, 8, 80, 5.0)
    long = RetentionRange(0, 8, 80, 50.0)
    assert Retention((short, long)).block_retentions(8, 4, 0, 2) == [(80, 50.0)] * 2
    assert Retention((long, short)).block_retentions(8, 4, 0, 2) == [(80, 50.0)] * 2


def test_as_retention_passes_none_and_a_retention_through() -> None:
    """Catches None or a Retention rebuilt (or rejected) instead of returned as is."""
    assert as_retention(None) is None
    retention = Retention.whole_prompt(80)
    assert as_retention(retention) is retention


def test_as_retention_wraps_a_list_of_ranges_in_order() -> None:
    """Catches a list returned unwrapped or its ranges lost."""
    first, second = RetentionRange(0, 8, 90), RetentionRange(8, 16, 50, 30.0)
    wrapped = as_retention([first, second])
    assert type(wrapped) is Retention
    assert wrapped == Retention((first, second))
    assert wrapped.ranges == (first, second)
    assert as_retention(()) == Retention(())
