"""The HTTP front of ``serve --replicas`` (``serve_ray/front.py``) without a cluster: an upstream
of httpx's ``MockTransport`` plays Ray Serve's proxy (its plain-text 500 and 503, a refused
connection, a cut stream), and the front's ASGI application is called directly.

Which 5xx Ray Serve sends is read from its proxy (Ray 2.60, ``http_util.get_http_response_
status``): a ``RayActorError`` (the ingress died holding the request) is a 500 with no body of
the proxy's own, so uvicorn answers ``text/plain`` "Internal Server Error"; no available ingress
replica or a full queue is a ``text/plain`` 503. Our application's errors are JSON objects with
an ``error`` object (OpenAI's shape, Anthropic's ``{"type": "error", "error": {...}}``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from prefixserve.serve_ray import front as front_module
from prefixserve.serve_ray.front import Front, retry_reason, stream_error_event

pytestmark = pytest.mark.fast

RAY_500 = (500, b"Internal Server Error", "text/plain; charset=utf-8")
RAY_503 = (503, b"Deployment 'PrefixserveIngress' is unavailable.", "text/plain; charset=utf-8")
OURS_503 = (503, json.dumps({"error": {"message": "queue full", "type": "server_error",
                                       "param": None, "code": "queue_full"}}).encode(),
            "application/json")


@pytest.mark.parametrize(("answer", "retried"), [
    (RAY_500, True), (RAY_503, True), ((502, b"", "text/plain"), True),
    (OURS_503, False),
    ((529, b'{"type": "error", "error": {"type": "overloaded_error", "message": "m"}}',
      "application/json"), False),
    ((500, b'{"detail": "x"}', "application/json"), True),
    ((404, b"Path '/x' not found.", "text/plain"), False),
    ((200, b"ok", "text/plain"), False)])
def test_only_ray_serves_own_5xx_is_retried(answer: tuple[int, bytes, str],
                                            retried: bool) -> None:
    status, body, _ = answer
    assert (retry_reason(status, body) is not None) == retried


def test_the_error_event_has_the_apis_shape() -> None:
    openai = stream_error_event("/routing/round-robin/v1/completions", "ingress_died", "gone")
    first, done = openai.decode().strip().split("\n\n")
    assert done == "data: [DONE]"
    assert json.loads(first.removeprefix("data: "))["error"]["code"] == "ingress_died"
    for path in ("/v1/messages", "/routing/session/v1/messages"):
        name, data = stream_error_event(path, "ingress_died", "gone").decode().strip().split("\n")
        assert name == "event: error"
        assert json.loads(data.removeprefix("data: "))["error"]["type"] == "api_error"


# ----------------------------------------------------------------------------- the application
class Stream(httpx.AsyncByteStream):
    """An upstream body: ``chunks``, then a cut (``cut``) or, with ``hang``, no end at all."""

    def __init__(self, chunks: list[bytes], cut: bool = False, hang: bool = False) -> None:
        self.chunks, self.cut, self.hang = chunks, cut, hang
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.hang:
            await asyncio.sleep(3600)
        if self.cut:
            raise httpx.RemoteProtocolError("peer closed connection")

    async def aclose(self) -> None:
        self.closed = True


def _front(answers: list[Any], retry_timeout: float = 5.0) -> tuple[Front, list[httpx.Request]]:
    """A front whose upstream answers each try with the next of ``answers``: an exception to
    raise, a ``Stream`` (an event stream of 200) or ``(status, body, content type)`` (the
    content type ``cut``: the body is cut after its first 5 bytes)."""
    sent: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, Stream):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=answer)
        status, body, kind = answer
        return httpx.Response(status, headers={"content-type": kind, "server": "uvicorn"},
                              stream=Stream([body[:5]] if kind == "cut" else [body[:5], body[5:]],
                                            cut=kind == "cut"))

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return Front("http://127.0.0.1:1", retry_timeout, client), sent


def _call(front: Front, path: str = "/v1/completions", leave_after: float | None = None
          ) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request through ``front``: (status, headers, body) as the client got them. With
    ``leave_after``, the client disconnects that many seconds after sending."""
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"a=1", "headers": [(b"host", b"x"), (b"x-k", b"v")]}
    messages: list[dict[str, Any]] = []

    async def run() -> None:
        inbox: list[dict[str, Any]] = [{"type": "http.request", "body": b"{}"}]

        async def receive() -> dict[str, Any]:
            if inbox:
                return inbox.pop(0)
            await asyncio.sleep(3600 if leave_after is None else leave_after)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            messages.append(message)

        await front(scope, receive, send)

    asyncio.run(asyncio.wait_for(run(), 30))
    start = messages[0]
    body = b"".join(m.get("body", b"") for m in messages[1:])
    return start["status"], dict(start["headers"]), body


