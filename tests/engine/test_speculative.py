"""N-gram speculation (``--num-speculative-tokens``): the proposer's lookup rules, and on the
real default model that drafts never change a greedy request's tokens (bit for bit in the
deterministic mode), respect max_tokens and stop tokens, leak no block and cache only verified
tokens."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import prompts

from prefixserve import LLM, SamplingParams
from prefixserve.engine.config import EngineConfig
from prefixserve.engine.ngram_proposer import NgramProposer
from prefixserve.model.runner import SeqBatchInput
from prefixserve.model.sampler import filter_logits, verify_drafts

# --------------------------------------------------------------------------- the proposer


def reference_draft(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The module's rules, read literally: the longest n-gram tail that occurred before (its
    latest occurrence ending before the last token) gives the next k tokens after it."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        tail = tokens[length - n:]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == tail:
                return tokens[end + 1:end + 1 + k]
    return []


def test_the_longest_matching_tail_wins_and_its_latest_occurrence_gives_the_draft() -> None:
    proposer = NgramProposer(3, min_n=1, max_n=3)
    # tail (2, 3): seen at 1-2 (followed by 9) and 5-6 (followed by 7 8); tail (1, 2, 3) only
    # at 0-2, so the 3-gram wins even though a later 2-gram occurrence exists
    tokens = [1, 2, 3, 9, 4, 2, 3, 7, 8, 1, 2, 3]
    assert proposer.propose("a", tokens) == [9, 4, 2]
    # no 3-gram match: the latest 2-gram occurrence
    assert proposer.propose("b", [5, 2, 3, 9, 4, 2, 3, 7, 8, 6, 2, 3]) == [7, 8, 6]


def test_drafts_stop_at_the_sequence_end_and_the_limit_and_are_empty_without_a_match() -> None:
    proposer = NgramProposer(4, min_n=2, max_n=2)
    assert proposer.propose("a", [1, 2, 5, 1, 2]) == [5, 1, 2]  # only three tokens follow
    assert proposer.propose("b", [1, 2, 5, 6, 7, 1, 2], limit=2) == [5, 6]
    assert proposer.propose("c", [1, 2, 5, 6, 7, 1, 2], limit=0) == []
    assert proposer.propose("d", [1, 2, 3, 4, 5]) == []
    assert proposer.propose("e", [1, 1]) == []  # the tail itself is no earlier occurrence


def test_the_incremental_index_proposes_what_a_fresh_lookup_does() -> None:
    """Sequences grown a few tokens at a time (small vocabularies, so matches abound): the
    index kept between calls gives the reference's draft at every length, and an id whose
    sequence comes back shorter than what was indexed starts over."""
    rng = random.Random(7)
    for trial in range(40):
        proposer = NgramProposer(rng.randint(1, 5), min_n=rng.randint(1, 2),
                                 max_n=rng.randint(2, 4))
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        for _ in range(30):
            expected = reference_draft(tokens, proposer.num_tokens, proposer.sizes.start,
                                       proposer.sizes.stop - 1)
            assert proposer.propose(f"s{trial}", tokens) == expected, (trial, tokens)
            tokens += [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        shorter = tokens[:len(tokens) // 2]
        assert proposer.propose(f"s{trial}", shorter) == reference_draft(
            shorter, proposer.num_tokens, proposer.sizes.start, proposer.sizes.stop - 1)
    assert len(proposer) == 1
    proposer.forget(f"s{trial}")
    assert len(proposer) == 0


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_speculative_tokens", -1, "num_speculative_tokens"),
    ("num_speculative_tokens", 17, "num_speculative_tokens"),
    ("prompt_lookup_min", 0, "prompt_lookup_min"),
    ("prompt_lookup_max", 1, "prompt_lookup_min <= prompt_lookup_max"),
])
def test_bad_speculation_settings_are_refused(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


# --------------------------------------------------------------------------- the engine

REPEAT = "Repeat after me, exactly, five times: the red fox jumps over the lazy dog."


def greedy(max_tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def assert_idle(llm: LLM) -> None:
    manager = llm.engine.kv_cache_manager
    assert not llm.engine.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_blocks


@pytest.fixture(scope="module")
def deterministic() -> tuple[LLM, LLM]:
    """The deterministic mode without and with speculation: a token's logits do not depend on
    how its sequence's tokens were split between steps, so drafts verified in a step must give
    the very tokens of one-token steps."""
    settings = dict(dtype="float32", deterministic=True, num_blocks=128)
    return LLM(**settings), LLM(num_speculative_tokens=3, **settings)


def test_drafts_change_no_greedy_token_in_the_deterministic_mode(
        deterministic: tuple[LLM, LLM]) -> None:
    plain, spec = deterministic
    ps = [*prompts(plain)[:2], REPEAT]
    params = greedy(40)
    reference = [o.outputs[0].token_ids for o in plain.generate(ps, params)]
    before = spec.engine.get_stats()
    got = [o.outputs[0].token_ids for o in spec.generate(ps, params)]
    stats = spec.engine.get_stats()
    assert got == reference
    drafted = stats.spec_draft_tokens - before.spec_draft_tokens
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    assert 0 < accepted < drafted  # drafts were kept and drafts were rejected
    assert stats.generation_tokens - before.generation_tokens == 3 * 40
    assert_idle(spec)
    assert not len(spec.engine.proposer or ())  # finished requests' indexes are dropped


def test_a_prompt_continuing_a_speculated_output_hits_only_verified_blocks(
        deterministic: tuple[LLM, LLM]) -> None:
    """Rejected drafts were written into the sequence's slots; blocks are registered in the
    cache only once the sequence's own tokens fill them, so a prompt that continues the output
    (the next turn of a chat) hits the blocks and still gets the plain engine's tokens."""
    plain, spec = deterministic
    spec.reset_prefix_cache()
    first = spec.generate([REPEAT], greedy(60))[0]
    follow = first.prompt_token_ids + first.outputs[0].token_ids + prompts(plain)[0][-6:]
    again = spec.generate([follow], greedy(20))[0]
    assert again.num_cached_tokens >= 48
    want = plain.generate([follow], greedy(20))[0].outputs[0].token_ids
    assert again.outputs[0].token_ids == want
    assert_idle(spec)


