"""The cache tiers inside one engine (float32, the default model, a disk tier): write-back on
eviction, the minimum prefix length, and the pool's accounting after loads
(docs/DESIGN.md section 13)."""

from __future__ import annotations

import random
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
    llm = LLM(dtype="float32", num_blocks=48, kv_disk_dir=str(tmp_path_factory.mktemp("kv")),
              kv_tier_write_policy="back", kv_tier_min_prefix_tokens=0)
    yield llm
    llm.close()


def test_write_back_saves_evicted_blocks_and_the_lookup_finds_them(write_back: LLM) -> None:
    """A (25 blocks) then B (25 more) in a 48-block pool: B's allocation evicts A's last
    blocks, which are written to disk as they go; A again takes its head from the pool and its
    tail from the disk, with the same output. Nothing was written before an eviction."""
    engine = write_back.engine
    assert engine.tiers is not None
    a, b = prompt(1, 400), prompt(2, 400)
    first = write_back.generate(a, GREEDY)[0]
    assert engine.tiers.stats()[0].stored_blocks == 0
    write_back.generate(b, GREEDY)
    assert engine.tiers.flush(60)  # the writes are asynchronous
    assert engine.tiers.stats()[0].stored_blocks > 0
    again = write_back.generate(a, GREEDY)[0]
    split = again.num_cached_tokens_by_tier
    assert split is not None and split["disk"] > 0 and split["pool"] > 0
    assert again.num_cached_tokens == split["pool"] + split["disk"] == 384
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
    write_through.generate(prompt(4, 300), GREEDY)
    write_through.close()  # waits for the writer
    assert engine.tiers.stats()[0].stored_blocks == 300 // 16
