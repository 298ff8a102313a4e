"""The output processor without a model: tokens chosen by the test are fed to it as if sampled,
and its outputs (text deltas, finish and stop reasons, the cursors of ``n`` sequences) are
checked. Only the default model's tokenizer is loaded."""

from __future__ import annotations

import pytest

from prefixserve.engine.output_processor import (
    ExecutedStep,
    OutputProcessor,
    PromptLogprobsChunk,
    SampledToken,
)
from prefixserve.engine.request import Request
from prefixserve.model.text.tokenizer import Tokenizer, load_tokenizer
from prefixserve.outputs import CompletionOutput, Logprob, RequestOutput
from prefixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.fast

PROMPT = "Say something:"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


class Harness:
    """An output processor, the requests it tracks, and the requests it asked to finish."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int = 1000) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_ids[0]
        self.processor = OutputProcessor(tokenizer, tokenizer.eos_token_ids, max_model_len)
        self.finished: list[Request] = []

    def add(self, params: SamplingParams, request_id: str = "r") -> list[Request]:
        prompt_ids = self.tokenizer.encode(PROMPT)
        sequences = [Request(request_id=f"{request_id}#{i}", group_id=request_id,
                             token_ids=list(prompt_ids), prompt_token_ids=prompt_ids,
                             params=params, index=i) for i in range(params.n)]
        self.processor.add_request(request_id, PROMPT, sequences)
        return sequences

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def step(self, *sampled: tuple[Request, int]) -> list[RequestOutput]:
        """One step in which each request of ``sampled`` got its token."""
        requests = [request for request, _ in sampled]
        step = ExecutedStep(requests, [SampledToken(r, t) for r, t in sampled], time=1.0)
        return self.processor.process(step, self.finished.append)

    def feed(self, request: Request, tokens: list[int]) -> list[RequestOutput]:
        """One step per token, all for ``request``; every output in order."""
        outputs = []
        for token in tokens:
            outputs += self.step((request, token))
        return outputs


def texts(outputs: list[RequestOutput], index: int = 0) -> list[str]:
    return [c.text for o in outputs for c in o.outputs if c.index == index]


def last(outputs: list[RequestOutput]) -> CompletionOutput:
    return outputs[-1].outputs[0]


def test_a_stop_string_spanning_two_tokens_cuts_the_text_and_is_held_back(
        tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    (request,) = h.add(SamplingParams(max_tokens=10, stop=["o w"]))
    tokens = h.ids(" Hello world and more")
    assert [tokenizer.decode([t]) for t in tokens[:2]] == [" Hello", " world"]
    outputs = h.feed(request, tokens[:2])
    # " Hello" minus the two characters that could start "o w", then the rest up to the stop
    assert texts(outputs) == [" Hel", "l"]
    final = last(outputs)
    assert (final.finish_reason, final.stop_reason) == ("stop", "o w")
    assert outputs[-1].finished and h.finished == [request]
    assert request.output_token_ids == tokens[:2]  # the token stays, its text does not


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    (request,) = h.add(SamplingParams(max_tokens=10, stop=["o w"],
                                      include_stop_str_in_output=True))
    outputs = h.feed(request, h.ids(" Hello world and more")[:2])
    assert "".join(texts(outputs)) == " Hello w"
    assert last(outputs).finish_reason == "stop"


def test_min_tokens_blocks_eos_and_stop_token_ids_until_enough_are_out(
        tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    (request,) = h.add(SamplingParams(max_tokens=10, min_tokens=2))
    h.feed(request, [h.eos, h.eos])
    assert not h.finished  # two tokens are out: min_tokens is met only after them
    final = last(h.feed(request, [h.eos]))
    assert (final.finish_reason, final.stop_reason) == ("stop", None)
    assert h.finished == [request]

    stop_id = h.ids(" two")[0]
    (other,) = h.add(SamplingParams(max_tokens=10, min_tokens=1, stop_token_ids=[stop_id]), "s")
    h.feed(other, [stop_id])
    assert h.finished == [request]
    final = last(h.feed(other, [stop_id]))
    assert (final.finish_reason, final.stop_reason) == ("stop", stop_id)


def test_eos_finishes_without_text_unless_ignore_eos(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    (request,) = h.add(SamplingParams(max_tokens=10))
    outputs = h.feed(request, [*h.ids(" one"), h.eos])
    assert texts(outputs) == [" one", ""] and last(outputs).finish_reason == "stop"
    (ignoring,) = h.add(SamplingParams(max_tokens=10, ignore_eos=True), "i")
    h.feed(ignoring, [h.eos])
    assert h.finished == [request]


def test_max_tokens_and_the_context_end_finish_with_length(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    (request,) = h.add(SamplingParams(max_tokens=3))
    tokens = h.ids(" one two three four")
    outputs = h.feed(request, tokens[:3])
    assert [o.finished for o in outputs] == [False, False, True]
    assert last(outputs).finish_reason == "length" and "".join(texts(outputs)) == " one two three"

    prompt_len = len(h.ids(PROMPT))
    short = Harness(tokenizer, max_model_len=prompt_len + 2)
    (request,) = short.add(SamplingParams(max_tokens=None))
    outputs = short.feed(request, tokens[:2])
    assert [o.finished for o in outputs] == [False, True]
    assert last(outputs).finish_reason == "length"


def test_deltas_of_two_sequences_add_up_and_a_finished_one_is_sent_once(
        tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    first, second = h.add(SamplingParams(max_tokens=3, n=2))
    one, two, three, four = h.ids(" one two three four")
    outputs = [*h.step((first, one), (second, two)), *h.step((first, two)),
               *h.step((first, three), (second, four)), *h.step((second, one))]
    by_step = [[(c.index, c.text, c.token_ids) for c in o.outputs] for o in outputs]
    assert by_step == [
        [(0, " one", [one]), (1, " two", [two])],
        [(0, " two", [two]), (1, "", [])],  # 1 ran nothing: an empty delta
        [(0, " three", [three]), (1, " four", [four])],  # 0 finishes: its last delta
        [(1, " one", [one])],  # 0 was handed out finished: left out from now on
    ]
    assert [o.finished for o in outputs] == [False, False, False, True]
    assert h.finished == [first, second]
    assert "r" not in h.processor.requests  # forgotten once its finished output is out


def test_full_output_and_logprobs_follow_the_deltas(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    first, second = h.add(SamplingParams(max_tokens=2, n=2, logprobs=0))
    state = h.processor.requests["r"]
    tokens = h.ids(" one two")
    deltas = []
    for token in tokens:
        step = ExecutedStep([first, second],
                            [SampledToken(r, token, {token: Logprob(-0.5, 1)})
                             for r in (first, second)], time=1.0)
        deltas += h.processor.process(step, h.finished.append)
    full = state.output(delta=False)
    assert full.finished and full.prompt == PROMPT
    for index in (0, 1):
        completion = full.outputs[index]
        assert completion.text == "".join(texts(deltas, index)) == " one two"
        assert completion.token_ids == tokens
        assert completion.logprobs == [{t: Logprob(-0.5, 1)} for t in tokens]
        assert [len(c.logprobs or []) for d in deltas for c in d.outputs
                if c.index == index] == [1, 1]


def test_abort_finishes_what_is_unfinished_and_forgets_the_request(
        tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    first, second = h.add(SamplingParams(max_tokens=1, n=2))
    h.step((first, h.ids(" one")[0]))
    assert h.finished == [first]
    assert h.processor.abort_request("r", h.finished.append)
    assert h.finished == [first, second]
    assert h.processor.requests == {}
    assert not h.processor.abort_request("r", h.finished.append)


def test_prompt_logprobs_of_a_recomputed_chunk_are_kept_from_the_first_pass(
        tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    (request,) = h.add(SamplingParams(max_tokens=1, prompt_logprobs=0))

    def chunk(first: int, last: int, logprob: float) -> PromptLogprobsChunk:
        return PromptLogprobsChunk(request, first,
                                   [{p: Logprob(logprob, 1)} for p in range(first, last + 1)])

    def run(*chunks: PromptLogprobsChunk) -> list[RequestOutput]:
        return h.processor.process(ExecutedStep([request], prompt_logprobs=list(chunks)),
                                   h.finished.append)

    run(chunk(1, 3, -1.0))
    run(chunk(1, 2, -2.0))  # preempted: the prompt is computed again from the start
    outputs = run(chunk(3, 5, -2.0))
    assert outputs[0].prompt_logprobs == [None, *[{p: Logprob(-1.0 if p <= 3 else -2.0, 1)}
                                                  for p in range(1, 6)]]
