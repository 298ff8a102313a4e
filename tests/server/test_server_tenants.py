"""Two tenants (``--api-key``) on one server, and inputs of megabytes.

A stored response belongs to the key that created it: another key chaining to it, with
``previous_response_id``, gets exactly the answer of an unknown id, so it can neither read the
conversation nor learn that the id exists. Error messages quote at most a few dozen characters
of what the client sent. Tokenizing and rendering a 5 MiB input takes seconds and runs in a
worker thread: meanwhile another client's stream keeps its pace and ``/health`` answers at once.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import ServerProcess, serve_for_module

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
BIG = "The quick brown fox jumps over the lazy dog. " * (5 * 2**20 // 45)
"""5 MiB of text: seconds of tokenizing on 2 cores."""

STALL_LIMIT_S = 0.5
"""The longest wait allowed beside the large input: measured alone on 2 cores, ``/health``
took at most 0.21 s and the stream's largest gap was 0.05 s (one torch thread; RESULTS, "Hostile
clients"); the margin is for the suite's other worker on the same cores."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve_for_module(
        ["--api-key", KEY_A, "--api-key", KEY_B, "--max-num-seqs", "4",
         "--log-stats-interval", "0"], tmp_path_factory.mktemp("tenants") / "server.log")


def _post(server: ServerProcess, path: str, key: str, body: dict[str, Any],
          timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"})


def _respond(server: ServerProcess, key: str, text: str, previous: str | None = None
             ) -> httpx.Response:
    body: dict[str, Any] = {"input": text, "max_output_tokens": 8, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    return _post(server, "/v1/responses", key, body)


def test_another_key_cannot_chain_to_a_stored_response(server: ServerProcess) -> None:
    """B chaining to A's response gets the very answer of an unknown id (the id swapped for
    the unknown one); A chains to its own. (Planted: a store that ignores the owner answers B
    with 200 and A's conversation in its prompt.)"""
    first = _respond(server, KEY_A, "The vault code is 7391-ZEBRA. Remember it.")
    assert first.status_code == 200, first.text
    a_id = first.json()["id"]
    own = _respond(server, KEY_A, "Repeat the vault code.", a_id)
    assert own.status_code == 200, own.text
    assert own.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"]
    unknown_id = "resp_" + "0" * (len(a_id) - 5)
    theirs = _respond(server, KEY_B, "Repeat the vault code.", a_id)
    unknown = _respond(server, KEY_B, "Repeat the vault code.", unknown_id)
    assert theirs.status_code == unknown.status_code == 400
    assert theirs.text.replace(a_id, unknown_id) == unknown.text
    assert theirs.json()["error"]["param"] == "previous_response_id"
    # and B's own chain does not reach A's either
    b_first = _respond(server, KEY_B, "Hello.")
    assert _respond(server, KEY_A, "Again.", b_first.json()["id"]).status_code == 400


def test_an_empty_or_huge_previous_response_id_is_a_short_400(server: ServerProcess) -> None:
    """(Planted: ``""`` taken as no id answers 200; the id quoted whole makes a 100 KB body.)"""
    empty = _respond(server, KEY_A, "Hi.", "")
    assert empty.status_code == 400, empty.text
    assert empty.json()["error"]["param"] == "previous_response_id"
    huge = _respond(server, KEY_A, "Hi.", "x" * 100_000)
    assert huge.status_code == 400
    assert len(huge.content) < 1_000, len(huge.content)
    assert "more characters" in huge.json()["error"]["message"]


def test_tokenize_stops_at_the_context_unless_asked(server: ServerProcess) -> None:
    text = "word " * 20_000
    capped = _post(server, "/tokenize", KEY_A, {"prompt": text}).json()
    assert capped["truncated"] and capped["count"] > capped["max_model_len"]
    assert len(capped["tokens"]) == capped["max_model_len"]
    whole = _post(server, "/tokenize", KEY_A, {"prompt": text, "return_all_tokens": True}).json()
    assert not whole["truncated"] and len(whole["tokens"]) == whole["count"] == capped["count"]
    assert whole["tokens"][:capped["max_model_len"]] == capped["tokens"]


class _Stream:
    """A streamed completion in a thread, until ``stop`` is set: when its chunks came."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self.times = server, []  # type: list[float]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.server.url + "/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {KEY_B}"}) as response:
            for _ in response.iter_lines():
                self.times.append(time.monotonic())
                if self.stop.is_set():
                    return  # the client hangs up: the server aborts the request

    def largest_gap(self, start: float, end: float) -> float:
        inside = [t for t in self.times if start <= t <= end]
        assert len(inside) >= 2, "the stream sent nothing while the large request ran"
        return max(b - a for a, b in itertools.pairwise(inside))


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"prompt": BIG}),
    ("/v1/completions", {"prompt": BIG, "max_tokens": 1}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": BIG}],
                                   "model": None}),
])
def test_a_5_mib_input_stalls_no_other_client(server: ServerProcess, path: str,
                                              body: dict[str, Any]) -> None:
    """While the large input is tokenized, the other client's stream never waits long for a
    chunk and ``/health`` answers at once. (Planted: encoding on the event loop stalled both
    for the 3-4 s it takes.)"""
    if "model" in body:
        body = {**body, "model": httpx.get(server.url + "/v1/models", timeout=30, headers={
            "Authorization": f"Bearer {KEY_A}"}).json()["data"][0]["id"]}
    stream = _Stream(server)
    stream.thread.start()
    while len(stream.times) < 5:  # the stream is under way
        time.sleep(0.01)
    result: dict[str, Any] = {}
    big = threading.Thread(target=lambda: result.update(response=_post(
        server, path, KEY_A, body, timeout=300)))
    start = time.monotonic()
    big.start()
    time.sleep(0.3)  # the body is sent and being tokenized (a new connection's cost is not
    # the server's: the probe below keeps one open, as a load balancer's health check does)
    health = []
    with httpx.Client(base_url=server.url, timeout=30) as probe:  # one connection, kept open
        assert probe.get("/health").status_code == 200
        while big.is_alive() and len(health) < 20:
            before = time.monotonic()
            assert probe.get("/health").status_code == 200
            health.append(time.monotonic() - before)
            time.sleep(0.05)
    big.join()
    end = time.monotonic()
    stream.stop.set()
    stream.thread.join()
    assert len(health) >= 3, "the large request ended before it could be observed"
    assert result["response"].status_code in (200, 400), result["response"].text[:500]
    assert max(health) < STALL_LIMIT_S, health
    assert stream.largest_gap(start, end) < STALL_LIMIT_S
