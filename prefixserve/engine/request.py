"""The engine's request: the prefix cache's ``CacheRequest`` plus generation state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from prefixserve.core import CacheRequest
from prefixserve.model.tokenizer import IncrementalDetokenizer
from prefixserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from prefixserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request(CacheRequest):
    """One sequence being generated (``index`` of the ``n`` of request ``group_id``).

    ``token_ids`` (from ``CacheRequest``) is the prompt followed by the outputs so far;
    ``output_token_ids`` repeats the outputs for the sampler, and ``prompt_token_ids`` keeps the
    prompt (shared by the ``n`` sequences of a request, never modified), so no step has to slice
    it out of ``token_ids`` again. ``num_cached_tokens`` is the
    number of prompt tokens served from the prefix cache when the request was first scheduled
    (-1 before). ``text`` is the detokenised output; ``sent_text``/``sent_tokens`` say how much
    of it was already streamed.
    """

    group_id: str = ""
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_sent: bool = False


    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_tokens

    def completion(self, delta: bool) -> CompletionOutput:
        """This sequence's output: everything so far, or (``delta``) only what was not handed
        out before; ``finish_sent`` records that the finished state was handed out. While
        unfinished, text that could still turn out to be the start of a stop string is held
        back."""
        text = self.text
        if not self.is_finished and self.params.stop:
            hold = max(len(s) for s in self.params.stop) - 1
            text = text[: max(len(text) - hold, self.sent_text)]
        tokens = self.output_token_ids
        logprobs = self.logprobs
        if delta:
            out = CompletionOutput(self.index, text[self.sent_text :],
                                   tokens[self.sent_tokens :], self.finish_reason,
                                   self.stop_reason,
                                   logprobs[self.sent_logprobs :] if logprobs is not None else None)
            self.sent_text = len(text)
            self.sent_tokens = len(tokens)
            self.sent_logprobs = len(logprobs) if logprobs is not None else 0
            self.finish_sent = self.is_finished
            return out
        return CompletionOutput(self.index, text, list(tokens), self.finish_reason,
                                self.stop_reason, list(logprobs) if logprobs is not None else None)



def make_request_output(group_id: str, children: list[Request],
                        completions: list[CompletionOutput]) -> RequestOutput:
    """The output of request ``group_id`` (its ``n`` sequences ``children``) carrying
    ``completions``; finished once every sequence is."""
    first = children[0]
    return RequestOutput(
        request_id=group_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=all(c.is_finished for c in children),
        num_cached_tokens=max(first.num_cached_tokens, 0),
        metrics=first.metrics,
        prompt_logprobs=first.prompt_logprobs,
    )
