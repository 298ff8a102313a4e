"""The engine on the real default model (SmolLM2-135M-Instruct, float32): greedy outputs do not
depend on prefix caching, chunking, preemption or batch company; cached-token counts follow the
design's rules; blocks always come back."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from engine_helpers import prompts

from prefixserve import LLM, SamplingParams
from prefixserve.engine import async_llm
from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.engine.config import EngineConfig
from prefixserve.engine.errors import QueueFullError, RequestError
from prefixserve.engine.scheduler import SchedulerOutput

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)



@pytest.fixture(scope="module")
def cached() -> LLM:
    return LLM(num_blocks=256, block_size=16, dtype="float32")


@pytest.fixture(scope="module")
def uncached() -> LLM:
    return LLM(num_blocks=256, block_size=16, dtype="float32", enable_prefix_caching=False)


def token_outputs(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_chat_answers_sensibly(cached: LLM) -> None:
    out = cached.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=20))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    assert_idle(cached)


def test_greedy_identical_with_caching_on_and_off_and_hits_follow_the_rules(
        cached: LLM, uncached: LLM) -> None:
    ps = prompts(cached)
    cached.reset_prefix_cache()
    reference = token_outputs(uncached.generate(ps, GREEDY))
    first = cached.generate(ps[:1], GREEDY)[0]  # cold
    assert first.num_cached_tokens == 0
    rest = cached.generate(ps[1:], GREEDY)  # hits on the shared system prompt
    assert token_outputs([first, *rest]) == reference
    shared = 0
    while all(p[shared] == ps[0][shared] for p in ps[1:]):
        shared += 1
    for out in rest:
        assert out.num_cached_tokens == shared // 16 * 16 > 0
    again = cached.generate(ps[:1], GREEDY)[0]  # whole prompt cached, minus the last-block rule
    n = len(ps[0])
    assert again.num_cached_tokens == (n - 1) // 16 * 16
    assert again.outputs[0].token_ids == reference[0]
    assert all(o.num_cached_tokens == 0 for o in uncached.generate(ps, GREEDY))
    assert_idle(cached)
    assert_idle(uncached)


def test_chunked_prefill_gives_the_same_tokens(cached: LLM, uncached: LLM,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached engine with a step budget of 24 tokens (the scheduler's budget is all that
    chunks; one model load fewer than a second engine), its cache emptied first."""
    ps = prompts(uncached)
    reference = token_outputs(uncached.generate(ps, GREEDY))
    cached.reset_prefix_cache()
    scheduler = cached.engine.scheduler
    steps: list[int] = []
    schedule = scheduler.schedule

    def recorded() -> SchedulerOutput:
        out = schedule()
        steps.append(out.num_tokens)
        return out

    monkeypatch.setattr(scheduler, "max_num_batched_tokens", 24)
    monkeypatch.setattr(scheduler, "schedule", recorded)
    assert token_outputs(cached.generate(ps, GREEDY)) == reference
    assert max(steps) == 24 and min(len(p) for p in ps) > 2 * 24  # every prompt was chunked
    monkeypatch.undo()
    assert_idle(cached)


def test_preemption_gives_the_same_tokens_and_leaks_nothing(uncached: LLM) -> None:
    ps = prompts(uncached)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = token_outputs(uncached.generate(ps, params))
    # 4 x (~50 + 24 tokens) needs ~20 blocks (14 with the shared system prompt's two full
    # blocks counted once), one request alone at most 6: preemption is forced
    small = LLM(num_blocks=10, block_size=16, dtype="float32")
    assert token_outputs(small.generate(ps, params)) == reference
    assert small.engine.scheduler.num_preemptions > 0
    assert_idle(small)


def test_a_request_alone_equals_the_same_request_in_a_mixed_batch(cached: LLM) -> None:
    ps = prompts(cached)
    alone = token_outputs(cached.generate(ps[2:3], GREEDY))[0]
    cached.reset_prefix_cache()
    mixed = cached.generate([ps[0], ps[1], ps[2], ps[3][:20]], GREEDY)
    assert mixed[2].outputs[0].token_ids == alone


def test_sampling_with_a_seed_is_reproducible_and_n_gives_n_outputs(cached: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, n=3,
                            ignore_eos=True)
    a = cached.generate("Once upon a time", params)[0]
    b = cached.generate("Once upon a time", params)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    assert_idle(cached)


