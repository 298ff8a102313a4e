"""Tests of SamplingParams validation and of the Sampler's greedy, filtered and seeded draws."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from prefixserve.model.sampler import (
    Sampler,
    TokenLogprobs,
    apply_penalties,
    compute_prompt_logprobs,
    filter_logits,
    make_generator,
)
from prefixserve.outputs import Logprob
from prefixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.fast

NEG_INF = float("-inf")
EOS = 3

logit_values = st.floats(min_value=-20.0, max_value=20.0, allow_nan=False, width=32)


@st.composite
def logit_matrices(draw: st.DrawFn, max_rows: int = 5, max_vocab: int = 40) -> torch.Tensor:
    rows = draw(st.integers(1, max_rows))
    vocab = draw(st.integers(2, max_vocab))
    values = draw(st.lists(logit_values, min_size=rows * vocab, max_size=rows * vocab))
    return torch.tensor(values, dtype=torch.float32).reshape(rows, vocab)


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: tuple[int, ...] = (EOS,),
) -> list[int]:
    rows = logits.shape[0]
    return (
        Sampler(eos)
        .sample(
            logits,
            params,
            generators if generators is not None else [None] * rows,
            prompts if prompts is not None else [[] for _ in range(rows)],
            outputs if outputs is not None else [[] for _ in range(rows)],
        )
        .token_ids
    )


def has_unique_max(row: torch.Tensor, margin: float = 1e-3) -> bool:
    top = row.topk(2).values
    return bool(top[0] - top[1] > margin)


def seeded(count: int, base: int = 0) -> list[torch.Generator | None]:
    return [make_generator(base + i) for i in range(count)]


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------- greedy and filters


@settings(max_examples=60, deadline=None)
@given(logit_matrices())
def test_greedy_equals_argmax(logits: torch.Tensor) -> None:
    params = [SamplingParams(temperature=0.0)] * logits.shape[0]
    assert run(logits, params) == logits.argmax(dim=1).tolist()


def test_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert run(logits, [SamplingParams(temperature=1e-6)] * 4) == logits.argmax(1).tolist()


@settings(max_examples=40, deadline=None)
@given(logit_matrices(), st.floats(0.05, 5.0), st.integers(0, 2**32))
def test_top_k_one_equals_greedy(logits: torch.Tensor, temperature: float, seed: int) -> None:
    assume(all(has_unique_max(row) for row in logits))
    rows = logits.shape[0]
    params = [SamplingParams(temperature=temperature, top_k=1)] * rows
    assert run(logits, params, seeded(rows, seed)) == logits.argmax(1).tolist()


@settings(max_examples=40, deadline=None)
@given(logit_matrices(), st.floats(0.05, 5.0), st.integers(0, 2**32))
def test_tiny_top_p_equals_greedy(logits: torch.Tensor, temperature: float, seed: int) -> None:
    assume(all(has_unique_max(row) for row in logits))
    rows = logits.shape[0]
    params = [SamplingParams(temperature=temperature, top_p=1e-9)] * rows
    assert run(logits, params, seeded(rows, seed)) == logits.argmax(1).tolist()
    assert run(logits, params) == logits.argmax(1).tolist()


def kept(filtered: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in filtered]


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float32).log()


def test_top_k_keeps_k_largest_and_ties() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 3.0, 0.0], [1.0, 5.0, 3.0, 2.0, 0.0]])
    assert kept(filter_logits(logits, [2, 0], [1.0, 1.0], [0.0, 0.0])) == [
        [1, 2, 3],
        [0, 1, 2, 3, 4],
    ]
    assert kept(filter_logits(logits, [1, 3], [1.0, 1.0], [0.0, 0.0])) == [[1], [1, 2, 3]]
    assert kept(filter_logits(logits, [99, 99], [1.0, 1.0], [0.0, 0.0])) == [list(range(5))] * 2


def test_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    logits = log_probs(0.05, 0.5, 0.3, 0.15)
    assert kept(filter_logits(logits, [0], [0.7], [0.0])) == [[1, 2]]
    assert kept(filter_logits(logits, [0], [0.85], [0.0])) == [[1, 2, 3]]
    assert kept(filter_logits(logits, [0], [0.4], [0.0])) == [[1]]
    assert kept(filter_logits(logits, [0], [1.0], [0.0])) == [[0, 1, 2, 3]]


def test_top_p_keeps_ties_with_the_cut_token() -> None:
    logits = log_probs(0.4, 0.2, 0.2, 0.2)
    assert kept(filter_logits(logits, [0], [0.5], [0.0])) == [[0, 1, 2, 3]]
    assert kept(filter_logits(logits, [0], [0.3], [0.0])) == [[0]]


@pytest.mark.parametrize("cut", [100, 1500, 2800])
def test_top_p_beyond_the_candidate_window(cut: int) -> None:
    # Over 3000 slowly decaying probabilities the cut can lie past the 1024 candidates that top-p
    # examines first; the result must match a plain sort-and-cumsum reference. top_p lies midway
    # between two cumulative sums, far from float32 rounding.
    vocab = 3000
    logits = -torch.arange(vocab, dtype=torch.float32).unsqueeze(0) * 2e-4
    reference = logits[0].double().softmax(0).cumsum(0)
    top_p = float(reference[cut - 1] + reference[cut]) / 2
    rows = torch.cat([logits, logits.flip(1)])
    assert kept(filter_logits(rows, [0, 0], [top_p, top_p], [0.0, 0.0])) == [
        list(range(cut + 1)),
        list(range(vocab - cut - 1, vocab)),
    ]


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    logits = log_probs(0.1, 0.5, 0.2, 0.15, 0.05)
    assert kept(filter_logits(logits, [0], [1.0], [0.35])) == [[1, 2]]
    assert kept(filter_logits(logits, [0], [1.0], [0.25])) == [[1, 2, 3]]
    assert kept(filter_logits(logits, [0], [1.0], [1.0])) == [[1]]


def test_top_p_applies_to_top_k_survivors_renormalised() -> None:
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    # Alone, top-p 0.5 keeps {0, 1} (mass before token 1 is 0.4); after top-k 2 the survivors
    # renormalise to 4/7 and 3/7, and the mass before token 1 (0.57) already reaches 0.5.
    assert kept(filter_logits(logits, [0], [0.5], [0.0])) == [[0, 1]]
    assert kept(filter_logits(logits, [2], [0.5], [0.0])) == [[0]]


def test_filters_differ_per_row_and_leave_input_alone() -> None:
    logits = torch.cat([log_probs(0.4, 0.3, 0.2, 0.1)] * 4)
    before = logits.clone()
    filtered = filter_logits(logits, [2, 0, 0, 0], [1.0, 0.6, 1.0, 1.0], [0.0, 0.0, 0.6, 0.0])
    assert kept(filtered) == [[0, 1], [0, 1], [0, 1], [0, 1, 2, 3]]
    assert torch.equal(logits, before)
    assert torch.equal(filtered[3], logits[3])


@settings(max_examples=60, deadline=None)
@given(
    logit_matrices(max_rows=1),
    st.integers(0, 50),
    st.floats(0.01, 1.0),
    st.floats(0.0, 1.0),
)
def test_filter_properties(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> None:
    vocab = logits.shape[1]
    after_k = filter_logits(logits, [top_k], [1.0], [0.0])[0]
    survivors = torch.isfinite(after_k)
    assert int(survivors.sum()) >= (min(top_k, vocab) if top_k > 0 else vocab)
    if not bool(survivors.all()):
        assert float(logits[0][survivors].min()) > float(logits[0][~survivors].max())

    probs = logits[0].softmax(0)
    after_p = torch.isfinite(filter_logits(logits, [0], [top_p], [0.0])[0])
    cut = probs[after_p].min()
    assert torch.equal(after_p, probs >= cut)
    assert float(probs[after_p].double().sum()) >= top_p - 1e-5
    assert float(probs[probs > cut].double().sum()) < top_p + 1e-5

    after_min = filter_logits(logits, [0], [1.0], [min_p])[0]
    assert torch.equal(torch.isfinite(after_min), probs >= min_p * probs.max())

    combined = filter_logits(logits, [top_k], [top_p], [min_p])[0]
    final = torch.isfinite(combined)
    # A most likely token survives (by probability: distinct tiny logits can round to equal ones).
    assert float(probs[final].max()) == float(probs.max())


def test_sampled_tokens_respect_filters() -> None:
    probs = (0.3, 0.25, 0.2, 0.15, 0.1)
    logits = torch.cat([log_probs(*probs)] * 300)
    cases = [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1, 2}),
        (SamplingParams(min_p=0.6), {0, 1, 2}),
        (SamplingParams(top_k=4, top_p=0.5, temperature=0.5), {0, 1}),
    ]
    for params, allowed in cases:
        tokens = run(logits, [params] * 300, seeded(300))
        assert set(tokens) == allowed, params


# ---------------------------------------------------------------- distributions


def test_temperature_shapes_distribution_unseeded_rows() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    draws = 6000
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        for temperature in (0.5, 1.0, 2.0):
            tokens = run(
                logits.expand(draws, -1), [SamplingParams(temperature=temperature)] * draws
            )
            counts = torch.bincount(torch.tensor(tokens), minlength=5).double()
            expected = (logits[0].double() / temperature).softmax(0)
            # df = 4: the 99.9% quantile is 18.5.
            assert chi_square(counts, expected) < 18.5, temperature
            if temperature != 1.0:
                assert chi_square(counts, logits[0].double().softmax(0)) > 100, temperature


def test_seeded_rows_follow_filtered_distribution() -> None:
    logits = log_probs(0.5, 0.3, 0.1, 0.1)
    draws = 3000
    params = [SamplingParams(top_p=0.7, seed=0)] * draws
    tokens = run(logits.expand(draws, -1), params, seeded(draws))
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    assert counts[2:].sum() == 0
    # df = 1: the 99.9% quantile is 10.8.
    assert chi_square(counts[:2], torch.tensor([0.625, 0.375], dtype=torch.float64)) < 10.8


# ---------------------------------------------------------------- seeds


def generate(
    steps: list[torch.Tensor],
    params: list[SamplingParams],
    row: int,
    generators: list[torch.Generator | None],
) -> list[int]:
    """Run several steps over a fixed batch, feeding outputs back; return ``row``'s tokens."""
    sampler = Sampler((EOS,))
    prompts = [[5, 6, 7] for _ in params]
    outputs: list[list[int]] = [[] for _ in params]
    for logits in steps:
        chosen = sampler.sample(logits, params, generators, prompts, outputs).token_ids
        for out, token in zip(outputs, chosen, strict=True):
            out.append(token)
    return outputs[row]


