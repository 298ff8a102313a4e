"""Liveness of the scheduler: the real ``Scheduler`` over the real ``KVCacheManager``, with the
engine's ``Request`` objects and a simulated model.

Rules checked (scheduler module docstring):

* a request that passes the admission rule (shorter than the context, ``check_admissible``)
  is scheduled and finishes within a bounded number of steps, whatever the pool size, block
  size, sequence limit, step budget, chunked prefill on or off, waiting for a sibling's
  prefix blocks or not, and prefix-cache resets;
* every step while requests are unfinished schedules at least one token (no idle spinning);
* when every request is done the pool's free count equals its size (no leak).

The simulated model advances ``num_computed_tokens`` by what was scheduled, appends one output
token once the prefill is done, and finishes a request after ``max_tokens`` outputs or at
``max_model_len`` tokens, as ``LLMEngine`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.core import KVCacheManager
from prefixserve.engine.request import Request, RequestStatus
from prefixserve.engine.scheduler import Scheduler
from prefixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.fast


@dataclass
class Setup:
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked: bool
    caching: bool
    long_prefill_token_threshold: int = 0
    shared_prefix_wait_tokens: int = 0


@dataclass
class Arrival:
    step: int
    prompt: list[int]
    max_tokens: int


@dataclass
class Run:
    """What a simulation saw: requests refused at admission, steps taken, preemptions, and the
    largest token count of a request resumed after preemption."""

    refused: list[str] = field(default_factory=list)
    steps: int = 0
    preemptions: int = 0
    longest_resume: int = 0
    finished: dict[str, int] = field(default_factory=dict)


def make_scheduler(setup: Setup) -> Scheduler:
    manager = KVCacheManager(setup.num_blocks, setup.block_size, setup.caching)
    return Scheduler(manager, setup.max_num_seqs, setup.max_num_batched_tokens, setup.chunked,
                     setup.long_prefill_token_threshold, setup.shared_prefix_wait_tokens)


def admit(scheduler: Scheduler, setup: Setup, rid: str, arrival: Arrival, run: Run) -> bool:
    """The engine's admission rules: shorter than the context, and ``check_admissible``."""
    if (len(arrival.prompt) >= setup.max_model_len
            or scheduler.check_admissible(len(arrival.prompt)) is not None):
        run.refused.append(rid)
        return False
    scheduler.add_request(Request(
        request_id=rid, token_ids=list(arrival.prompt), prompt_token_ids=arrival.prompt,
        params=SamplingParams(max_tokens=arrival.max_tokens)))
    return True


def model_step(scheduler: Scheduler, setup: Setup, step: int, run: Run) -> int:
    """One scheduling step and the simulated model; returns the tokens scheduled."""
    resumable = {r.request_id: r.num_tokens for r in scheduler.waiting
                 if r.status is RequestStatus.PREEMPTED}
    out = scheduler.schedule()
    run.preemptions += out.num_preempted
    for item in out.scheduled:
        request = item.request
        if request.request_id in resumable:
            run.longest_resume = max(run.longest_resume, resumable[request.request_id])
        request.num_computed_tokens += item.num_new_tokens
        if not request.is_prefill_done:
            continue
        token = (request.num_tokens * 7) % 3  # few distinct tokens: outputs hit the cache too
        request.token_ids.append(token)
        request.output_token_ids.append(token)
        max_tokens = request.params.max_tokens or 0
        if (len(request.output_token_ids) >= max_tokens
                or request.num_tokens >= setup.max_model_len):
            scheduler.finish_request(request)
            run.finished[request.request_id] = step
    return out.num_tokens


