"""Connection-level protections of a real server (``prefixserve.server.transport``): slow
clients are dropped after ``--request-read-timeout`` while others are served, oversized bodies
get a 413 JSON error, a trailing slash routes like the route, and SIGTERM drains gracefully,
ends a stream still running at ``--shutdown-timeout`` with an error event, and exits 0."""

from __future__ import annotations

import json
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import HTTP, ServerProcess, serve_all

READ_TIMEOUT = 1.0
BODY_LIMIT = 1024
#: How long after READ_TIMEOUT a slow connection may still be open (a loaded machine).
CLOSE_MARGIN = 4.0
SLOW_CLIENTS = 50


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Two servers started side by side: ``main`` for the tests, ``idle`` to be stopped idle."""
    directory = tmp_path_factory.mktemp("transport")
    options = ["--shutdown-timeout", "1", "--log-stats-interval", "0"]
    processes = {
        "main": ServerProcess([*options, "--request-read-timeout", str(READ_TIMEOUT),
                               "--max-request-body-size", "1KiB"], directory / "main.log"),
        "idle": ServerProcess(options, directory / "idle.log"),
    }
    yield from serve_all(processes)
    for process in processes.values():
        assert "Traceback" not in process.log, process.log


@pytest.fixture(scope="module")
def server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["main"]


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "The capital of France is", "max_tokens": 2, **fields}


def padded(size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes."""
    body = json.dumps(completion()).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


# ---------------------------------------------------------------------- slow clients
class SlowClient:
    """A raw connection that sends the start of a request, then one more byte a tick, never
    completing it: ``kind`` is ``headers`` (a header line), ``body`` (a Content-Length body)
    or ``keep-alive`` (a header line, after a first request answered on the connection)."""

    def __init__(self, port: int, kind: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if kind == "keep-alive":
            self.sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            self._read_response()
        self.started = time.monotonic()
        self.closed_after: float | None = None
        if kind == "body":
            self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                              b"application/json\r\nContent-Length: 1000\r\n\r\n{")
        else:
            self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        self.sock.setblocking(False)

    def _read_response(self) -> None:
        data = b""
        while b'"ok"}' not in data:
            chunk = self.sock.recv(4096)
            assert chunk, f"closed before the first response: {data!r}"
            data += chunk

    def tick(self) -> bool:
        """Sends one more byte unless the server closed the connection; True once closed."""
        if self.closed_after is None and (self._peer_closed() or not self._send(b" ")):
            self.closed_after = time.monotonic() - self.started
        return self.closed_after is not None

    def _peer_closed(self) -> bool:
        if not select.select([self.sock], [], [], 0)[0]:
            return False
        try:
            data = self.sock.recv(4096)
        except OSError:
            return True
        assert not data, f"unexpected answer: {data!r}"
        return True

    def _send(self, data: bytes) -> bool:
        try:
            self.sock.send(data)
        except OSError:
            return False
        return True


def test_slow_clients_are_dropped_after_the_read_timeout_and_others_are_served(
        server: ServerProcess) -> None:
    kinds = ("headers", "body", "keep-alive")
    clients = [SlowClient(server.port, kinds[i % len(kinds)]) for i in range(SLOW_CLIENTS)]
    try:
        response = HTTP.get(server.url + "/v1/models", timeout=30)
        assert response.status_code == 200, response.text
        served_after = time.monotonic() - clients[-1].started
        deadline = time.monotonic() + READ_TIMEOUT + CLOSE_MARGIN
        while not all([client.tick() for client in clients]) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for client in clients:
            client.sock.close()
    assert served_after < READ_TIMEOUT  # answered while every slow client was connected
    open_ = [kinds[i % len(kinds)] for i, c in enumerate(clients) if c.closed_after is None]
    assert not open_, f"{len(open_)} slow connections still open: {open_}"
    closed_after = sorted(client.closed_after or 0.0 for client in clients)
    assert closed_after[0] > READ_TIMEOUT / 2, closed_after  # dropped by the timeout


# ---------------------------------------------------------------------- body size limit
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_a_413_json_error(server: ServerProcess,
                                                     chunked: bool) -> None:
    def post(body: bytes) -> httpx.Response:
        content: bytes | Iterator[bytes] = body
        if chunked:
            content = iter([body[:500], body[500:]])
        return HTTP.post(server.url + "/v1/completions", content=content, timeout=30,
                          headers={"Content-Type": "application/json"})

    at_limit = post(padded(BODY_LIMIT))
    assert at_limit.status_code == 200, at_limit.text
    too_large = post(padded(BODY_LIMIT + 1))
    assert ("transfer-encoding" in too_large.request.headers) is chunked
    error = assert_openai_error(too_large, 413, "request_too_large")
    assert f"limit of {BODY_LIMIT} bytes" in error["message"]


# ---------------------------------------------------------------------- trailing slash
@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/completions/", completion()),
    ("POST", "/v1/chat/completions/", {"messages": [{"role": "user", "content": "Hi"}],
                                       "max_tokens": 2}),
    ("GET", "/v1/models/", None),
])
def test_a_trailing_slash_routes_like_the_route(server: ServerProcess, method: str, path: str,
                                                body: dict[str, Any] | None) -> None:
    response = HTTP.request(method, server.url + path, json=body, timeout=30,
                             follow_redirects=False)
    assert response.status_code == 200, (response.status_code, response.text)


# ---------------------------------------------------------------------- shutdown
def test_sigterm_on_an_idle_server_exits_0(servers: dict[str, ServerProcess]) -> None:
    idle = servers["idle"]
    assert idle.stop() == 0, idle.log
    assert "Application shutdown complete" in idle.log


def test_sigterm_ends_requests_still_running_at_the_shutdown_timeout(
        server: ServerProcess) -> None:
    """Runs last: the server stops. A stream running at ``--shutdown-timeout`` gets an error
    event and ``[DONE]``; a plain request a 503; and the process exits 0."""
    long = completion(max_tokens=4000, ignore_eos=True)
    plain: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: plain.setdefault("response", HTTP.post(
        server.url + "/v1/completions", json=long, timeout=60)))
    with HTTP.stream("POST", server.url + "/v1/completions", json={**long, "stream": True},
                      timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        thread.start()
        server.wait_for_metrics(lambda s: s["prefixserve:num_requests_running"] == 2)
        server.process.send_signal(signal.SIGTERM)
        events = [line for line in lines if line.startswith("data:")]
    thread.join(60)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_unavailable"
    assert "the server is shutting down" in error["message"]
    cut = assert_openai_error(plain["response"], 503, "engine_unavailable")
    assert "the server is shutting down" in cut["message"]
    assert server.process.wait(60) == 0, server.log
