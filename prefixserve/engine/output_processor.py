"""Output processing: from sampled tokens to the deltas a caller streams.

``LLMEngine.step`` does three things: the scheduler picks the work, ``LLMEngine._execute`` runs
the model and samples, and ``OutputProcessor.process`` turns what was sampled into outputs:

1. each sampled token is appended to its request (``Request.append_output_token``: the token ids
   the scheduler, the cache and the sampler read) and detokenised incrementally;
2. the sequence finishes on a stop token id or EOS (once more than ``min_tokens`` are out; EOS
   unless ``ignore_eos``), on a stop string (the text is cut there), at ``max_tokens`` or at the
   end of the context; a finished sequence is handed to the scheduler, which releases its blocks;
3. every request that ran in the step (the ``n`` sequences a caller knows by one id) gets one
   delta ``RequestOutput``: what each of its sequences added since the previous one.

The state kept here is what the caller sees and the scheduler does not need: per sequence
(``SequenceState``) the text and its detokenizer, the logprobs, the finish and stop reasons and
the streaming cursors; per request (``RequestState``) the prompt text and the sequences.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prefixserve.engine.request import Request
from prefixserve.model.text.tokenizer import IncrementalDetokenizer, Tokenizer
from prefixserve.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput

#: Called with a sequence's request once it has a finish reason (``Scheduler.finish_request``).
FinishRequest = Callable[[Request], None]

Logprobs = dict[int, Logprob]


@dataclass(slots=True)
class SampledToken:
    """A token sampled for ``request``; ``logprobs`` when the request asked for them."""

    request: Request
    token_id: int
    logprobs: Logprobs | None = None


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Prompt logprobs that one chunk of ``request``'s prompt predicted: ``entries[i]`` is for
    the prompt token at position ``first_position + i``. A chunk recomputed after preemption
    predicts its positions again; the first entry of each position is kept."""

    request: Request
    first_position: int
    entries: list[Logprobs | None]


@dataclass(slots=True)
class ExecutedStep:
    """What one model step produced, the input of ``OutputProcessor.process``.

    ``requests`` are the requests the step ran, in schedule order (also those still in prefill,
    which sampled nothing); ``sampled`` holds one token for each request whose tokens are all
    computed now, sampled at ``time`` (a request that verified drafts has its kept drafts and
    its own token there, in order: each is appended and checked for a stop in turn);
    ``prompt_logprobs`` one chunk per request that asked for them and computed prompt tokens
    in this step."""

    requests: list[Request]
    sampled: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    time: float = 0.0


@dataclass(slots=True, eq=False)
class SequenceState:
    """What one sequence (``request``) has produced for its caller.

    Invariants: ``text`` is the detokenised output, cut at the stop string that finished the
    sequence if one did. ``finish_reason`` is set once; from then on nothing is appended and the
    request is released (``Request.status`` is ``FINISHED``). The cursors count what delta
    outputs already handed out: ``sent_text`` characters of ``text``, ``sent_tokens`` output
    tokens, ``sent_logprobs`` logprob entries; ``finish_sent`` says that the finished state was
    handed out, after which no delta carries the sequence. Cursors only grow and never pass what
    they count. ``prompt_logprobs`` is None until the first chunk of a request that asked for
    them, then holds entry ``t`` for each prompt position ``t`` computed so far (entry 0: None).
    """

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_sent: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text(self) -> str:
        """``text``, less the tail that could still become the start of a stop string while the
        sequence is unfinished; never shorter than what was already handed out."""
        text, stop = self.text, self.request.params.stop
        if self.finished or not stop:
            return text
        hold = max(len(s) for s in stop) - 1
        return text[: max(len(text) - hold, self.sent_text)]

    def completion(self) -> CompletionOutput:
        """Everything this sequence produced so far."""
        logprobs = self.logprobs
        return CompletionOutput(self.request.index, self.visible_text(),
                                list(self.request.output_token_ids), self.finish_reason,
                                self.stop_reason, list(logprobs) if logprobs is not None else None)

    def take_delta(self) -> CompletionOutput:
        """What was not handed out before; moves the cursors past it."""
        text, tokens, logprobs = self.visible_text(), self.request.output_token_ids, self.logprobs
        out = CompletionOutput(self.request.index, text[self.sent_text :],
                               tokens[self.sent_tokens :], self.finish_reason, self.stop_reason,
                               logprobs[self.sent_logprobs :] if logprobs is not None else None)
        self.sent_text = len(text)
        self.sent_tokens = len(tokens)
        self.sent_logprobs = len(logprobs) if logprobs is not None else 0
        self.finish_sent = self.finished
        return out

    def add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Adds the entries of ``chunk`` for positions not known yet (chunks come in order)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        known = len(self.prompt_logprobs) - chunk.first_position
        self.prompt_logprobs.extend(chunk.entries[max(known, 0) :])

    def stop_at_stop_string(self, searched: int) -> None:
        """Finishes the sequence at the first stop string that ends in the text added after
        ``searched`` characters, cutting the text there (or after it, when asked)."""
        params, text = self.request.params, self.text
        for stop in params.stop or ():
            position = text.find(stop, max(0, searched - len(stop) + 1))
            if position < 0:
                continue
            self.text = text[: position + len(stop) if params.include_stop_str_in_output
                             else position]
            self.finish_reason, self.stop_reason = "stop", stop
            return


