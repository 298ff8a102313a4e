"""LoRA adapters in the engine, on the default model (float32, packed Q4_1 weights): the cache
namespace of each adapter, mixed batches, slots and swaps, refusals, no leaked blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_helpers import default_config, write_peft_adapter

from prefixserve import LLM, SamplingParams
from prefixserve.engine.errors import RequestError
from prefixserve.engine.lora_registry import LoRAInUseError
from prefixserve.model.arch.lora import LoRAError

ONE = SamplingParams(temperature=0, max_tokens=1)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    config = default_config()
    return {"a": write_peft_adapter(root / "a", config, seed=1),
            "b": write_peft_adapter(root / "b", config, seed=2, parts=("q", "v", "down")),
            "c": write_peft_adapter(root / "c", config, seed=3, rank=2),
            "big": write_peft_adapter(root / "big", config, seed=4, rank=32, parts=("o",))}


@pytest.fixture(scope="module")
def llm(adapters: dict[str, Path]) -> LLM:
    return LLM(num_blocks=512, block_size=16, dtype="float32", enable_lora=True, max_loras=2,
               max_lora_rank=8, lora_modules={"a": str(adapters["a"]), "b": str(adapters["b"])})


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def long_prompt(llm: LLM, seed: int) -> list[int]:
    """200 token ids (12 full blocks of 16 and 8 more)."""
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(200)]


def test_each_adapter_has_its_own_cache_namespace(llm: LLM) -> None:
    """The same 200-token prompt under A, then B, then A: B gets 0 cached tokens, the second
    A all 12 full blocks (192 tokens); the base model never sees the adapters' blocks; salts
    and adapters combine. Kills: the adapter id left out of the block hashes (B would hit), or
    in block 0 only with a salt overriding it."""
    prompt = long_prompt(llm, 1)

    def cached(**kwargs: object) -> int:
        return llm.generate([prompt], ONE, **kwargs)[0].num_cached_tokens  # type: ignore[arg-type]

    assert cached(lora="a") == 0
    assert cached(lora="b") == 0
    assert cached(lora="a") == 192
    assert cached() == 0
    assert cached() == 192
    assert cached(lora="b") == 192
    assert cached(lora="a", cache_salt="tenant-1") == 0
    assert cached(lora="a", cache_salt="tenant-1") == 192
    assert cached(lora="b", cache_salt="tenant-1") == 0
    counts = llm.engine.lora_cache_counts()
    assert (counts["a"].requests, counts["a"].queries, counts["a"].hits) == (4, 800, 384)
    assert (counts["b"].requests, counts["b"].hits) == (3, 192)
    assert (counts[""].requests, counts[""].hits) == (2, 192)
    assert_idle(llm)


def test_mixed_batch_equals_each_alone(llm: LLM) -> None:
    """Base, A and B in one batch give each sequence the tokens it gets alone; the adapters
    change the output. Kills: one slot's delta reaching other rows, the base rows touched."""
    tok = llm.get_tokenizer()
    prompt = tok.encode("The history of the city begins with a small fishing village")
    alone = {lora: llm.generate([prompt], GREEDY, lora=lora)[0].outputs[0].token_ids
             for lora in (None, "a", "b")}
    assert len({tuple(v) for v in alone.values()}) == 3
    outs = llm.generate([prompt] * 4, GREEDY, lora=[None, "a", "b", "a"])
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [alone[None], alone["a"], alone["b"], alone["a"]]
    assert_idle(llm)


def test_adapter_prompts_attend_in_the_kernel(llm: LLM,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With adapters installed, prompt steps still attend through the C kernel (adapters change
    the projections, not the attention), and give the tokens the torch attention gives. Kills:
    the kernel turned off whenever adapters are installed (as it was: no plan), or handed rows
    it attends wrongly (other tokens than torch's)."""
    from prefixserve.model.attention import prompt as prompt_attention
    from prefixserve.model.attention.prompt import PromptAttention
    if not prompt_attention.available(llm.engine.runner.model.config.head_dim):
        pytest.skip("no 512-bit form of the prompt attention kernel on this CPU")
    plans = []
    plan = PromptAttention.plan
    monkeypatch.setattr(PromptAttention, "plan",
                        lambda self, *a, **k: plans.append(1) or plan(self, *a, **k))
    prompt = long_prompt(llm, 7)
    kernel = llm.generate([prompt], GREEDY, lora="a", cache_salt="kernel")[0]
    assert plans, "no prompt step of an adapter attended through the kernel"
    runner = llm.engine.runner
    saved, planned = runner._prompt_attention, len(plans)
    runner._prompt_attention = None  # the torch attention, for the reference
    try:
        torch_path = llm.generate([prompt], GREEDY, lora="a", cache_salt="torch")[0]
    finally:
        runner._prompt_attention = saved
    assert len(plans) == planned, "the reference did not run the torch attention"
    assert kernel.outputs[0].token_ids == torch_path.outputs[0].token_ids
    assert_idle(llm)


def test_adapters_beyond_the_slots_wait_without_blocking_the_base(llm: LLM,
                                                                  adapters: dict[str, Path]
                                                                  ) -> None:
    """Two slots, three adapters: while A and B run, C waits, and a base-model request that
    arrives after C runs at once; C swaps in when a slot frees. Kills: head-of-line blocking
    behind a waiting adapter, a busy slot swapped out under its running request."""
    llm.load_lora("c", str(adapters["c"]))
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = llm.get_tokenizer().encode("Once upon a time")
    ids = {name: engine.add_request(prompt, long, lora=name) for name in ("a", "b", "c")}
    ids["base"] = engine.add_request(prompt, long)
    engine.step()
    waiting = {r.request_id for r in engine.scheduler.waiting}
    assert waiting == {ids["c"]}
    with pytest.raises(LoRAInUseError, match="in use"):
        llm.unload_lora("c")  # waiting counts as in use
    swaps = engine.loras.num_swaps if engine.loras else 0
    states = {k: engine.request_state(v) for k, v in ids.items()}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.loras is not None and engine.loras.num_swaps == swaps + 1
    outs = {k: s.output(delta=False) for k, s in states.items()}
    assert outs["base"].metrics.first_token_time < outs["c"].metrics.first_scheduled_time
    alone = llm.generate([prompt], long, lora="c")[0].outputs[0].token_ids
    assert outs["c"].outputs[0].token_ids == alone
    llm.unload_lora("c")
    assert "c" not in {info.name for info in llm.engine.list_loras()}
    assert_idle(llm)


def test_bad_adapters_and_names_are_refused(llm: LLM, adapters: dict[str, Path]) -> None:
    with pytest.raises(RequestError, match="no LoRA adapter named 'nope'") as info:
        llm.generate(["hello"], ONE, lora="nope")
    assert info.value.code == "model_not_found"
    with pytest.raises(LoRAError, match=r"rank 32, above the limit of 8 \(--max-lora-rank\)"):
        llm.load_lora("big", str(adapters["big"]))
    with pytest.raises(LoRAError, match="already loaded"):
        llm.load_lora("a", str(adapters["b"]))
    with pytest.raises(KeyError):
        llm.unload_lora("nope")
    assert [i.name for i in llm.engine.list_loras()] == ["a", "b"]
    assert_idle(llm)