def test_stop_strings_and_max_tokens(cached: LLM) -> None:
    base = cached.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=16))[0]
    text = base.outputs[0].text
    assert base.outputs[0].finish_reason == "length" and len(base.outputs[0].token_ids) == 16
    stop = text.strip()[2:5]
    assert stop
    out = cached.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=16,
                                                           stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_logprobs_and_prompt_logprobs_do_not_depend_on_the_cache(cached: LLM,
                                                               uncached: LLM) -> None:
    ps = prompts(cached)[:1]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    cached.generate(ps, GREEDY)  # warm the cache: prompt-logprob requests must bypass it
    a = cached.generate(ps, params)[0]
    b = uncached.generate(ps, params)[0]
    assert a.num_cached_tokens == 0
    assert a.prompt_logprobs is not None and len(a.prompt_logprobs) == len(ps[0])
    assert a.prompt_logprobs[0] is None
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].logprob == pytest.approx(y[k].logprob, abs=1e-3)
    lp = a.outputs[0].logprobs
    assert lp is not None and len(lp) == 4
    for token, entry in zip(a.outputs[0].token_ids, lp, strict=True):
        assert entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3


def test_bad_requests_are_refused_and_lose_nothing(cached: LLM) -> None:
    engine = cached.engine
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request([1, 2, 10**9], GREEDY)
    with pytest.raises(RequestError, match="context"):
        engine.add_request([1] * (engine.max_model_len + 5), GREEDY)
    assert_idle(cached)


def test_validate_prompt_gives_the_servers_code_and_param(cached: LLM) -> None:
    """The server answers a ``RequestError`` with its ``code``, and with its ``param`` when it
    names one (else the field that held the prompt)."""
    engine = cached.engine
    limit = engine.max_model_len
    cases = [([], None, "invalid_prompt", None, "the prompt is empty"),
             ([engine.vocab_size], None, "invalid_prompt", None,
              f"token id {engine.vocab_size} is outside the vocabulary"),
             ([1] * limit, None, "context_length_exceeded", None, f"has {limit} tokens, but"),
             ([1] * 10, limit - 9, "context_length_exceeded", "max_tokens",
              f"asks for {limit - 9} more")]
    for ids, max_tokens, code, param, message in cases:
        with pytest.raises(RequestError, match=message) as caught:
            engine.validate_prompt(ids, max_tokens)
        assert (caught.value.code, caught.value.param) == (code, param)
    engine.validate_prompt([1] * 10, limit - 10)


def test_abort_frees_the_blocks(cached: LLM) -> None:
    engine = cached.engine
    request_id = engine.add_request(prompts(cached)[0],
                                    SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.kv_cache_manager.num_blocks
    assert engine.abort_request(request_id)
    assert_idle(cached)


def test_a_prompt_longer_than_one_step_is_refused_without_chunked_prefill(
        cached: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = cached.engine
    monkeypatch.setattr(engine.scheduler, "enable_chunked_prefill", False)
    assert engine.scheduler.max_num_batched_tokens == 2048 < 2100 < engine.max_model_len
    with pytest.raises(RequestError, match=r"2100 tokens.*2048.*--max-num-batched-tokens"):
        engine.add_request([1] * 2100, GREEDY)
    assert_idle(cached)  # refused, not queued at the head of the line
    engine.abort_request(engine.add_request([1] * 2048, GREEDY))  # one step's worth is fine
    assert_idle(cached)


def test_the_waiting_queue_bound_counts_sequences_not_requests(
        cached: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = cached.engine
    monkeypatch.setattr(engine.config, "max_waiting_requests", 4)
    prompt = prompts(cached)[0]
    with pytest.raises(RequestError, match="--max-waiting-requests"):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, n=5))
    ids = [engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, n=3))]
    with pytest.raises(QueueFullError):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, n=2))
    assert len(engine.scheduler.waiting) == 3  # a refused request leaves nothing behind
    ids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4)))
    for request_id in ids:
        assert engine.abort_request(request_id)
    assert_idle(cached)


