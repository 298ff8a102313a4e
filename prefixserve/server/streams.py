"""Running engine requests on behalf of an HTTP request, and stopping them when it goes away.

``MultiStream`` runs one engine request per prompt, each in a task of its own, and merges their
outputs in arrival order. Cancelling a task closes its engine iterator, which aborts the engine
request and frees its blocks; ``MultiStream.aclose`` does that for all of them, so whoever owns a
``MultiStream`` frees everything by closing it, whatever state the requests are in.

``run_unless_disconnected`` awaits work (such as a whole non-streamed generation) while watching
the connection, and cancels the work if the client disconnects first. ``EventStreamResponse``
sends server-sent events and closes its ``MultiStream`` however the response ends.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from prefixserve.engine.errors import EngineDeadError
from prefixserve.outputs import RequestOutput
from prefixserve.server.errors import error_body

logger = logging.getLogger("prefixserve.server")

T = TypeVar("T")

_END = object()


class ClientDisconnectedError(Exception):
    """The client closed the connection before the answer was ready."""


class MultiStream:
    """Merged outputs of several engine requests, as ``(source index, output)`` pairs.

    ``start`` waits until every source has produced its first output, so that an error any of
    them raises before generating (a full queue, a bad prompt) surfaces before anything is sent
    to the client; it then closes every source and re-raises. After ``start``, iterating yields
    the outputs in the order they arrived, and raises the first error a source raises."""

    def __init__(self, sources: Sequence[AsyncGenerator[RequestOutput, None]]) -> None:
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._buffer: collections.deque[tuple[int, Any]] = collections.deque()
        self._open = len(sources)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(sources)]

    async def _pump(self, index: int, source: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async with aclosing(source) as outputs:
                async for output in outputs:
                    self._queue.put_nowait((index, output))
            self._queue.put_nowait((index, _END))
        except Exception as exc:  # handed to the consumer
            self._queue.put_nowait((index, exc))

    async def start(self) -> None:
        pending = set(range(len(self._tasks)))
        try:
            while pending:
                index, item = await self._queue.get()
                if isinstance(item, Exception):
                    raise item
                self._buffer.append((index, item))
                pending.discard(index)
        except BaseException:
            await self.aclose()
            raise

    def __aiter__(self) -> MultiStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._open:
            index, item = self._buffer.popleft() if self._buffer else await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, Exception):
                raise item
            return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Aborts the requests still running (the cancellations are issued before any await,
        so they happen even if this call is itself cancelled)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Returns what ``work`` returns; if the client disconnects first, cancels ``work`` and
    raises ``ClientDisconnectedError``. Call it only once the request body has been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnectedError
    return task.result()


class EventStreamResponse(StreamingResponse):
    """Server-sent events made from ``stream``. Whatever way the response ends (done, client
    gone, server shutting down), the events and ``stream`` are closed, which aborts the engine
    requests still running."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], stream: MultiStream) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
        self._events = events
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            await self._stream.aclose()


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One ``data:`` event holding ``payload`` as JSON."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def error_event(exc: Exception) -> str:
    """The event that reports an error after a stream started (its status is sent already):
    a 503 ``engine_unavailable`` when the engine stopped or the server is shutting down
    (``EngineDeadError``), else a 500 ``generation_failed``."""
    if isinstance(exc, EngineDeadError):
        logger.warning("a streamed response was cut: %s", exc)
        return sse_event(error_body(503, f"generation stopped: {exc}",
                                    code="engine_unavailable"))
    logger.error("generation failed after its response started: %s", exc)
    return sse_event(error_body(500, f"generation failed: {exc}", code="generation_failed"))
