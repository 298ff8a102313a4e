"""``LLM.generate(..., retention=...)`` and ``LLM.pin_prefix`` on the default model: under a
flood of unique prompts the retained prompt and the pinned one stay cached, a plain one does
not; a pin over the budget is refused and leaks nothing."""

from __future__ import annotations

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.core import Retention
from prefixserve.engine.errors import RequestError

ONE = SamplingParams(max_tokens=1, temperature=0)


def ids(tag: int, n: int) -> list[int]:
    return [1000 + tag * 97 + (i * 31) % 5000 for i in range(n)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_blocks=48, block_size=16, max_model_len=256)


def cached(llm: LLM, prompt: list[int], **kwargs: object) -> int:
    return llm.generate(prompt, ONE, **kwargs)[0].num_cached_tokens  # type: ignore[arg-type]


def flood(llm: LLM, base: int) -> None:
    """4 x 13 blocks, one prompt after the other: more than the pool, never more than the
    unprotected part of it at once (a batch that needs more takes retained blocks too)."""
    for i in range(4):
        llm.generate(ids(base + i, 200), ONE)


def test_retained_and_pinned_prompts_survive_a_flood_plain_ones_do_not(llm: LLM) -> None:
    plain, kept, pinned = ids(1, 180), ids(2, 180), ids(3, 100)
    cached(llm, plain)
    cached(llm, kept, retention=Retention.whole_prompt(80, 600.0))
    assert llm.pin_prefix("p", pinned) == 6
    flood(llm, 100)
    assert cached(llm, plain) == 0
    assert cached(llm, kept) == 176
    assert cached(llm, pinned) == 96
    assert llm.unpin("p") and not llm.unpin("p")
    llm.reset_prefix_cache()
    assert llm.engine.kv_cache_manager.num_free_blocks == 48


def test_pin_over_budget_is_refused(llm: LLM) -> None:
    # 48 blocks, a 256-token context reserves 16: the budget is 24 blocks
    assert llm.pin_prefix("a", ids(5, 200)) == 12
    with pytest.raises(RequestError, match="pin budget is 24"):
        llm.pin_prefix("b", ids(6, 250))
    llm.reset_prefix_cache(keep_pins=True)
    assert llm.engine.kv_cache_manager.num_pinned_blocks == 12
    llm.reset_prefix_cache()
    assert llm.engine.kv_cache_manager.num_free_blocks == 48