def test_max_tokens_and_stop_tokens_end_a_speculated_sequence_where_they_would_without(
        deterministic: tuple[LLM, LLM]) -> None:
    plain, spec = deterministic
    probe = plain.generate([REPEAT], greedy(30))[0].outputs[0].token_ids
    firsts = {token: probe.index(token) for token in probe}
    stop = max(firsts, key=firsts.__getitem__)  # the token the output reaches last
    assert firsts[stop] >= 4  # after a few steps, with drafts before it
    lengths = []
    for params in (greedy(7), greedy(30, stop_token_ids=[stop]),
                   SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])):
        want = plain.generate([REPEAT], params)[0].outputs[0]
        got = spec.generate([REPEAT], params)[0].outputs[0]
        assert (got.token_ids, got.finish_reason, got.text) == (
            want.token_ids, want.finish_reason, want.text)
        lengths.append(len(got.token_ids))
    assert lengths[:2] == [7, firsts[stop] + 1]
    assert_idle(spec)


def test_drafts_fit_the_step_budget(deterministic: tuple[LLM, LLM],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    plain, spec = deterministic
    scheduler = spec.engine.scheduler
    sizes: list[int] = []
    schedule = scheduler.schedule

    def recorded():  # type: ignore[no-untyped-def]
        out = schedule()
        sizes.append(out.num_tokens)
        return out

    monkeypatch.setattr(scheduler, "max_num_batched_tokens", 3)
    monkeypatch.setattr(scheduler, "schedule", recorded)
    params = greedy(20)
    got = spec.generate([REPEAT, REPEAT + " Now."], params)
    monkeypatch.undo()
    assert max(sizes) == 3
    want = plain.generate([REPEAT, REPEAT + " Now."], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert_idle(spec)


def test_penalised_requests_and_logprobs_get_no_drafts(deterministic: tuple[LLM, LLM]) -> None:
    _, spec = deterministic
    before = spec.engine.get_stats().spec_draft_tokens
    spec.generate([REPEAT], greedy(20, repetition_penalty=1.3))
    spec.generate([REPEAT], greedy(20, logprobs=2))
    spec.generate([REPEAT], SamplingParams(temperature=0.8, seed=1, max_tokens=20,
                                           presence_penalty=0.5, ignore_eos=True))
    assert spec.engine.get_stats().spec_draft_tokens == before
    assert_idle(spec)


def test_a_seeded_sampled_request_speculates_and_stays_reproducible(
        deterministic: tuple[LLM, LLM]) -> None:
    _, spec = deterministic
    before = spec.engine.get_stats()
    params = SamplingParams(temperature=0.3, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True)
    first, again = (spec.generate([REPEAT], params)[0].outputs[0].token_ids for _ in range(2))
    stats = spec.engine.get_stats()
    assert first == again and len(first) == 40
    assert stats.spec_accepted_tokens > before.spec_accepted_tokens
    assert_idle(spec)


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.8}])
def test_sampled_drafts_keep_each_tokens_distribution(filters: dict[str, float]) -> None:
    """Speculative sampling with single-token drafts: over many draws, the first token has the
    sampler's distribution of row 0 (temperature and filters applied), and the token after a
    kept first draft has row 1's, whatever the drafts are (a likely one, an unlikely one, one
    the filters drop)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 1.5, -0.5, 1.0, 0.2],
                           [0.3, 0.2, 0.1, 0.0, -0.1]])
    params = SamplingParams(temperature=0.7, **filters)
    rows = logits / params.temperature
    if filters:
        rows = filter_logits(rows, [params.top_k] * 3, [params.top_p] * 3, [params.min_p] * 3)
    want = rows.softmax(dim=1)
    generator = torch.Generator().manual_seed(11)
    trials = 3000
    for drafts in ([0, 1], [3, 4]):
        counts = torch.zeros(3, 5)  # counts[j]: the token at position j, when there is one
        for _ in range(trials):
            tokens = verify_drafts(logits, drafts, params, generator)
            assert len(tokens) <= 3 and tokens[:-1] == drafts[:len(tokens) - 1]
            for j, token in enumerate(tokens):
                counts[j, token] += 1
        assert (counts[0] / trials - want[0]).abs().max() < 0.04, drafts
        for j in (1, 2):  # after kept drafts (for [0, 1] 1,000 or more at both positions)
            if counts[j].sum() > 800:
                assert (counts[j] / counts[j].sum() - want[j]).abs().max() < 0.06, (drafts, j)


def test_fused_verification_rows_give_the_logits_of_one_token_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default mode: a decoding sequence's token and its drafts go through the fused
    decode layers as rows at consecutive positions on one block table. Their logits equal those
    of feeding the same tokens one step at a time, up to the fused step's float rounding."""
    llm = LLM(dtype="float32", num_blocks=64)
    runner = llm.engine.runner
    assert runner._fused_ready() and runner._fused is not None
    fused_calls: list[tuple[list[int], list[int]]] = []
    fused_run = runner._fused.run

    def recorded(hidden, positions, tables, rows, extra=(), lora_slots=None):  # type: ignore[no-untyped-def]
        fused_calls.append((list(positions), list(rows)))
        return fused_run(hidden, positions, tables, rows, extra, lora_slots)

    monkeypatch.setattr(runner._fused, "run", recorded)
    tokens = llm.get_tokenizer().encode(REPEAT)
    prompt, extra = tokens[:-4], tokens[-4:]
    table = list(range(1, 1 + (len(tokens) + 15) // 16))

    def run(seq: SeqBatchInput) -> torch.Tensor:
        out = runner.execute([seq])
        return out.prompt_logits[0] if out.prompt_logits[0] is not None else out.logits

    run(SeqBatchInput(prompt, 0, table, seq_id="a"))
    fused_calls.clear()  # a prompt this short runs fused too (FUSED_STEP_ROWS)
    one_at_a_time = torch.cat([run(SeqBatchInput([t], len(prompt) + i, table, seq_id="a"))
                               for i, t in enumerate(extra)])
    verified = run(SeqBatchInput(extra, len(prompt), table, need_prompt_logits=True,
                                 seq_id="a", verify=True))
    n = len(prompt)
    # the one-token steps and the verification all ran through the fused layers; the last as
    # four rows at consecutive positions on one table row
    assert [positions for positions, _ in fused_calls] == [[n], [n + 1], [n + 2], [n + 3],
                                                           [n, n + 1, n + 2, n + 3]]
    assert len(set(fused_calls[-1][1])) == 1
    assert verified.shape == one_at_a_time.shape == (4, llm.engine.vocab_size)
    scale = one_at_a_time.abs().max().item()
    assert (verified - one_at_a_time).abs().max().item() <= 1e-3 * scale
    assert verified.argmax(dim=1).tolist() == one_at_a_time.argmax(dim=1).tolist()


def test_an_aborted_request_leaves_no_blocks_and_no_index(deterministic: tuple[LLM, LLM]
                                                          ) -> None:
    _, spec = deterministic
    engine = spec.engine
    tokens = spec.get_tokenizer().encode(REPEAT)
    request_id = engine.add_request(tokens, greedy(100))
    for _ in range(6):
        engine.step()
    assert len(engine.proposer or ()) == 1
    assert engine.abort_request(request_id)
    assert len(engine.proposer or ()) == 0
    assert_idle(spec)
