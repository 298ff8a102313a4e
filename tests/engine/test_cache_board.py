"""The cache board (engine/cache_board.py) on the real default model: what the console shows of
the prefix cache, and the request log its what-if replays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.engine.cache_board import CacheBoard
from prefixserve.tools.estimate.replay import replay_infinite
from prefixserve.tools.estimate.results import ReplaySettings
from prefixserve.tools.trace_formats import ReadOptions, read_workload

ONE = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
#: Token ids of a 70-token system prompt (4 full blocks of 16) and questions of 9 to 12 tokens.
SYSTEM = list(range(1000, 1070))
QUESTIONS = [list(range(3000 + 50 * i, 3009 + 50 * i + i)) for i in range(4)]


@pytest.fixture()
def llm() -> LLM:
    return LLM(num_blocks=128, block_size=16, dtype="float32", request_log_size=5)


def test_the_board_counts_each_namespace_and_names_the_prefix_hits_started_from(
        llm: LLM) -> None:
    for question in QUESTIONS[:3]:
        llm.generate(SYSTEM + question, ONE)
    llm.generate(SYSTEM + QUESTIONS[3], ONE, cache_salt="tenant-b")
    view = llm.engine.cache_view()
    shared, salted = view.namespaces[(None, None)], view.namespaces[("tenant-b", None)]
    assert (shared.sequences, shared.cached_tokens) == (3, 2 * 64)
    assert shared.prompt_tokens == sum(70 + len(q) for q in QUESTIONS[:3])
    assert (salted.sequences, salted.cached_tokens) == (1, 0)  # another namespace: no hit
    assert salted.blocks == 5 and shared.blocks == 4 + 3  # its own chain; ours + 3 tails
    [prefix] = view.prefixes
    assert (prefix.num_tokens, prefix.hits, prefix.namespace, prefix.in_pool) == (
        64, 2, (None, None), True)
    assert view.running_blocks == 0 and view.pinned_blocks == 0
    assert view.cached_blocks == shared.blocks + salted.blocks
    assert view.running_blocks + view.cached_blocks + view.empty_blocks == view.total_blocks
    llm.reset_prefix_cache()
    after = llm.engine.cache_view()
    assert after.cached_blocks == 0 and not after.prefixes[0].in_pool
    assert after.namespaces[(None, None)].blocks == 0


def test_the_request_log_replays_to_the_hits_the_engine_had(llm: LLM, tmp_path: Path) -> None:
    """With a pool large enough to evict nothing, the estimator's infinite cache on the log
    finds exactly the prompt tokens the engine served from its cache."""
    order = [0, 1, 0, 2, 1, 0]  # six prompts: the log keeps the last five
    eight = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # fill output blocks
    outputs = [llm.generate(SYSTEM[: 20 + 10 * i] + QUESTIONS[i], eight)[0] for i in order]
    log = llm.engine.request_log()
    assert len(log) == 5 and [r["input_length"] for r in log] == [
        len(o.prompt_token_ids) for o in outputs[1:]]
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids",
                          "block_size"} for r in log)  # lengths and hash ids: no text
    assert [len(r["hash_ids"]) for r in log] == [r["input_length"] // 16 for r in log]
    assert log[1]["hash_ids"] == log[4]["hash_ids"]  # the same prompt
    assert log[0]["hash_ids"][0] == log[1]["hash_ids"][0] != log[0]["hash_ids"][1]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in log))
    workload = read_workload(str(path), ReadOptions(block_size=16))
    settings = ReplaySettings(window=5)
    replayed = replay_infinite(workload, settings)
    # the first logged prompt found the dropped first one's blocks in the engine: not in the log
    engine_hits = sum(o.num_cached_tokens for o in outputs[2:])
    assert replayed.hit_tokens == engine_hits > 0


def test_the_log_and_the_prefix_table_stay_bounded() -> None:
    llm = LLM(num_blocks=32, block_size=16, dtype="float32")
    pool = llm.engine.kv_cache_manager.block_pool
    board = CacheBoard(16, log_size=2, max_prefixes=2, pool=pool)
    llm.engine.cache_board = board
    for i in range(4):  # four prefixes of two blocks, each hit once
        llm.generate([5000 + i] * 40, ONE)
        llm.generate([5000 + i] * 40 + [7], ONE)
    assert len(board.log) == 2 and len(board.prefixes) == 2
    assert [(p.hits, p.num_tokens) for p in board.prefixes.values()] == [(1, 32), (1, 32)]
    llm.reset_prefix_cache()
    # a block each, 80 in all: the labels of evicted blocks are dropped as they go (no view
    # needed: a server whose console nobody opens keeps a bounded board too)
    llm.generate([[9000 + i] * 17 for i in range(80)], ONE)
    assert len(board._owner) <= 2 * len(pool.blocks) + 2
    assert sum(v in pool.cached_block_hash_to_block for v in board._owner) >= 16