def simulate(setup: Setup, arrivals: list[Arrival], reset_steps: frozenset[int] = frozenset()
             ) -> Run:
    """Runs every arrival to completion, checking the liveness rules at every step."""
    scheduler = make_scheduler(setup)
    run = Run()
    admitted = 0
    pending = sorted(enumerate(arrivals), key=lambda ia: ia[1].step)
    last_arrival = max((a.step for a in arrivals), default=0)
    # The oldest running request is never preempted and computes >= 1 token a step, so it is
    # done within max_model_len steps; a step with nothing running admits the waiting head.
    bound = last_arrival + (len(arrivals) + 1) * (setup.max_model_len + 1)
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][1].step <= step:
            index, arrival = pending.pop(0)
            admitted += admit(scheduler, setup, f"r{index}", arrival, run)
        if step in reset_steps:
            assert scheduler.kv_cache_manager.reset_prefix_cache() is True
        if scheduler.has_unfinished_requests():
            assert model_step(scheduler, setup, step, run) >= 1, "a step scheduled nothing"
        step += 1
        assert step <= bound, "an admitted request was not done within the bound"
    run.steps = step
    assert len(run.finished) == admitted
    assert scheduler.kv_cache_manager.num_free_blocks == setup.num_blocks, "blocks leaked"
    return run


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    num_blocks = draw(st.integers(2, 16))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    capacity = num_blocks * block_size
    return Setup(
        num_blocks=num_blocks,
        block_size=block_size,
        # the engine caps the context at the pool's capacity; at the cap preemption is likely
        max_model_len=draw(st.one_of(st.just(capacity), st.integers(2, capacity))),
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=(budget := draw(st.integers(1, 16))),
        chunked=(chunked := draw(st.booleans())),
        caching=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.integers(0, budget - 1)) if chunked else 0,
        shared_prefix_wait_tokens=draw(st.sampled_from([0, 1, 2, 5, 8])),
    )


@st.composite
def arrivals_for(draw: st.DrawFn, setup: Setup) -> list[Arrival]:
    """Up to 8 requests; prompts mostly within one step and the context (some beyond, to be
    refused), few distinct tokens so that they share prefixes, outputs up to the context."""
    longest = max(1, min(setup.max_model_len - 1, setup.max_num_batched_tokens))
    length = st.one_of(st.integers(1, longest), st.integers(1, setup.max_model_len + 4))
    arrival = st.builds(
        Arrival, step=st.integers(0, 12),
        prompt=length.flatmap(lambda n: st.lists(st.integers(0, 2), min_size=n, max_size=n)),
        max_tokens=st.one_of(st.just(setup.max_model_len), st.integers(1, setup.max_model_len)))
    return draw(st.lists(arrival, min_size=2, max_size=8))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Setup, list[Arrival], frozenset[int]]:
    setup = draw(setups())
    return setup, draw(arrivals_for(setup)), draw(st.frozensets(st.integers(0, 40), max_size=3))


@settings(max_examples=100, deadline=None)
@given(scenario=scenarios())
def test_every_admitted_request_finishes_no_step_idles_and_nothing_leaks(
        scenario: tuple[Setup, list[Arrival], frozenset[int]]) -> None:
    simulate(*scenario)


def test_a_prompt_longer_than_one_step_is_refused_without_chunked_prefill() -> None:
    setup = Setup(num_blocks=512, block_size=16, max_model_len=8192, max_num_seqs=4,
                  max_num_batched_tokens=2048, chunked=False, caching=True)
    reason = make_scheduler(setup).check_admissible(2100)
    assert reason is not None
    assert "2100" in reason and "2048" in reason and "--max-num-batched-tokens" in reason
    assert make_scheduler(setup).check_admissible(2048) is None
    setup.chunked = True
    assert make_scheduler(setup).check_admissible(2100) is None


def test_a_refused_prompt_never_blocks_the_requests_behind_it() -> None:
    setup = Setup(num_blocks=512, block_size=16, max_model_len=8192, max_num_seqs=4,
                  max_num_batched_tokens=2048, chunked=False, caching=True)
    run = simulate(setup, [Arrival(0, [1] * 2100, 4), Arrival(0, [2] * 100, 4)])
    assert run.refused == ["r0"] and set(run.finished) == {"r1"}


def test_a_preempted_request_longer_than_one_step_resumes_without_chunked_prefill() -> None:
    # Two requests of 3 + 12 tokens in a pool of 16 one-token blocks: the younger one is
    # preempted once it has outputs, and resumes with more tokens than one step (4) holds.
    setup = Setup(num_blocks=16, block_size=1, max_model_len=16, max_num_seqs=2,
                  max_num_batched_tokens=4, chunked=False, caching=False)
    run = simulate(setup, [Arrival(0, [0, 1, 2], 12), Arrival(0, [2, 1, 0], 12)])
    assert run.preemptions > 0
    assert run.longest_resume > setup.max_num_batched_tokens
    assert set(run.finished) == {"r0", "r1"}
