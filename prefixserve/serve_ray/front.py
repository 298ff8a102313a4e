"""The HTTP front of ``serve --replicas``: the user's port, in front of Ray Serve's proxy.

Ray Serve's proxy listens on an internal port of 127.0.0.1 and sends each request to the
``PrefixserveIngress`` deployment. When the ingress process dies, the proxy cuts every stream
that ran through it and answers the requests the ingress held but had not answered yet with a
500 of its own (uvicorn's ``text/plain`` "Internal Server Error": the proxy sends nothing for a
``RayActorError``); it answers a 503 in ``text/plain`` when no ingress replica is available
(``DeploymentUnavailableError``) or its queue is full. This front, a small ASGI application run by
uvicorn in the ``serve`` process, forwards each request to the proxy and streams its answer back,
and hides those failures from the client:

- **Before any byte of the answer went out** (``retry_reason``): a connection error, a cut before
  or while reading a whole (not event-stream) body, or a 5xx whose body is not an error of our
  application (the API's JSON ``{"error": ...}`` shapes, OpenAI's and Anthropic's) is sent again,
  after a backoff (0.1 s, doubling up to 2 s), until ``retry_timeout`` seconds have passed since
  the request came; then the answer is a 503 in the API's error shape (``ingress_unavailable``)
  with ``Retry-After``.
- **After an event stream started**: a cut ends it with an error event in the API's own shape
  (``stream_error_event``, code ``ingress_died``), as the ingress ends a stream whose replica
  died; a stream is never retried (the client saw part of it).
- **A client that disconnects** closes the request to the proxy, which cancels it in the ingress
  and the replica (the engine aborts it and frees its blocks).

Event streams are passed on chunk by chunk as they arrive; other answers are read whole first
(so that a cut among them can be retried). Nothing of the proxy's address or of the failure's
details reaches the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from typing import Any, cast

import httpx

logger = logging.getLogger("prefixserve.serve_ray.front")

RETRY_FIRST_DELAY_S = 0.1
RETRY_MAX_DELAY_S = 2.0
RETRY_AFTER_S = 2
"""``Retry-After`` of the 503 sent when the proxy did not answer in time."""
ANTHROPIC_PATH = "/v1/messages"
OVERRIDE_PREFIX = "/routing/"
_HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"expect", b"proxy-authenticate",
                          b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                          b"upgrade", b"host", b"content-length"})
_UPSTREAM_ONLY = _HOP_HEADERS | {b"date", b"server"}
"""Response headers not passed on (uvicorn writes its own ``date`` and ``server``)."""


# ----------------------------------------------------------------------------- error shapes
def api_path(path: str) -> str:
    """The API path of ``path``: ``/routing/<policy>/v1/...`` (``--routing-override``) is
    ``/v1/...``."""
    if path.startswith(OVERRIDE_PREFIX):
        rest = path[len(OVERRIDE_PREFIX):].partition("/")[2]
        return "/" + rest
    return path


def stream_error_event(path: str, code: str, message: str) -> bytes:
    """The end of an event stream that cannot go on, in the API's own shape: Anthropic's
    ``event: error`` under ``/v1/messages``, else ``data: {"error": ...}`` and
    ``data: [DONE]``."""
    if api_path(path).startswith(ANTHROPIC_PATH):
        event = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    error = {"error": {"message": message, "type": "server_error", "param": None,
                       "code": code}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def error_body(path: str, code: str, message: str, anthropic_type: str = "api_error") -> bytes:
    """An error's body in the API's own shape: Anthropic's under ``/v1/messages`` (of type
    ``anthropic_type``), else OpenAI's with ``code``."""
    if api_path(path).startswith(ANTHROPIC_PATH):
        return json.dumps({"type": "error", "error": {"type": anthropic_type,
                                                      "message": message}}).encode()
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": code}}).encode()


def unavailable_body(path: str) -> bytes:
    """The 503 body when the proxy did not answer before the deadline."""
    return error_body(path, "ingress_unavailable",
                      "the server could not take the request in time; try again",
                      "overloaded_error")


