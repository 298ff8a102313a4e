"""Connection-level protections: what the server does before a request reaches a route, and how
connections end.

- **Read timeout** (``read_timeout_protocol``): a connection whose request headers and body are
  not fully received within ``request_read_timeout`` seconds is closed. The clock starts when a
  request may begin (the connection is made, or the previous response on a keep-alive
  connection finished) and stops once the request's body is complete, so a slow client (a
  slowloris) holds a connection for a bounded time. Idle keep-alive connections are still closed
  by uvicorn's own ``timeout_keep_alive`` (5 s), which is shorter than the default read timeout.
- **Body size limit** (``BodyLimitMiddleware``): a body larger than ``max_request_body_size``
  is answered 413 with an OpenAI-style JSON error, whether it is announced by Content-Length
  (answered before reading it) or sent chunked (answered once the limit is passed). The
  application gets the whole body as one message.
- **Trailing slash** (``TrailingSlashMiddleware``): ``/v1/models/`` is routed as ``/v1/models``
  (no redirect).
- **Engine gone** (``install_transport_guards``): a request cut because the engine stopped or
  the server is shutting down is answered 503 if its status is not sent yet.
- **Shutdown** (``DrainingServer``): on SIGINT or SIGTERM, running requests get
  ``drain_timeout`` seconds to finish; then ``on_drain_timeout`` runs (it should end every
  running request with an error, which a streamed response reports as an error event before
  ``data: [DONE]``), and uvicorn cancels what is still running ``CANCEL_GRACE_S`` seconds later.
  The process then exits normally (status 0): the signal is not raised again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixserve.engine.errors import EngineDeadError
from prefixserve.server.anthropic.serving import ANTHROPIC_PATH, anthropic_error
from prefixserve.server.config import ServerConfig
from prefixserve.server.errors import ApiError, error_response

logger = logging.getLogger("prefixserve.server")

#: Seconds uvicorn waits after ``on_drain_timeout`` before cancelling what still runs.
CANCEL_GRACE_S = 5.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: h11 states of the client while its request is still being received.
_RECEIVING = (h11.IDLE, h11.SEND_BODY)


# ---------------------------------------------------------------------- read timeout
class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request takes longer than
    ``read_timeout`` seconds to arrive. Use ``read_timeout_protocol`` to set the timeout."""

    read_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._sync_read_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _sync_read_timer(self) -> None:
        """Runs the timer while a request is awaited or being received, and only then."""
        if self.transport.is_closing() or self.conn.their_state not in _RECEIVING:
            self._cancel_read_timer()
        elif self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            logger.debug("closing a connection from %s: its request did not arrive in %g s",
                         self.client, self.read_timeout)
            self.transport.close()


def read_timeout_protocol(read_timeout: float) -> type[H11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)`` for this read timeout."""
    if read_timeout <= 0:
        raise ValueError("read_timeout must be positive")
    return type("ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,),
                {"read_timeout": float(read_timeout)})


# ---------------------------------------------------------------------- ASGI middlewares
def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    return int(value) if value is not None and value.strip().isdigit() else None


class BodyLimitMiddleware:
    """Reads each HTTP request's body before the application runs, refusing with a 413 JSON
    error one larger than ``max_body_size`` bytes; the application then receives the body as
    a single message, and later ``receive`` calls (disconnect watching) pass through."""

    def __init__(self, app: ASGIApp, max_body_size: int) -> None:
        self.app = app
        self.max_body_size = max_body_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_size:
            await self._refuse(scope, receive, send)
            return
        body = await self._read_body(receive)
        if body is None:  # the client went away
            return
        if len(body) > self.max_body_size:
            await self._refuse(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The body, or as soon as it passes the limit the part read so far; None if the
        client disconnects first."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            part = message.get("body", b"")
            parts.append(part)
            size += len(part)
            if size > self.max_body_size or not message.get("more_body", False):
                return b"".join(parts)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A 413 before any work starts, in the shape of the API the path belongs to."""
        message = (f"the request body is larger than this server's limit of "
                   f"{self.max_body_size} bytes (--max-request-body-size)")
        if str(scope.get("path", "")).startswith(ANTHROPIC_PATH):
            response = anthropic_error(413, message)
        else:
            response = error_response(ApiError(413, message, code="request_too_large"))
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that first returns ``body`` whole, then defers to ``receive``."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class TrailingSlashMiddleware:
    """Routes a path ending with ``/`` (other than ``/`` itself) as the path without it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path[:-1]}
            raw_path = scope.get("raw_path")
            if isinstance(raw_path, bytes) and raw_path.endswith(b"/"):
                scope["raw_path"] = raw_path[:-1]
        await self.app(scope, receive, send)


async def _engine_gone(request: Request, exc: Exception) -> JSONResponse:
    return error_response(ApiError(503, str(exc) or "the engine is not running",
                                   code="engine_unavailable"))


def install_transport_guards(app: FastAPI, config: ServerConfig) -> None:
    """Adds the body limit and the trailing-slash routing to ``app``, and answers a request
    cut by the engine stopping (``EngineDeadError``) with a 503."""
    app.add_middleware(BodyLimitMiddleware, max_body_size=config.max_request_body_size)
    app.add_middleware(TrailingSlashMiddleware)
    app.add_exception_handler(EngineDeadError, _engine_gone)


# ---------------------------------------------------------------------- shutdown
class DrainingServer(uvicorn.Server):
    """A uvicorn server that ends running requests through ``on_drain_timeout`` once
    ``drain_timeout`` seconds of a graceful shutdown have passed, cancels what still runs
    ``CANCEL_GRACE_S`` seconds later (it sets ``config.timeout_graceful_shutdown`` to their
    sum), and does not re-raise the stop signal, so a graceful stop exits with status 0."""

    def __init__(self, config: uvicorn.Config, drain_timeout: float,
                 on_drain_timeout: Callable[[], None]) -> None:
        config.timeout_graceful_shutdown = drain_timeout + CANCEL_GRACE_S  # type: ignore[assignment]
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self.on_drain_timeout = on_drain_timeout

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM start a graceful shutdown (a second SIGINT forces it); the
        previous handlers are restored afterwards and the signal is not raised again."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self._drain_expired)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _drain_expired(self) -> None:
        logger.warning("shutdown timeout (%g s) passed: ending the requests still running",
                       self.drain_timeout)
        self.on_drain_timeout()