def test_a_request_ray_could_not_answer_is_sent_again_until_answered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused connection, a cut before the headers, Ray's plain-text 500 and 503 and a
    whole body cut while read are each tried again; the client gets the answer that came. (Planted:
    a front that passes the proxy's answer on gets Ray's 500 here.)"""
    monkeypatch.setattr(front_module, "RETRY_FIRST_DELAY_S", 0.01)
    front, sent = _front([httpx.ConnectError("refused"), httpx.RemoteProtocolError("cut"),
                          RAY_500, RAY_503, (200, b"partial", "cut"),
                          (200, b'{"id": "x"}', "application/json")])
    status, headers, body = _call(front)
    assert (status, body) == (200, b'{"id": "x"}')
    assert headers[b"content-length"] == b"11" and b"server" not in headers
    assert len(sent) == 6
    assert str(sent[0].url) == "http://127.0.0.1:1/v1/completions?a=1"
    assert sent[0].headers["x-k"] == "v" and sent[0].content == b"{}"


def test_our_own_errors_pass_at_once() -> None:
    front, sent = _front([OURS_503])
    status, _, body = _call(front)
    assert (status, body, len(sent)) == (503, OURS_503[1], 1)


def test_past_the_deadline_the_answer_is_a_503_in_the_apis_shape(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(front_module, "RETRY_FIRST_DELAY_S", 0.05)
    front, sent = _front([RAY_500] * 50, retry_timeout=0.3)
    status, headers, body = _call(front)
    assert status == 503 and headers[b"retry-after"] == b"2"
    assert json.loads(body)["error"]["code"] == "ingress_unavailable"
    assert b"127.0.0.1" not in body
    assert 3 <= len(sent) < 10  # 0.05, 0.1, 0.2 s of backoff
    front, _ = _front([RAY_503] * 50, retry_timeout=0.1)
    status, _, body = _call(front, "/v1/messages")
    assert (status, json.loads(body)["error"]["type"]) == (503, "overloaded_error")


def test_a_stream_cut_after_it_started_ends_with_an_error_event() -> None:
    """Streamed chunk by chunk; a cut is never retried (the client saw part of the answer), it
    ends with the error event. (Planted: letting the cut through fails here.)"""
    front, sent = _front([Stream([b"data: 1\n\n", b"data: 2\n\n"], cut=True)])
    status, headers, body = _call(front)
    assert status == 200 and headers[b"content-type"] == b"text/event-stream"
    assert body.startswith(b"data: 1\n\ndata: 2\n\n")
    assert body[len(b"data: 1\n\ndata: 2\n\n"):] == stream_error_event(
        "/v1/completions", "ingress_died",
        "the process serving this request stopped; the answer is incomplete")
    assert len(sent) == 1


def test_a_client_that_leaves_closes_the_upstream_request() -> None:
    """The client disconnects while the stream waits for its next chunk: the upstream body is
    closed (the proxy then cancels the request in the ingress and the replica)."""
    upstream = Stream([b"data: 1\n\n"], hang=True)
    front, _ = _front([upstream])
    status, _, body = _call(front, leave_after=0.2)
    assert (status, body) == (200, b"data: 1\n\n")
    assert upstream.closed


def test_an_upstream_request_closed_while_waiting_for_headers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that leaves while the proxy has not answered yet (the request waits for a
    replica) ends the front's call too, with nothing sent."""
    cancelled: list[bool] = []

    async def never(request: httpx.Request) -> httpx.Response:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        raise AssertionError

    front = Front("http://127.0.0.1:1", 5.0,
                  httpx.AsyncClient(transport=httpx.MockTransport(never)))
    scope = {"type": "http", "method": "GET", "path": "/health", "raw_path": b"/health",
             "query_string": b"", "headers": []}
    inbox = [{"type": "http.request", "body": b""}, {"type": "http.disconnect"}]
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.1)
        return inbox.pop(0)

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(front(scope, receive, send), 10))
    assert sent == [] and cancelled == [True]


# ----------------------------------------------------------------------------- one server's guards
def _call_app(app: Any, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """One request with ``body`` (announced by Content-Length) through the ASGI ``app``:
    (status, JSON body)."""
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": [(b"content-length", str(len(body)).encode())]}
    messages: list[dict[str, Any]] = []
    inbox = [{"type": "http.request", "body": body}]

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    return messages[0]["status"], json.loads(b"".join(m.get("body", b"") for m in messages[1:]))


def test_a_body_over_the_limit_is_refused_and_not_sent_on() -> None:
    """The front applies one server's ``--max-request-body-size``: a larger body is a 413 in
    the API's shape, and nothing goes to the proxy (the front would otherwise hold any body in
    memory before a replica refused it); a body within the limit goes on. (Planted: the front
    without ``guarded`` sends the large body on.)"""
    front, sent = _front([(200, b'{"id": "x"}', "application/json")])
    app = front_module.guarded(front, 64)
    status, answer = _call_app(app, "/v1/completions", b"x" * 65)
    assert (status, answer["error"]["code"]) == (413, "request_too_large")
    status, answer = _call_app(app, "/v1/messages", b"x" * 65)
    assert (status, answer["type"], answer["error"]["type"]) == (413, "error",
                                                               "request_too_large")
    assert sent == []
    assert _call_app(app, "/v1/completions", b"x" * 64) == (200, {"id": "x"})
    assert len(sent) == 1


def test_a_client_slower_than_the_read_timeout_is_disconnected() -> None:
    """A real front on 127.0.0.1 with a read timeout of 0.5 s: a client that sends half a
    request line's headers and waits is disconnected, as one server disconnects it
    (``--request-read-timeout``); a slowloris cannot hold the front's connections. (Planted:
    uvicorn's own protocol keeps the connection open and the read below times out.)"""
    import socket

    front = Front("http://127.0.0.1:1", 1.0)
    server = front_module.FrontServer(front, front_module.bind("127.0.0.1", 0), "warning",
                                      access_log=False, shutdown_timeout=1,
                                      max_body_size=1 << 20, read_timeout=0.5)
    server.start()
    try:
        port = server.sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            assert client.recv(1024) == b""  # closed by the front
    finally:
        server.stop()