def test_seed_reproducible_alone_and_in_any_batch() -> None:
    vocab = 500
    data = torch.Generator().manual_seed(7)
    steps = [torch.randn(5, vocab, generator=data) for _ in range(10)]
    target = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=42)
    alone = generate([s[:1] for s in steps], [target], 0, [make_generator(42)])
    assert alone == generate([s[:1] for s in steps], [target], 0, [make_generator(42)])

    others = [
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=1.3, top_k=5, seed=1), make_generator(1)),
        (SamplingParams(temperature=0.7, min_p=0.1, frequency_penalty=0.5), None),
        (SamplingParams(temperature=1.0, seed=42), make_generator(42)),
    ]
    for position in range(5):
        params = [p for p, _ in others]
        generators = [g for _, g in others]
        params.insert(position, target)
        generators.insert(position, make_generator(42))
        batch_steps = [torch.cat([s[1 : position + 1], s[:1], s[position + 1 :]]) for s in steps]
        assert generate(batch_steps, params, position, generators) == alone, position

    other_seed = generate([s[:1] for s in steps], [target], 0, [make_generator(43)])
    assert other_seed != alone


# ---------------------------------------------------------------- penalties


HAND_LOGITS = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
HAND_PROMPT = [[0, 1]]
HAND_OUTPUT = [[2, 2, 3]]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), [2.0, -1.0, 0.5, -3.0, 1.0]),
        # Tokens 0 and 1 (prompt) and 2, 3 (output): positive / 2, negative * 2.
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.25, -6.0, 1.0]),
        (SamplingParams(repetition_penalty=0.5), [4.0, -0.5, 1.0, -1.5, 1.0]),
        # Output counts: token 2 twice, token 3 once; the prompt does not count.
        (SamplingParams(frequency_penalty=0.5), [2.0, -1.0, -0.5, -3.5, 1.0]),
        (SamplingParams(presence_penalty=0.25), [2.0, -1.0, 0.25, -3.25, 1.0]),
        (SamplingParams(presence_penalty=-1.0), [2.0, -1.0, 1.5, -2.0, 1.0]),
        (
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            [1.0, -2.0, -1.0, -6.75, 1.0],
        ),
    ],
)
def test_penalty_formulas(params: SamplingParams, expected: list[float]) -> None:
    before = HAND_LOGITS.clone()
    result = apply_penalties(HAND_LOGITS, [params], HAND_PROMPT, HAND_OUTPUT)
    assert torch.equal(HAND_LOGITS, before)
    torch.testing.assert_close(result, torch.tensor([expected]), rtol=0, atol=1e-6)


