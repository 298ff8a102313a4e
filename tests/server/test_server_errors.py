"""An unexpected exception in a route, on a real uvicorn server on 127.0.0.1: a 500 in the API's
error shape, and the keep-alive connection it came on goes on serving."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI
from server_helpers import free_port

from prefixserve.server.errors import install_error_handlers


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RecursionError("maximum recursion depth exceeded")

    @app.get("/ok")
    async def ok() -> dict[str, str]:
        return {"status": "ok"}

    return app


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app(), host="127.0.0.1", port=port,
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_unexpected_error_is_a_500_and_the_connection_serves_on(port: int) -> None:
    """Starlette's own last-resort handler answers the 500 and then raises the exception to
    uvicorn, which closes the connection: the client's next request on it got no answer
    (planted by leaving ``KeepAliveOnError`` out: ``RemoteDisconnected`` here)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for _ in range(2):
        connection.request("GET", "/boom")
        response = connection.getresponse()
        assert response.status == 500
        assert response.getheader("connection") != "close"
        error = json.loads(response.read())["error"]
        assert error["code"] == "internal_error", error
        assert error["message"] == "internal server error: RecursionError", error
        connection.request("GET", "/ok")
        follow_up = connection.getresponse()
        assert (follow_up.status, json.loads(follow_up.read())) == (200, {"status": "ok"})
    connection.close()
