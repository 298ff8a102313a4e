"""A router's memory of the prefixes it routed (prefixserve.router.routed): a routed prefix
counts as cached on its replica while the request runs and until that replica reports after the
request finished, never longer than the limit, and only on a replica that may still be chosen."""

from __future__ import annotations

import pytest

from prefixserve.router.routed import RoutedPrefixes

pytestmark = pytest.mark.fast

CHAIN = ["h1", "h2", "h3", "h4"]
BOTH = ("r0", "r1")


def test_a_routed_prefix_counts_as_cached_at_once_to_its_full_depth() -> None:
    memory = RoutedPrefixes()
    memory.routed(CHAIN, "r0", "req-1", now=0.0)
    assert memory.matched(CHAIN, BOTH, now=0.1) == {"r0": 4}
    assert memory.matched([*CHAIN[:2], "other"], BOTH, now=0.1) == {"r0": 2}
    assert memory.matched(["other"], BOTH, now=0.1) == {}


def test_it_lasts_while_reports_lag_a_running_request() -> None:
    """The case that sent requests away from their prefix: the replica is busy, its reports
    come late, the request has not finished. Seconds later the memory still holds."""
    memory = RoutedPrefixes(limit_s=60.0)
    memory.routed(CHAIN, "r0", "req-1", now=0.0)
    memory.reported("r0", at=1_000.0)  # a report read before the request finished
    assert memory.matched(CHAIN, BOTH, now=30.0) == {"r0": 4}


def test_it_ends_with_the_first_report_after_the_request_finished() -> None:
    memory = RoutedPrefixes()
    memory.routed(CHAIN, "r0", "req-1", now=0.0)
    memory.finished("req-1", at=1_005.0)
    memory.reported("r0", at=1_004.0)  # read before the end: the index may lack the blocks
    assert memory.matched(CHAIN, BOTH, now=6.0) == {"r0": 4}
    memory.reported("r1", at=1_009.0)  # another replica's report says nothing of r0
    assert memory.matched(CHAIN, BOTH, now=6.0) == {"r0": 4}
    memory.reported("r0", at=1_006.0)  # from now on r0's own events are the truth
    assert memory.matched(CHAIN, BOTH, now=6.0) == {}


def test_a_later_request_on_the_same_prefix_renews_it() -> None:
    memory = RoutedPrefixes()
    memory.routed(CHAIN, "r0", "req-1", now=0.0)
    memory.finished("req-1", at=1_001.0)
    memory.routed(CHAIN[:3], "r1", "req-2", now=2.0)
    memory.reported("r0", at=1_002.0)
    memory.reported("r1", at=1_002.0)
    assert memory.matched(CHAIN, BOTH, now=3.0) == {"r1": 3}


def test_a_request_that_never_finishes_is_forgotten_after_the_limit() -> None:
    memory = RoutedPrefixes(limit_s=60.0)
    memory.routed(CHAIN, "r0", "req-1", now=0.0)
    assert memory.matched(CHAIN, BOTH, now=59.9) == {"r0": 4}
    assert memory.matched(CHAIN, BOTH, now=60.0) == {}


def test_only_replicas_that_may_be_chosen_are_matched() -> None:
    """A full or dead replica is left out, and a shallower prefix last routed to another
    replica still counts there; each block remembers only its latest routing."""
    memory = RoutedPrefixes()
    memory.routed(CHAIN, "r0", "req-1", now=0.0)
    memory.routed(CHAIN[:2], "r1", "req-2", now=1.0)  # the first two blocks now on r1
    assert memory.matched(CHAIN, ("r1",), now=1.5) == {"r1": 2}
    assert memory.matched(CHAIN, BOTH, now=1.5) == {"r0": 4}
    assert memory.matched(CHAIN[:2], ("r0",), now=1.5) == {}


def test_forgetting_a_replica_drops_what_it_reported() -> None:
    """Nothing of a removed replica stays behind (as in the cache index): its report times go,
    so they can no longer end any memory."""
    memory = RoutedPrefixes()
    memory.routed(CHAIN, "r0", "req-1", now=0.0)
    memory.finished("req-1", at=1_000.0)
    memory.reported("r0", at=2_000.0)
    assert memory.matched(CHAIN, BOTH, now=1.0) == {}
    memory.forget("r0")
    assert memory.matched(CHAIN, BOTH, now=1.0) == {"r0": 4}