def is_application_error(body: bytes) -> bool:
    """Whether ``body`` is an error of our application (a JSON object with an ``error``
    object: OpenAI's shape and Anthropic's). Ray Serve's own errors are plain text."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)


def retry_reason(status: int, body: bytes) -> str | None:
    """Why a whole answer of the proxy is sent again (None: it goes to the client): a 5xx
    that is not our application's error comes from Ray Serve (its ingress died or is not
    available yet)."""
    if status >= 500 and not is_application_error(body):
        return f"{status} from Ray Serve"
    return None


def next_delay(delay: float) -> float:
    return min(2 * delay, RETRY_MAX_DELAY_S)


# ----------------------------------------------------------------------------- the application
class Front:
    """The ASGI application: every HTTP request forwarded to ``upstream`` (the proxy's base
    URL), answered as the module describes."""

    def __init__(self, upstream: str, retry_timeout: float,
                 client: httpx.AsyncClient | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.retry_timeout = retry_timeout
        self._client = client

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made in the server's own event loop
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=5.0), trust_env=False,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        return self._client

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        body = await _read_body(receive)
        if body is None:
            return  # the client left while sending
        answer = asyncio.ensure_future(self._answer(scope, body, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        if answer.done():
            gone.cancel()
            answer.result()
            return
        answer.cancel()  # the client left: closing the request cancels it upstream
        with contextlib.suppress(asyncio.CancelledError):
            await answer

    def _request(self, scope: dict[str, Any], body: bytes) -> httpx.Request:
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string") or b""
        url = self.upstream + path.decode("latin-1") + ("?" + query.decode("latin-1")
                                                        if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_HEADERS]
        return self.client.build_request(scope["method"], url, headers=headers, content=body)

    async def _answer(self, scope: dict[str, Any], body: bytes, send: Any) -> None:
        """Tries the proxy until it answers or the deadline passes (then a 503)."""
        deadline = time.monotonic() + self.retry_timeout
        delay = RETRY_FIRST_DELAY_S
        tries = 0
        while True:
            tries += 1
            reason = await self._try(scope, self._request(scope, body), send)
            if reason is None:
                if tries > 1:
                    logger.info("%s %s answered after %d tries", scope["method"],
                                scope["path"], tries)
                return
            if time.monotonic() + delay > deadline:
                break
            logger.debug("%s %s not answered (%s); trying again in %.1f s", scope["method"],
                         scope["path"], reason, delay)
            await asyncio.sleep(delay)
            delay = next_delay(delay)
        logger.warning("%s %s not answered in %.0f s (%d tries; last: %s): 503",
                       scope["method"], scope["path"], self.retry_timeout, tries, reason)
        await _send_whole(send, 503, [(b"content-type", b"application/json"),
                                      (b"retry-after", str(RETRY_AFTER_S).encode())],
                          unavailable_body(scope["path"]))

    async def _try(self, scope: dict[str, Any], request: httpx.Request,
                   send: Any) -> str | None:
        """One try: None once the answer went to the client, else why it is to be retried."""
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            return type(exc).__name__
        try:
            headers = [(k, v) for k, v in response.headers.raw
                       if k.lower() not in _UPSTREAM_ONLY]
            events = response.headers.get("content-type", "").startswith("text/event-stream")
            if events and response.status_code < 500:
                await send({"type": "http.response.start", "status": response.status_code,
                            "headers": headers})
                await _pass_stream(response, scope["path"], send)
                return None
            try:
                content = b"".join([chunk async for chunk in response.aiter_raw()])
            except httpx.TransportError as exc:
                return f"cut while reading ({type(exc).__name__})"
            reason = retry_reason(response.status_code, content)
            if reason is None:
                await _send_whole(send, response.status_code, headers, content)
            return reason
        finally:
            await response.aclose()


async def _pass_stream(response: httpx.Response, path: str, send: Any) -> None:
    """An event stream, chunk by chunk; a cut ends it with an error event."""
    try:
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except httpx.TransportError as exc:
        logger.warning("the stream of %s was cut upstream (%s): ending it with an error event",
                       path, type(exc).__name__)
        await send({"type": "http.response.body", "more_body": True,
                    "body": stream_error_event(
                        path, "ingress_died",
                        "the process serving this request stopped; the answer is incomplete")})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_whole(send: Any, status: int, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _read_body(receive: Any) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _disconnected(receive: Any) -> None:
    """Returns when the client disconnects (uvicorn answers ``receive`` then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# ----------------------------------------------------------------------------- the server
def bind(host: str, port: int) -> socket.socket:
    """The user's port, bound (not listening yet) before Ray starts: a port in use fails the
    start at once, and the proxy's internal port cannot take it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def free_local_port() -> int:
    """A free TCP port of 127.0.0.1 (for Ray Serve's proxy)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def guarded(front: Front, max_body_size: int) -> Any:
    """``front`` behind one server's body limit (``--max-request-body-size``: a larger body is
    a 413 in the API's shape, and is neither kept in memory nor sent on)."""
    from prefixserve.server.transport import BodyLimitMiddleware

    return BodyLimitMiddleware(cast(Any, front), max_body_size)


class FrontServer:
    """uvicorn serving a ``Front`` on ``sock`` in a thread of its own (with its own event loop;
    the main thread keeps the signal handling), with one server's connection protections:
    the body limit (``guarded``) and the read timeout (``--request-read-timeout``: a client
    that sends its request slower is disconnected)."""

    def __init__(self, front: Front, sock: socket.socket, log_level: str, access_log: bool,
                 shutdown_timeout: float, max_body_size: int, read_timeout: float) -> None:
        import uvicorn

        from prefixserve.server.transport import read_timeout_protocol

        self.front = front
        self.sock = sock
        config = uvicorn.Config(guarded(front, max_body_size), lifespan="off",
                                log_level=log_level, access_log=access_log,
                                http=read_timeout_protocol(read_timeout),
                                timeout_graceful_shutdown=max(1, round(shutdown_timeout)))
        self.shutdown_timeout = shutdown_timeout
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="prefixserve-front", daemon=True)

    def _run(self) -> None:
        with contextlib.suppress(SystemExit):  # uvicorn's exit on a start failure (logged)
            self.server.run(sockets=[self.sock])

    def start(self, timeout: float = 60.0) -> None:
        """Starts serving; raises RuntimeError if uvicorn does not start."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP front did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stops taking connections; running requests get ``shutdown_timeout`` seconds to
        finish (then uvicorn cancels them)."""
        self.server.should_exit = True
        self.thread.join(self.shutdown_timeout + 10)
        self.sock.close()
