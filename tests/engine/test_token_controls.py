"""The sampler's token controls on their own (no model): a grammar mask applies to its row
only, ``logit_bias`` and ``allowed_token_ids`` change the draw, and the two narrowings fall
back as documented; plus the grammar state's rebuild from tokens."""

from __future__ import annotations

import torch

from prefixserve.engine.structured_output import GrammarState, StructuredOutputs
from prefixserve.model.sampler import Sampler
from prefixserve.model.text.tokenizer import load_tokenizer
from prefixserve.sampling_params import SamplingParams, StructuredOutputsParams

V = 64


def draw(logits: torch.Tensor, params: list[SamplingParams],
         masks: dict[int, torch.Tensor] | None = None, seed: int = 0) -> list[int]:
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(params))]
    return Sampler().sample(logits, params, generators, [[1]] * len(params),
                            [[]] * len(params), token_masks=masks).token_ids


def test_a_mask_binds_its_row_and_leaves_the_others_alone() -> None:
    """Kills: a mask applied to every row, or to the wrong one."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    mask = torch.zeros(V, dtype=torch.bool)
    mask[[5, 9]] = True
    for seed in range(20):
        free = draw(logits, params, seed=seed)
        masked = draw(logits, params, {1: mask}, seed=seed)
        assert masked[1] in (5, 9)
        assert (masked[0], masked[2]) == (free[0], free[2])
    greedy = [SamplingParams(temperature=0.0)] * 2
    assert draw(logits[:2], greedy, {0: mask})[0] == (5 if logits[0, 5] > logits[0, 9] else 9)


def test_logit_bias_and_allowed_token_ids() -> None:
    logits = torch.zeros(1, V)
    logits[0, 3] = 5.0
    assert draw(logits, [SamplingParams(temperature=0.0)]) == [3]
    assert draw(logits, [SamplingParams(temperature=0.0, logit_bias={7: 100})]) == [7]
    assert draw(logits, [SamplingParams(temperature=0.0, logit_bias={3: -100})]) != [3]
    allowed = SamplingParams(temperature=1.0, allowed_token_ids=[10, 11])
    assert all(draw(logits, [allowed], seed=s)[0] in (10, 11) for s in range(10))
    # allowed ids disjoint from the grammar's mask: the grammar alone decides
    mask = torch.zeros(V, dtype=torch.bool)
    mask[20] = True
    assert draw(logits, [allowed], {0: mask}) == [20]


def test_grammar_state_follows_the_tokens_and_rebuilds_after_preemption() -> None:
    tokenizer = load_tokenizer(None)
    structured = StructuredOutputs(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    spec = StructuredOutputsParams(choice=("alpha beta", "alpha gamma"))
    state = GrammarState(structured.backend, structured.compile(spec))
    ids = tokenizer.encode("alpha gamma")
    assert state.sync(ids[:1]) is not None and state.consumed == 1
    assert state.sync(ids, preemptions=1) is not None  # rebuilt from all the tokens
    assert state.rebuilds == 1 and state.consumed == len(ids)
    matcher = state.sync(ids, preemptions=1)
    assert matcher is not None and not matcher.is_error()
    lazy = GrammarState(structured.backend, structured.compile(spec), triggers=[ids[0]])
    assert lazy.sync([5, 6]) is None  # no trigger yet: free text
    assert lazy.sync([5, 6, *ids]) is not None and lazy.start == 2
