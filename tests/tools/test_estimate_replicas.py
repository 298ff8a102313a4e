"""``prefixserve estimate --replicas N``: hand-counted hits of round-robin, prefix-aware (the
router fed by the simulated replicas' KV events) and one pooled cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixserve.cli import main

pytestmark = pytest.mark.fast

GROUPS, PER_GROUP, BS = 4, 4, 512
PROMPT = 3 * BS + 1  # three full blocks, all looked up, and one more token


@pytest.fixture()
def trace(tmp_path: Path) -> Path:
    """Groups sent one after another: each request is its group's two shared blocks, then one
    block of its own."""
    path = tmp_path / "trace.jsonl"
    lines = []
    unique = 1000
    for g in range(GROUPS):
        for _ in range(PER_GROUP):
            unique += 1
            lines.append(json.dumps({"timestamp": 0, "input_length": PROMPT, "output_length": 1,
                                     "hash_ids": [10 * g, 10 * g + 1, unique]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(trace: Path, tmp_path: Path, *options: str) -> dict[str, dict]:
    out = tmp_path / "out.json"
    assert main(["estimate", str(trace), "--block-size", str(BS), "--replicas", "2",
                 "--capacity", "100", "--json", str(out), *options]) == 0
    return {r["routing"]: r for r in json.loads(out.read_text())["results"]}


def test_prefix_aware_matches_the_pooled_cache_and_round_robin_halves_the_hits(
        trace: Path, tmp_path: Path) -> None:
    """Pooled and prefix-aware: every request but a group's first hits its 2 shared blocks (6 a
    group); round-robin alternates replicas, so each replica misses the group once (4 a group).
    (Planted: a router that ignores the events routes like round-robin; this fails.)"""
    results = _run(trace, tmp_path)
    query = GROUPS * PER_GROUP * PROMPT
    for routing, hits in (("pooled", 6), ("prefix-aware", 6), ("round-robin", 4)):
        assert results[routing]["token_hit_rate"] == pytest.approx(GROUPS * hits * BS / query)
    assert sum(results["round-robin"]["requests_per_replica"]) == GROUPS * PER_GROUP
    assert results["round-robin"]["requests_per_replica"] == [8, 8]


def test_load_threshold_spreads_a_hot_prefix(tmp_path: Path) -> None:
    """One prefix only: with a window of 4 requests in flight, the best-cached replica's load
    soon exceeds the other's by the threshold and requests spill over."""
    path = tmp_path / "hot.jsonl"
    path.write_text("".join(json.dumps({"input_length": PROMPT, "output_length": 1,
                                        "hash_ids": [1, 2, 100 + i]}) + "\n" for i in range(40)))
    results = _run(path, tmp_path, "--routing", "prefix-aware", "--in-flight", "40")
    shares = results["prefix-aware"]["requests_per_replica"]
    assert min(shares) > 0 and sum(shares) == 40


def test_the_balance_thresholds_are_the_flags(tmp_path: Path) -> None:
    """The hot prefix again: with thresholds no load reaches, every request stays on the
    replica holding it; with none, the second goes to the idle replica. (Planted: the flags
    not passed to the router leave the default rule, which spreads some; both fail.)"""
    path = tmp_path / "hot.jsonl"
    path.write_text("".join(json.dumps({"input_length": PROMPT, "output_length": 1,
                                        "hash_ids": [1, 2, 100 + i]}) + "\n" for i in range(40)))
    flags = ("--routing", "prefix-aware", "--in-flight", "40")
    kept = _run(path, tmp_path, *flags, "--balance-abs-threshold", "1000")
    assert sorted(kept["prefix-aware"]["requests_per_replica"]) == [0, 40]
    spread = _run(path, tmp_path, *flags, "--balance-abs-threshold", "0",
                  "--balance-rel-threshold", "1")
    assert sorted(spread["prefix-aware"]["requests_per_replica"]) == [20, 20]


@pytest.mark.parametrize("flag,value", [("--balance-abs-threshold", "-1"),
                                        ("--balance-rel-threshold", "0.5")])
def test_bad_balance_thresholds_are_refused(trace: Path, flag: str, value: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", str(trace), "--replicas", "2", flag, value]) == 2
    assert "--balance-abs-threshold must be >= 0" in capsys.readouterr().err


def test_unknown_routing_is_refused(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", str(trace), "--replicas", "2", "--routing", "random"]) == 2
    assert "unknown routing 'random'" in capsys.readouterr().err
