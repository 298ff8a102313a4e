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


def _hot(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"input_length": PROMPT, "output_length": 1,
                                        "hash_ids": [1, 2, 100 + i]}) + "\n" for i in range(n)))
    return path


def test_closed_loop_clients_bound_the_loads(tmp_path: Path) -> None:
    """The hot prefix with closed-loop clients: a replica's load is its unfinished requests, so
    2 clients never put more than 2 on one replica and every request stays with the prefix; 40
    clients send all 40 at once and the threshold spreads them. (Planted: loads not released
    when a request finishes; 2 clients then spill too, and this fails.)"""
    path = _hot(tmp_path / "hot.jsonl", 40)
    two = _run(path, tmp_path, "--routing", "prefix-aware", "--clients", "2")
    assert sorted(two["prefix-aware"]["requests_per_replica"]) == [0, 40]
    forty = _run(path, tmp_path, "--routing", "prefix-aware", "--clients", "40")
    assert min(forty["prefix-aware"]["requests_per_replica"]) > 0


@pytest.mark.parametrize("heavy", ["prompt", "output"])
def test_a_long_request_holds_its_client_and_short_ones_keep_their_prefix(
        tmp_path: Path, heavy: str) -> None:
    """Two clients, any load difference moves a request (thresholds 0 and 1). Request 0 is long
    (20 uncached blocks, or 5,000 output tokens at the default decode cost) on one replica;
    8 short requests on another prefix follow, one at a time on the other client, and finish
    before it: each is sent while only request 0 is in flight, so each stays on the replica
    holding its prefix, and all but the first hit its 2 shared blocks. The window model (the
    last 2 routed are in flight) takes two short requests for the load and moves some away.
    (Planted: requests finishing in arrival order, or the output's work left out; each fails.)"""
    long = ({"input_length": 20 * BS, "output_length": 1, "hash_ids": list(range(500, 520))}
            if heavy == "prompt" else
            {"input_length": PROMPT, "output_length": 5000, "hash_ids": [500, 501, 502]})
    short = [{"input_length": PROMPT, "output_length": 1, "hash_ids": [10, 11, 100 + i]}
             for i in range(8)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [long, *short]))
    flags = ("--routing", "prefix-aware", "--balance-abs-threshold", "0",
             "--balance-rel-threshold", "1")
    loop = _run(path, tmp_path, *flags, "--clients", "2")["prefix-aware"]
    assert sorted(loop["requests_per_replica"]) == [1, 8]
    query = (20 * BS if heavy == "prompt" else PROMPT) + 8 * PROMPT
    assert loop["token_hit_rate"] == pytest.approx(7 * 2 * BS / query)
    assert loop["reasons"] == {"least-loaded": 2, "prefix": 7}
    window = _run(path, tmp_path, *flags, "--in-flight", "2")["prefix-aware"]
    assert window["token_hit_rate"] < loop["token_hit_rate"]
    assert window["reasons"]["imbalanced"] > 0


@pytest.mark.parametrize("flags,message", [
    (("--clients", "0"), "--clients must be at least 1"),
    (("--clients", "4", "--in-flight", "4"), "replaces --in-flight"),
    (("--clients", "4", "--decode-cost", "-1"), "--decode-cost must be >= 0")])
def test_bad_closed_loop_flags_are_refused(trace: Path, flags: tuple[str, ...], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", str(trace), "--replicas", "2", *flags]) == 2
    assert message in capsys.readouterr().err