def test_penalties_per_row_in_a_batch() -> None:
    logits = HAND_LOGITS.expand(3, -1)
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(),
        SamplingParams(frequency_penalty=0.5),
    ]
    result = apply_penalties(logits, params, HAND_PROMPT * 2 + [[]], [[], [], [2, 2, 3]])
    expected = [[1.0, -2.0, 0.5, -3.0, 1.0], HAND_LOGITS[0].tolist(), [2.0, -1.0, -0.5, -3.5, 1.0]]
    torch.testing.assert_close(result, torch.tensor(expected), rtol=0, atol=1e-6)


def test_sampler_applies_penalties_before_argmax() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    params = [
        SamplingParams(temperature=0, repetition_penalty=2.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, presence_penalty=1.5),
    ]
    assert run(logits, params, prompts=[[0], [0], [0]], outputs=[[], [], [0]]) == [1, 0, 1]


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 10.0, 0.5]])  # EOS (3) first, stop id 2 second
    greedy = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2])
    assert [run(logits, [greedy], outputs=[[1] * n]) for n in range(4)] == [[1], [1], [1], [3]]
    ignoring = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2], ignore_eos=True)
    assert run(logits, [ignoring], outputs=[[]]) == [3]
    assert run(torch.tensor([[0.0, 1.0, 9.0, 0.0, 0.5]]), [ignoring]) == [1]
    assert run(logits, [SamplingParams(temperature=0)]) == [3]


