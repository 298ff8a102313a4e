"""The cache tiers inside one engine (float32, the default model, a disk tier): write-back on
eviction, the minimum prefix length, and the pool's accounting after loads
(docs/tiers.md)."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator

import pytest

from prefixserve.engine.llm import LLM
from prefixserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(length)]


@pytest.fixture(scope="module")
def write_back(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    llm = LLM(dtype="float32", num_blocks=24, kv_disk_dir=str(tmp_path_factory.mktemp("kv")),
              kv_tier_write_policy="back", kv_tier_min_prefix_tokens=0)
    yield llm
    llm.close()


def test_write_back_saves_evicted_blocks_and_the_lookup_finds_them(write_back: LLM) -> None:
    """A (13 blocks) then B (13 more) in a 24-block pool: B's allocation evicts A's last
    blocks, which are written to disk as they go; A again takes its head from the pool and its
    tail from the disk, with the same output. Nothing was written before an eviction."""
    engine = write_back.engine
    assert engine.tiers is not None
    a, b = prompt(1, 200), prompt(2, 200)
    first = write_back.generate(a, GREEDY)[0]
    assert engine.tiers.stats()[0].stored_blocks == 0
    write_back.generate(b, GREEDY)
    assert engine.tiers.flush(60)  # the writes are asynchronous
    assert engine.tiers.stats()[0].stored_blocks > 0
    again = write_back.generate(a, GREEDY)[0]
    split = again.num_cached_tokens_by_tier
    assert split is not None and split["disk"] > 0 and split["pool"] > 0
    assert again.num_cached_tokens == split["pool"] + split["disk"] == 192
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


@pytest.fixture(scope="module")
def write_through(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    llm = LLM(dtype="float32", num_blocks=64, kv_disk_dir=str(tmp_path_factory.mktemp("kv")),
              kv_tier_min_prefix_tokens=200)
    yield llm
    llm.close()


def test_only_prompts_of_the_minimum_length_are_written(write_through: LLM) -> None:
    engine = write_through.engine
    assert engine.tiers is not None
    write_through.generate(prompt(3, 150), GREEDY)
    write_through.generate(prompt(4, 224), GREEDY)
    write_through.close()  # waits for the writer
    assert engine.tiers.stats()[0].stored_blocks == 224 // 16


def test_a_hung_tier_delays_only_the_request_it_is_looking_up() -> None:
    """A 'Redis' that accepts connections and never answers (a real listening socket): the
    lookup of X waits for the tier's timeout, while Y (shorter than a block, so it needs no
    lookup) is scheduled, generates all its tokens and finishes meanwhile. Then X's lookup
    times out, the tier is marked down, and X runs without it."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        port = hung.getsockname()[1]
        llm = LLM(dtype="float32", num_blocks=64, kv_redis_url=f"redis://127.0.0.1:{port}/0",
                  kv_tier_timeout=4.0, kv_tier_min_prefix_tokens=0)
        engine = llm.engine
        try:
            start = time.monotonic()
            x = engine.add_request(prompt(5, 100), GREEDY)
            y = engine.add_request(prompt(6, 10), SamplingParams(max_tokens=4, temperature=0,
                                                                 ignore_eos=True))
            y_done = None
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id == y and output.finished:
                        y_done = time.monotonic() - start
                        assert engine.tiers is not None and x in engine.tiers.pending
                    if output.request_id == x and output.finished:
                        assert output.num_cached_tokens == 0
            assert y_done is not None and y_done < 4.0
            assert time.monotonic() - start > 3.5  # X waited for the timeout
            stats = engine.get_stats().kv_tiers[0]
            assert not stats.up and stats.errors >= 1
            assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
        finally:
            llm.close()