@dataclass(slots=True, eq=False)
class RequestState:
    """The output side of one request: its ``n`` sequences, known to the caller as
    ``request_id``, and its text ``prompt`` (None when it came as token ids). The output's
    ``num_cached_tokens``, ``metrics`` and ``prompt_logprobs`` are the first sequence's."""

    request_id: str
    prompt: str | None
    sequences: list[SequenceState]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def output(self, delta: bool) -> RequestOutput:
        """Everything so far, or (``delta``) what each sequence added since the previous delta
        output, leaving out the sequences whose finish was already handed out."""
        if delta:
            completions = [s.take_delta() for s in self.sequences if not s.finish_sent]
        else:
            completions = [s.completion() for s in self.sequences]
        first = self.sequences[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.request.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=max(first.request.num_cached_tokens, 0),
            metrics=first.request.metrics,
            prompt_logprobs=first.prompt_logprobs,
            num_cached_tokens_by_tier=first.request.num_cached_tokens_by_tier,
        )


class OutputProcessor:
    """Appends sampled tokens, detokenises, decides when sequences finish and builds the delta
    outputs.

    ``requests`` maps each request id from ``add_request`` until its finished output is handed
    out (or it is aborted) to its ``RequestState``; every request the scheduler holds belongs to
    one of them. ``prompt_tokens`` counts the prompt tokens of sequences that produced a token,
    ``generation_tokens`` the tokens produced. Single-threaded, like the engine.
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int],
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def add_request(self, request_id: str, prompt: str | None,
                    sequences: list[Request]) -> RequestState:
        """Tracks the output of ``sequences``, the ``n`` requests of ``request_id`` (in index
        order, sharing one prompt and one ``SamplingParams``)."""
        state = RequestState(request_id, prompt, [self._new_sequence(r) for r in sequences])
        self.requests[request_id] = state
        return state

    def known_prompt_positions(self, request: Request) -> int:
        """How many prompt positions of ``request``'s sequence already have logprobs (position
        0, which nothing predicts, counts once any chunk arrived)."""
        state = self.requests.get(request.group_id)
        if state is None:
            return 0
        known = state.sequences[request.index].prompt_logprobs
        return 0 if known is None else len(known)

    def _new_sequence(self, request: Request) -> SequenceState:
        params = request.params
        return SequenceState(
            request,
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                   params.skip_special_tokens),
            logprobs=[] if params.logprobs is not None else None,
        )

    def abort_request(self, request_id: str, finish: FinishRequest) -> bool:
        """Finishes every unfinished sequence of the request with reason ``abort`` and forgets
        the request; returns whether it was known."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        for sequence in state.sequences:
            if not sequence.finished:
                sequence.finish_reason = "abort"
                self._finish(sequence, finish)
        return True

    def process(self, step: ExecutedStep, finish: FinishRequest) -> list[RequestOutput]:
        """Takes in what ``step`` produced, calls ``finish`` for each sequence that finished,
        and returns one delta output per request that ran in the step, in schedule order. A
        request whose finished output is returned is forgotten."""
        for chunk in step.prompt_logprobs:
            self._sequence(chunk.request).add_prompt_logprobs(chunk)
        for sample in step.sampled:
            sequence = self._sequence(sample.request)
            if sequence.finished:
                continue
            self._append_token(sequence, sample, step.time)
            if sequence.finished:
                self._finish(sequence, finish)
        return self._outputs(step.requests)

    def _sequence(self, request: Request) -> SequenceState:
        return self.requests[request.group_id].sequences[request.index]

    def _append_token(self, sequence: SequenceState, sample: SampledToken, now: float) -> None:
        request = sequence.request
        request.append_output_token(sample.token_id)
        if sequence.logprobs is not None and sample.logprobs is not None:
            sequence.logprobs.append(sample.logprobs)
        self.generation_tokens += 1
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.prompt_tokens += request.num_prompt_tokens
        metrics.last_token_time = now
        self._check_stop(sequence, sample.token_id)

    def _check_stop(self, sequence: SequenceState, token: int) -> None:
        """Sets the finish (and stop) reason if ``token``, just appended, ends the sequence;
        extends the text unless the token is a stop token id or EOS that ends it."""
        request = sequence.request
        params = request.params
        num_out = len(request.output_token_ids)
        may_stop = num_out > params.min_tokens
        if may_stop and params.stop_token_ids and token in params.stop_token_ids:
            sequence.finish_reason, sequence.stop_reason = "stop", token
        elif may_stop and token in self.eos_token_ids and not params.ignore_eos:
            sequence.finish_reason = "stop"
        else:
            searched = len(sequence.text)
            sequence.text += sequence.detokenizer.add([token])
            if params.stop and num_out >= params.min_tokens:
                sequence.stop_at_stop_string(searched)
        if sequence.finished:
            return
        out_of_budget = params.max_tokens is not None and num_out >= params.max_tokens
        if out_of_budget or request.num_tokens >= self.max_model_len:
            sequence.finish_reason = "length"
            sequence.text += sequence.detokenizer.flush()

    @staticmethod
    def _finish(sequence: SequenceState, finish: FinishRequest) -> None:
        sequence.request.metrics.finished_time = time.time()
        finish(sequence.request)

    def _outputs(self, requests: list[Request]) -> list[RequestOutput]:
        outputs = []
        for request_id in dict.fromkeys(r.group_id for r in requests):
            output = self.requests[request_id].output(delta=True)
            if output.finished:
                del self.requests[request_id]
            outputs.append(output)
        return outputs
