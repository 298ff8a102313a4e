"""Sends a dataset to a server: arrivals, the concurrency limit, conversations in order.

Arrivals are per session. A session with an ``arrival`` (a replayed trace) starts then;
otherwise, with a finite ``request_rate``, sessions start one after another with exponential
gaps of mean ``1 / request_rate`` (a Poisson process, seeded), and with an infinite rate all
start at once. Within a session each turn is sent as soon as the reply to the previous one has
come, so the turns of one conversation never overlap while different conversations run side by
side. ``max_concurrency`` bounds the requests in flight over all sessions (a request waiting for
a slot is sent, and timed, once it has one).

A turn whose request fails ends its session: the later turns are recorded as not sent.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass

import numpy as np

from prefixserve.core.request import MultiModalInput
from prefixserve.tools.bench.client import CompletionClient
from prefixserve.tools.bench.datasets import Conversation, Dataset, Session, WordVocabulary
from prefixserve.tools.bench.metrics import RequestRecord


@dataclass(frozen=True)
class LoadSettings:
    """How fast sessions start and how many requests may be in flight (None: no limit)."""

    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be positive, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")


@dataclass
class SentPrompt:
    """A prompt as sent (token ids), the reply as the tokenizer reads its text back, and the
    pictures the prompt holds (where their placeholder tokens are in ``ids``)."""

    start: float
    ids: list[int]
    reply_ids: list[int]
    mm_inputs: tuple[MultiModalInput, ...] = ()


@dataclass
class RunOutput:
    """The records in the order the requests finished, and the prompts sent, in send order."""

    records: list[RequestRecord]
    sent: list[SentPrompt]


def session_starts(sessions: Sequence[Session], request_rate: float, seed: int) -> list[float]:
    """When each session starts, in seconds from the run's start (see the module docstring)."""
    rng = np.random.default_rng(seed)
    clock = 0.0
    starts = []
    for session in sessions:
        if session.arrival is not None:
            starts.append(session.arrival)
            continue
        if math.isfinite(request_rate):
            clock += float(rng.exponential(1.0 / request_rate))
        starts.append(clock if math.isfinite(request_rate) else 0.0)
    return starts


class _Run:
    def __init__(self, dataset: Dataset, client: CompletionClient, vocabulary: WordVocabulary,
                 load: LoadSettings, on_record: Callable[[RequestRecord], None]) -> None:
        self.dataset = dataset
        self.client = client
        self.vocabulary = vocabulary
        self.load = load
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self.sent: list[SentPrompt] = []
        self.semaphore = (asyncio.Semaphore(load.max_concurrency)
                          if load.max_concurrency is not None else None)
        self.t0 = 0.0

    def _slot(self) -> AbstractAsyncContextManager[object]:
        return self.semaphore if self.semaphore is not None else nullcontext()

    def _add(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.on_record(record)

    async def _session(self, index: int, session: Session, start: float) -> None:
        await asyncio.sleep(max(0.0, start - (time.perf_counter() - self.t0)))
        conversation = Conversation(session, self.vocabulary)
        while not conversation.done:
            ids, text, output_len = conversation.next_prompt()
            async with self._slot():
                sent_at = time.perf_counter() - self.t0
                result = await self.client.complete(ids, text, output_len,
                                                    conversation.chat_request())
            record = RequestRecord(
                session=index, turn=conversation.turn, group=session.group, start=sent_at,
                prompt_len=len(ids), output_len=output_len, **result.measured())
            self._add(record)
            if not record.ok:
                for turn in range(conversation.turn + 1, len(session.turns)):
                    self._add(RequestRecord(
                        session=index, turn=turn, group=session.group, start=sent_at,
                        prompt_len=0, output_len=session.turns[turn].output_len,
                        error=f"not sent: turn {conversation.turn} of the session failed"))
                return
            reply_ids = self.vocabulary.tokenizer.encode(result.text, add_special_tokens=False)
            self.sent.append(SentPrompt(sent_at, ids, reply_ids, tuple(conversation.mm_inputs)))
            conversation.add_reply(reply_ids, result.text)

    async def run(self) -> RunOutput:
        sessions = self.dataset.sessions
        starts = session_starts(sessions, self.load.request_rate, self.load.seed)
        self.t0 = time.perf_counter()
        await asyncio.gather(*(self._session(i, s, t)
                               for i, (s, t) in enumerate(zip(sessions, starts, strict=True))))
        self.sent.sort(key=lambda p: p.start)
        return RunOutput(self.records, self.sent)


async def run_dataset(dataset: Dataset, client: CompletionClient, vocabulary: WordVocabulary,
                      load: LoadSettings,
                      on_record: Callable[[RequestRecord], None] | None = None) -> RunOutput:
    """Sends every turn of ``dataset`` through ``client`` under ``load``; ``on_record`` is
    called with each record as its request ends (for a progress bar)."""
    return await _Run(dataset, client, vocabulary, load, on_record or (lambda _: None)).run()
