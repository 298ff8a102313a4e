"""``--kv-events-zmq ENDPOINT``: the prefix cache's KV events pushed over a ZMQ PUB socket.

A router that prefers push to polling ``GET /kv_events`` subscribes to ``ENDPOINT`` (the server
binds it, e.g. ``tcp://*:5557``; vLLM's ``KVEventsConfig`` publishes the same way). Every
``PUBLISH_PERIOD_S`` the server flushes its events and sends each new batch as one multipart
message of three frames:

1. the topic, ``TOPIC`` (subscribe to it, or to ``b""``);
2. the batch's ``seq`` as an 8-byte big-endian unsigned integer;
3. the batch in its JSON form (docs/KV_EVENTS.md), UTF-8.

PUB/SUB drops messages when a subscriber is slow or joins late, so a subscriber must check the
sequence numbers: a gap, a first message, or a new ``epoch`` means it resynchronises from the
snapshot that ``GET /kv_events`` answers (an admin action), then applies the batches after the
snapshot's ``seq``. Events switch on when the server starts with this flag. The socket is closed
when the server stops; ``pyzmq`` is needed only with the flag (``prefixserve[zmq]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported by launch.py for ``check_endpoint``: nothing heavy at run time
    from fastapi import FastAPI

    from prefixserve.engine.async_llm import AsyncLLM

logger = logging.getLogger("prefixserve.server")

TOPIC = b"kv-events"
PUBLISH_PERIOD_S = 0.1
"""How often new batches are flushed and sent."""
HISTORY = 1024
"""Batches the engine keeps for ``GET /kv_events`` (a resync after a gap)."""


def check_endpoint(endpoint: str) -> None:
    """ValueError unless ``endpoint`` is a ZMQ endpoint and pyzmq is installed."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--kv-events-zmq takes a ZMQ endpoint such as tcp://*:5557, got "
                         f"{endpoint!r}")
    if importlib.util.find_spec("zmq") is None:
        raise ValueError("--kv-events-zmq needs pyzmq: pip install 'prefixserve[zmq]'")


def install_kv_event_publisher(app: FastAPI, engine: AsyncLLM, endpoint: str) -> None:
    """Binds ``endpoint`` when ``app`` starts and publishes until it stops (wraps the app's
    lifespan, so the engine's own shutdown still runs last)."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
        socket = _bind(endpoint)
        task = asyncio.ensure_future(_publish(engine, socket))
        try:
            async with inner(app) as state:
                try:
                    yield state
                finally:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        finally:
            socket.close(linger=0)

    app.router.lifespan_context = lifespan


def _bind(endpoint: str) -> Any:
    import zmq

    socket: Any = zmq.Context.instance().socket(zmq.PUB)
    socket.bind(endpoint)
    return socket


async def _publish(engine: AsyncLLM, socket: Any) -> None:
    """Sends every batch after the last one sent; a batch the engine no longer keeps is
    skipped (subscribers see the gap and resync)."""
    import zmq

    from prefixserve.server.admin.kv_event_routes import REPLICA_ID

    await engine.enable_kv_events(REPLICA_ID, history=HISTORY)
    sent = 0
    while True:
        _, seq, batches = await engine.kv_events(sent)
        for batch in batches or []:
            frames = [TOPIC, batch.seq.to_bytes(8, "big"), json.dumps(batch.to_wire()).encode()]
            try:
                socket.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # the high-water mark is reached: dropped, like PUB does
                logger.debug("KV event batch %d dropped (ZMQ high-water mark)", batch.seq)
        sent = seq
        await asyncio.sleep(PUBLISH_PERIOD_S)