def test_min_tokens_blocks_eos_when_sampling() -> None:
    rows = 400
    logits = torch.tensor([[1.0, 1.0, 1.0, 4.0]]).expand(rows, -1)
    params = [SamplingParams(min_tokens=2, max_tokens=5)] * rows
    tokens = run(logits, params, seeded(rows), outputs=[[0]] * rows)
    assert EOS not in tokens
    assert set(tokens) == {0, 1, 2}
    assert EOS in run(logits, params, seeded(rows), outputs=[[0, 0]] * rows)


# ---------------------------------------------------------------- logprobs


def reference_rank(row: torch.Tensor, token: int) -> int:
    return 1 + int((row > row[token]).sum())


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.8, logprobs=5, repetition_penalty=1.5, seed=1),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=10, logprobs=20),
    ]
    generators = [make_generator(1), None, None, make_generator(2)]
    output = Sampler().sample(logits, params, generators, [[1, 2]] * 4, [[3]] * 4)
    expected = torch.log_softmax(logits, dim=1)
    assert output.logprobs[2] is None
    for row, k in ((0, 5), (1, 0), (3, 20)):
        entry = output.logprobs[row]
        assert entry is not None
        token = output.token_ids[row]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(expected[row, token]), abs=1e-6)
        assert entry.rank == reference_rank(expected[row], token)
        top = expected[row].topk(k)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert output.logprobs[1] is not None and output.logprobs[1].rank == 1