def test_reserved_queue_room_admits_several_prompts_whole_or_refuses_them_whole(
        cached: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server reserves the room of a request's prompts before it queues any: a reservation
    that does not fit is refused and holds nothing, one that fits is not given to other
    requests, its prompts take it, and what they did not take comes back on release. Kills a
    reservation that is not counted (the plain request then fits), one checked for part of the
    sequences, and a release that returns nothing (the queue stays full)."""
    engine = cached.engine
    monkeypatch.setattr(engine.config, "max_waiting_requests", 3)
    prompt, one = prompts(cached)[0], SamplingParams(temperature=0, max_tokens=4)
    ids = [engine.add_request(prompt, one)]
    with pytest.raises(QueueFullError):
        engine.reserve_queue_room(3)  # 1 waiting + 3 > 3
    assert engine.reserved_sequences == 0 and len(engine.scheduler.waiting) == 1
    reservation = engine.reserve_queue_room(2)
    with pytest.raises(QueueFullError):
        engine.add_request(prompt, one)  # the 2 free places are held
    ids.append(engine.add_request(prompt, one, reservation=reservation))
    assert reservation.remaining == 1 and engine.reserved_sequences == 1
    engine.release_queue_room(reservation)  # the second prompt was refused (say): room back
    assert reservation.remaining == 0 and engine.reserved_sequences == 0
    ids.append(engine.add_request(prompt, one))
    with pytest.raises(QueueFullError):  # a spent reservation does not lift the bound
        engine.add_request(prompt, one, reservation=reservation)
    for request_id in ids:
        assert engine.abort_request(request_id)
    assert_idle(cached)


def test_reset_under_traffic_then_an_identical_request_hits_nothing(cached: LLM) -> None:
    engine = cached.engine
    prompt = prompts(cached)[0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    reference = cached.generate([prompt], params)[0].outputs[0].token_ids
    first = engine.add_request(prompt, params)
    engine.step()  # prefill done: the prompt's blocks are cached and held
    assert engine.reset_prefix_cache() is True
    again = cached.generate([prompt], params)[0]  # also runs ``first`` to its end
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == reference
    assert first not in engine.output_processor.requests
    assert_idle(cached)


def test_async_loop_waits_instead_of_spinning_when_nothing_can_be_scheduled(
        cached: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = cached.engine
    calls = []

    def schedule_nothing() -> SchedulerOutput:
        calls.append(time.monotonic())
        return SchedulerOutput()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_nothing)
    monkeypatch.setattr(async_llm, "LLMEngine", lambda config: engine)
    request_id = engine.add_request(prompts(cached)[0], GREEDY)
    llm = AsyncLLM(log_stats_interval=None)
    try:
        time.sleep(0.5)
        assert 1 <= len(calls) <= 3, f"{len(calls)} steps in 0.5 s: the loop spins"
        llm.abort(request_id)  # new work wakes the loop at once
        deadline = time.monotonic() + 0.5
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished_requests()
    finally:
        llm.shutdown()
    monkeypatch.undo()
    assert_idle(cached)


def test_the_stats_show_a_long_prefill_as_running_while_it_computes() -> None:
    """The gauges of ``/metrics`` read ``AsyncLLM.stats()``. A 1,500-token prompt prefills in
    one step (a second or more here); sampled every 5 ms from when it is sent to its first
    token, the stats show it running during that step, not the idle engine of before it was
    admitted. Kills stats taken only between steps (the gauges showed 0 running and 0 waiting
    while a 6,000-token prompt computed for seconds)."""
    llm = AsyncLLM(EngineConfig(num_blocks=256, block_size=16), log_stats_interval=None)
    prompt = [100 + (i * 7919) % 20000 for i in range(1500)]

    async def sample() -> tuple[list[tuple[float, int, int]], float]:
        async def first_token() -> float:
            params = SamplingParams(temperature=0, max_tokens=1)
            async for _ in llm.generate(prompt, params, "long"):
                break
            return time.monotonic()

        task = asyncio.ensure_future(first_token())
        samples = []
        while not task.done():
            stats = llm.stats()
            samples.append((time.monotonic(), stats.num_running, stats.num_waiting))
            await asyncio.sleep(0.005)
        return samples, task.result()

    try:
        samples, first = asyncio.run(sample())
    finally:
        llm.shutdown()
    before = [(running, waiting) for when, running, waiting in samples if when < first]
    assert before.count((1, 0)) >= 10, before
    assert samples[0][1:] == (0, 0)  # the request had not reached the engine yet


def test_the_server_engine_warms_up_before_serving_and_counts_nothing(cached: LLM) -> None:
    """``AsyncLLM`` (the server's engine) runs the model once before it serves
    (``LLMEngine.warm_up``): a decode step has run (the fused layers are built, or the reason
    they are not is known), yet no request, token or cached block is counted, every block is
    free, and its first requests, which take every block of the pool (the one the warm-up
    wrote included), answer as the offline engine does, a prompt within the warm-up's shapes
    first. (Planted: the warm-up left out, no decode step has run; its block not given back,
    the pool is short of one; the model's step outside inference mode after a warm-up inside
    it, the short prompt's step fails.)"""
    llm = AsyncLLM(EngineConfig(num_blocks=8, block_size=16, dtype="float32"),
                   log_stats_interval=None)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids = [list(range(100 + 7 * i, 150 + 7 * i)) for i in range(2)]  # 2 x 60 tokens: 8 blocks

    async def answer(prompt: list[int], request_id: str) -> list[int]:
        tokens: list[int] = []
        async for output in llm.generate(prompt, params, request_id):
            tokens += output.outputs[0].token_ids  # each output holds the new tokens
        return tokens

    async def both() -> list[list[int]]:
        return list(await asyncio.gather(answer(ids[0], "a"), answer(ids[1], "b")))

    try:
        runner, stats = llm.engine.runner, llm.stats()
        assert runner._fused is not None or runner.fused_decode_reason is not None
        assert runner.model_seconds == 0.0
        assert stats.num_free_blocks == 8 and stats.prompt_tokens == 0
        assert stats.generation_tokens == 0 and stats.prefix_cache_queries == 0
        short = list(range(100, 105))  # within the warm-up's shapes: its buffers are reused
        assert asyncio.run(answer(short, "s")) == token_outputs(cached.generate([short],
                                                                                params))[0]
        assert asyncio.run(both()) == token_outputs(cached.generate(ids, params))
    finally:
        llm.shutdown()


def test_a_request_cancelled_before_the_engine_thread_queued_it_never_runs() -> None:
    """A client that goes away while its request waits for the engine thread (busy: here a
    command that holds it) leaves nothing running and the engine alive: the cancelled call is
    skipped. (Planted: before, the engine thread ran the queued call and died setting the
    cancelled future's result: the next call never returned.)"""
    llm = AsyncLLM(EngineConfig(num_blocks=64, block_size=16), log_stats_interval=None)
    release = threading.Event()

    async def cancelled_early() -> None:
        async def read() -> None:
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            async for _ in llm.generate(list(range(100, 140)), params, "gone"):
                pass

        llm._submit(release.wait)  # the engine thread runs nothing else until released
        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.wait_for(llm._call(lambda: None), 30)  # the commands before it ran

    try:
        asyncio.run(cancelled_early())
        deadline = time.monotonic() + 30
        while llm.stats().num_running or llm.stats().num_waiting:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert llm.stats().generation_tokens == 0
        assert not llm.engine.has_unfinished_requests() and not llm._streams
    finally:
        llm.shutdown()


def test_queue_room_reserved_for_a_caller_that_went_away_is_given_back() -> None:
    """A reservation whose caller is cancelled while the engine thread takes it is released
    once taken. (Planted: without the release the room stays held for good.)"""
    llm = AsyncLLM(EngineConfig(num_blocks=64, block_size=16, max_waiting_requests=4),
                   log_stats_interval=None)
    release = threading.Event()

    async def cancelled() -> None:
        llm._submit(release.wait)
        task = asyncio.ensure_future(llm.reserve_queue_room(3))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(100):  # the release is queued once the reservation is taken
            if await asyncio.wait_for(llm._call(lambda: llm.engine.reserved_sequences), 30) == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the reserved room was never given back")

    try:
        asyncio.run(cancelled())
    finally:
        llm.shutdown()


def test_async_llm_builds_its_engine_in_the_engine_thread(
        cached: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine (and so the model's first OpenMP work) is built by the thread that steps it:
    two threads running OpenMP give libgomp two thread pools on the same cores, which made the
    fused decode step 2-4x slower in the server (``AsyncLLM._run``). A build error reaches the
    constructor's caller, and no engine thread is left behind."""
    built_in: list[int] = []

    def build(config: object) -> object:
        built_in.append(threading.get_ident())
        return cached.engine

    monkeypatch.setattr(async_llm, "LLMEngine", build)
    llm = AsyncLLM(log_stats_interval=None)
    try:
        assert built_in == [llm._thread.ident] != [threading.get_ident()]
    finally:
        llm.shutdown()

    def fail(config: object) -> object:
        raise ValueError("no such model")

    monkeypatch.setattr(async_llm, "LLMEngine", fail)
    threads = threading.active_count()
    with pytest.raises(ValueError, match="no such model"):
        AsyncLLM(log_stats_interval=None)
    assert threading.active_count() == threads
    monkeypatch.undo()
    assert_idle(cached)


def test_a_short_request_starts_beside_a_long_prefill_and_both_answer_as_alone() -> None:
    """The real engine with a 256-token step budget (threshold a quarter of it, the default):
    a 1,500-token prompt takes six steps to prefill; a short prompt added after its first step
    gets its first token in the next step, long before the long one's, and both greedy answers
    are those each prompt gives alone (run after, from the cache). Kills a threshold that does
    not reach the scheduler (the short one waited for the whole prefill)."""
    llm = LLM(num_blocks=256, block_size=16, dtype="float32", max_num_batched_tokens=256)
    engine = llm.engine
    assert engine.scheduler.long_prefill_token_threshold == 64
    tokenizer = llm.get_tokenizer()
    long_ids = tokenizer.encode(" ".join(f"item {i}," for i in range(600)))[:1500]
    short_ids = tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=4)
    engine.add_request(long_ids, params, request_id="long")
    engine.step()
    engine.add_request(short_ids, params, request_id="short")
    first_token: dict[str, int] = {}
    outputs: dict[str, list[int]] = {"long": [], "short": []}
    for step in range(1, 40):
        for out in engine.step():
            outputs[out.request_id] += out.outputs[0].token_ids
            if out.outputs[0].token_ids:
                first_token.setdefault(out.request_id, step)
        if not engine.has_unfinished_requests():
            break
    assert first_token["short"] == 1 and first_token["long"] >= 5, first_token
    alone = [token_outputs(llm.generate([ids], params))[0] for ids in (long_ids, short_ids)]
    assert [outputs["long"], outputs["short"]] == alone
    assert_idle(llm)


def test_a_request_on_a_prefix_being_prefilled_waits_for_it_and_answers_as_alone() -> None:
    """The real engine with a 256-token step budget: a 600-token prompt prefills in chunks; a
    second prompt on the same first 512 tokens, added after its first step, waits for them
    instead of computing them beside it, then hits all 512 (32 blocks); both greedy answers
    are those each prompt gives alone. With waiting off (``shared_prefix_wait_tokens`` 0) the
    second computes most of the prefix again (kills a wait that does not reach the
    scheduler)."""
    llm = LLM(num_blocks=256, block_size=16, dtype="float32", max_num_batched_tokens=256)
    engine = llm.engine
    assert engine.scheduler.shared_prefix_wait_tokens == 32  # the default
    words = llm.get_tokenizer().encode(" ".join(f"line {i};" for i in range(400)))
    first_ids, second_ids = words[:600], words[:512] + words[700:780]
    params = SamplingParams(temperature=0, max_tokens=4)
    alone = [token_outputs(llm.generate([ids], params))[0] for ids in (first_ids, second_ids)]
    cached_counts = []
    for wait in (32, 0):
        engine.scheduler.shared_prefix_wait_tokens = wait
        llm.reset_prefix_cache()
        engine.add_request(first_ids, params, request_id="first")
        engine.step()
        engine.add_request(second_ids, params, request_id="second")
        outputs: dict[str, list[int]] = {"first": [], "second": []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] += out.outputs[0].token_ids
                if out.request_id == "second":
                    cached = out.num_cached_tokens
        cached_counts.append(cached)
        assert [outputs["first"], outputs["second"]] == alone
        assert_idle(llm)
    assert cached_counts[0] == 512 and cached_counts[1] < 512 - 128, cached_counts


def test_the_model_file_is_parsed_once_for_the_tokenizer_and_the_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine opens the GGUF file once and hands it to both loaders (parsing a vocabulary
    twice cost a quarter of a second a start for Gemma 3), and the tokenizer so built works."""
    from prefixserve.model.weights.gguf_file import GGUFFile

    opened: list[str] = []
    original = GGUFFile.__init__

    def counting(self: GGUFFile, path: str) -> None:
        opened.append(path)
        original(self, path)

    monkeypatch.setattr(GGUFFile, "__init__", counting)
    llm = LLM(num_blocks=16, block_size=16, dtype="float32")
    assert len(opened) == 1 and opened[0].endswith(".gguf")
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode("Hello there")).strip() \
        == "Hello there"
