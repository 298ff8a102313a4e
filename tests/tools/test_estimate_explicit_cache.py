"""``prefixserve estimate`` with explicit caching: a log line's own ``retention``, ``--pin-top``
and ``--ttl``, on a hand-counted workload: a shared 16-token prompt comes back every fifth
request, and four unique 20-token prompts in between evict it under LRU from a 16-block pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixserve.cli import build_parser
from prefixserve.tools.estimate.replay import estimate, most_reused_blocks
from prefixserve.tools.estimate.results import Estimate
from prefixserve.tools.trace_formats import ReadOptions, TraceError, read_workload

pytestmark = pytest.mark.fast

SHARED = list(range(1, 17))  # 4 blocks of 4


def workload(path: Path, retention: dict | None = None, **fields: object) -> Path:
    """The hand-counted workload; ``retention`` and ``fields`` go on the shared prompt's
    lines."""
    lines = []
    for i in range(10):
        shared: dict = {"token_ids": [*SHARED, 500 + i], **fields}
        if retention is not None:
            shared["retention"] = retention
        lines.append(shared)
        for j in range(4):
            lines.append({"token_ids": [1000 + 100 * (4 * i + j) + t for t in range(20)]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run(path: Path, *options: str) -> Estimate:
    args = build_parser().parse_args(["estimate", str(path), "--block-size", "4",
                                      "--capacity", "16", "--no-progress", "--jobs", "1",
                                      *options])
    return estimate(args)


def pool_hits(result: Estimate) -> int:
    return next(r.hit_blocks for r in result.results if r.capacity_blocks == 16)


def test_lru_alone_loses_the_shared_prompt(tmp_path: Path) -> None:
    assert pool_hits(run(workload(tmp_path / "w.jsonl"))) == 0


def test_pin_top_keeps_the_most_reused_prefix(tmp_path: Path) -> None:
    assert pool_hits(run(workload(tmp_path / "w.jsonl"), "--pin-top", "4")) == 9 * 4


def test_one_pin_target_pins_the_whole_prefix_up_to_it(tmp_path: Path) -> None:
    """The four shared blocks tie (ten requests each); the tie goes to the deepest, which
    stands for the prefix up to it. Kills: pinning only a run of targets from the first block
    (nothing pinned here, no hit)."""
    assert pool_hits(run(workload(tmp_path / "w.jsonl"), "--pin-top", "1")) == 9 * 4


def test_pin_top_picks_the_most_reused_blocks(tmp_path: Path) -> None:
    loaded = read_workload(str(workload(tmp_path / "w.jsonl")),
                           ReadOptions(format="tokens", block_size=4))
    targets = most_reused_blocks(loaded, 4)
    first = loaded.requests[0]
    assert targets == set(loaded.block_keys(first)[:4])
    assert most_reused_blocks(loaded, 100) == targets  # blocks used once are never pinned


@pytest.mark.parametrize(("duration", "hits"), [(100, 9 * 4), (0.5, 0)])
def test_a_lines_retention_keeps_it_for_its_duration(tmp_path: Path, duration: float,
                                                     hits: int) -> None:
    """No timestamps: one second a request, so the shared prompt returns after 5 s."""
    path = workload(tmp_path / "w.jsonl", {"priority": 80, "duration": duration})
    assert pool_hits(run(path)) == hits


def test_ttl_applies_to_lines_without_their_own_retention(tmp_path: Path) -> None:
    path = workload(tmp_path / "w.jsonl", {"priority": 90, "duration": 100})
    assert pool_hits(run(path, "--ttl", "2")) == 9 * 4  # the line's own retention wins
    result = run(workload(tmp_path / "plain.jsonl"), "--ttl", "100")
    assert result.settings.ttl == 100
    assert pool_hits(result) == 0  # every prompt at the same priority: LRU again


def test_bad_retention_on_a_line_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"token_ids": [1, 2, 3], "retention": {"priority": 500}}\n')
    with pytest.raises(TraceError, match="retention"):
        run(path)


@pytest.mark.parametrize(("cache_control", "hits"), [
    ({"tokens": 16}, 9 * 4),  # the default 5-minute TTL outlives the 5 s between returns
    ([{"tokens": 8, "ttl": "1h"}], 9 * 2),  # only the first two blocks are under it
    ({"tokens": 16, "ttl": 0.5}, 0),  # a TTL in seconds, far shorter than the 5 s
])
def test_a_lines_cache_control_keeps_the_prefix_up_to_its_breakpoint(
        tmp_path: Path, cache_control: object, hits: int) -> None:
    """LRU alone loses the shared prompt (the first test); a breakpoint keeps the blocks that
    end at or before it for its TTL. Kills: cache_control ignored, a breakpoint keeping the
    whole prompt, a TTL read as minutes or ignored."""
    path = workload(tmp_path / "w.jsonl", cache_control=cache_control)
    assert pool_hits(run(path)) == hits


@pytest.mark.parametrize(("cache_control", "needle"), [
    ([{"tokens": 4}] * 5, "at most 4"),
    ({"tokens": 0}, "N >= 1"),
    ({"tokens": 4, "ttl": "10m"}, "ttl '10m'"),
])
def test_bad_cache_control_on_a_line_is_a_clear_error(tmp_path: Path, cache_control: object,
                                                      needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"token_ids": [1, 2, 3], "cache_control": cache_control}) + "\n")
    with pytest.raises(TraceError, match=needle):
        run(path)