def test_logprobs_rank_of_non_top_token_and_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    entry = Sampler().sample(logits, [SamplingParams(top_k=1, logprobs=3)], [None], [[]], [[]])
    assert entry.token_ids[0] in (1, 2)
    logprobs = entry.logprobs[0]
    assert logprobs is not None and logprobs.rank == 1
    as_dict = logprobs.as_dict()
    assert next(iter(as_dict)) == entry.token_ids[0]
    assert {t: lp.rank for t, lp in as_dict.items()} == {1: 1, 2: 1, 0: 3}

    low = TokenLogprobs(token_id=3, logprob=-5.0, rank=4, top=[(1, -0.5), (2, -1.0)])
    assert low.as_dict() == {3: Logprob(-5.0, 4), 1: Logprob(-0.5, 1), 2: Logprob(-1.0, 2)}


@pytest.mark.parametrize("extra_row", [False, True])
def test_prompt_logprobs(extra_row: bool) -> None:
    tokens = [
        int(t) for t in torch.randint(0, 8, (300,), generator=torch.Generator().manual_seed(5))
    ]
    rows = len(tokens) if extra_row else len(tokens) - 1
    logits = torch.randn(rows, 8, generator=torch.Generator().manual_seed(6))
    result = compute_prompt_logprobs(logits, tokens, 2)
    assert len(result) == len(tokens)
    assert result[0] is None
    expected = torch.log_softmax(logits, dim=1)
    for t in (1, 2, 200, 256, 257, 299):
        entry = result[t]
        assert entry is not None
        previous = expected[t - 1]
        assert next(iter(entry)) == tokens[t]
        assert entry[tokens[t]].logprob == pytest.approx(float(previous[tokens[t]]), abs=1e-6)
        assert entry[tokens[t]].rank == reference_rank(previous, tokens[t])
        for rank, token in enumerate(previous.topk(2).indices.tolist(), start=1):
            assert entry[token].rank == rank
        assert len(entry) in (2, 3)


def test_prompt_logprobs_edge_cases() -> None:
    assert compute_prompt_logprobs(torch.zeros(0, 4), [], 1) == []
    assert compute_prompt_logprobs(torch.zeros(1, 4), [2], 1) == [None]
    with pytest.raises(ValueError, match="prompt_logits"):
        compute_prompt_logprobs(torch.zeros(5, 4), [1, 2, 3], 1)
    with pytest.raises(ValueError, match="k must be"):
        compute_prompt_logprobs(torch.zeros(3, 4), [1, 2, 3], -1)


# ---------------------------------------------------------------- sampler contract


def test_sample_leaves_logits_alone_and_accepts_bfloat16() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(9))
    before = logits.clone()
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=2),
        SamplingParams(top_k=3, seed=4, presence_penalty=1.0),
        SamplingParams(top_p=0.5, min_p=0.1),
    ]
    Sampler((EOS,)).sample(logits, params, [None, make_generator(4), None], [[1]] * 3, [[2]] * 3)
    assert torch.equal(logits, before)
    half = logits.to(torch.bfloat16)
    assert run(half, [SamplingParams(temperature=0)] * 3) == half.float().argmax(1).tolist()


def test_sample_rejects_mismatched_inputs() -> None:
    sampler = Sampler()
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="one per logits row"):
        sampler.sample(logits, [SamplingParams()], [None, None], [[], []], [[], []])
    with pytest.raises(ValueError, match="2-D"):
        sampler.sample(torch.zeros(5), [SamplingParams()], [None], [[]], [[]])
    with pytest.raises(ValueError, match="eos_token_ids"):
        Sampler([-1])


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(5), make_generator(5)
    assert a is not None and b is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


# ---------------------------------------------------------------- SamplingParams


def test_defaults_and_normalisation() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert params.max_tokens == 16 and params.stop == [] and params.stop_token_ids == []
    assert not params.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    stops = ["a", "b"]
    normalised = SamplingParams(stop=stops, stop_token_ids=(4, 5))
    assert normalised.stop == stops and normalised.stop is not stops
    assert normalised.stop_token_ids == [4, 5]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=1).temperature == 1.0
    assert SamplingParams(max_tokens=None, seed=-3, logprobs=20).max_tokens is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 1.0}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ],
)
def test_validation_errors(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
