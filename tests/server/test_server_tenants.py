"""Two tenants (``--api-key``) and an admin key on one server, and inputs of megabytes.

A stored response belongs to the key that created it: another key chaining to it, with
``previous_response_id``, gets exactly the answer of an unknown id, so it can neither read the
conversation nor learn that the id exists. The admin key is no API key: it gets the 401 of
every generation route, whichever id it names, and no route reads, lists or deletes stored
responses. Error messages quote at most a few dozen characters of what the client sent.
Tokenizing and rendering a 5 MiB input takes seconds and runs in a worker thread: meanwhile
another client's stream keeps its pace and ``/health`` answers at once.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import HTTP, ServerProcess, serve_for_module

KEY_A, KEY_B, ADMIN = "tenant-a-key", "tenant-b-key", "admin-key"
BIG = "The quick brown fox jumps over the lazy dog. " * (5 * 2**20 // 45)
"""5 MiB of text: seconds of tokenizing on 2 cores."""

HEALTH_LIMIT_S = 0.5
"""The slowest ``/health`` allowed beside the large input (measured on 2 quiet cores over 7
runs: at most 0.067 s; 0.105-0.16 s while the rest of the suite loads both cores; with the
encoding on the event loop, 1.8-4.6 s)."""
GAP_LIMIT_S = 0.5
"""The longest wait for a chunk of the other stream allowed beside the large input (measured on
quiet cores: at most 0.115 s, when the encoding ends: turning a million ids into a list holds
the GIL for about 0.04 s; with the encoding on the event loop, seconds)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # One torch thread: the model's threads then leave a core to the tokenizing worker and the
    # event loop on 2 cores (with a thread per core, every decode step waits for a core the
    # tokenizer holds, which measures the machine rather than the event loop)
    yield from serve_for_module(
        ["--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN, "--max-num-seqs", "4",
         "--num-threads", "1", "--max-request-body-size", "8MiB", "--log-stats-interval", "0"],
        tmp_path_factory.mktemp("tenants") / "server.log")


def _post(server: ServerProcess, path: str, key: str, body: dict[str, Any],
          timeout: float = 120) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, timeout=timeout,
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


def _request(server: ServerProcess, method: str, path: str, key: str) -> httpx.Response:
    return HTTP.request(method, server.url + path, timeout=30,
                         headers={"Authorization": f"Bearer {key}"})


def _same_as_unknown(theirs: httpx.Response, unknown: httpx.Response, their_id: str,
                     unknown_id: str) -> None:
    assert theirs.status_code == unknown.status_code, (theirs.text, unknown.text)
    assert theirs.text.replace(their_id, unknown_id) == unknown.text
    assert theirs.headers.get("www-authenticate") == unknown.headers.get("www-authenticate")


def test_no_other_key_reads_or_learns_of_a_stored_response(server: ServerProcess) -> None:
    """B and the admin key get, for every way of naming A's response (chaining, reading,
    deleting, its input items), the answer an unknown id gets; A's response is still there
    afterwards. (Planted: a store that ignores the owner answers B's chaining with 200.)"""
    a_id = _respond(server, KEY_A, "The vault code is 7391-ZEBRA.").json()["id"]
    unknown_id = "resp_" + "f" * (len(a_id) - 5)
    for key in (KEY_B, ADMIN):
        _same_as_unknown(_respond(server, key, "The code?", a_id),
                         _respond(server, key, "The code?", unknown_id), a_id, unknown_id)
        for method, path in (("GET", "/v1/responses/{}"), ("DELETE", "/v1/responses/{}"),
                             ("GET", "/v1/responses/{}/input_items")):
            _same_as_unknown(_request(server, method, path.format(a_id), key),
                             _request(server, method, path.format(unknown_id), key),
                             a_id, unknown_id)
    assert _respond(server, ADMIN, "The code?").status_code == 401  # no API key
    assert _respond(server, KEY_A, "The code?", a_id).status_code == 200


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


def test_an_input_over_the_body_limit_is_a_413_in_each_api_shape(
        server: ServerProcess) -> None:
    """``--max-request-body-size`` refuses before any tokenizing, in OpenAI's shape on
    ``/tokenize`` and in Anthropic's on ``/v1/messages``; the server goes on serving.
    (Planted: the limit's 413 in OpenAI's shape on every path.)"""
    text = "x" * (9 << 20)
    openai_413 = _post(server, "/tokenize", KEY_A, {"prompt": text})
    assert openai_413.status_code == 413
    assert openai_413.json()["error"]["code"] == "request_too_large"
    anthropic_413 = _post(server, "/v1/messages/count_tokens", KEY_A, {
        "model": "m", "messages": [{"role": "user", "content": text}]})
    assert anthropic_413.status_code == 413
    assert anthropic_413.json()["type"] == "error"
    assert anthropic_413.json()["error"]["type"] == "request_too_large"
    assert "--max-request-body-size" in anthropic_413.json()["error"]["message"]
    assert _post(server, "/tokenize", KEY_A, {"prompt": "Hi."}).status_code == 200


class _Stream:
    """A streamed completion in a thread, until ``stop`` is set: when its chunks came."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with HTTP.stream("POST", self.server.url + "/v1/completions", json=body, timeout=300,
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
    chunk and ``/health`` answers at once. (Planted: encoding on the event loop stalls both
    for the 2-4 s it takes.)"""
    if "model" in body:
        body = {**body, "model": HTTP.get(server.url + "/v1/models", timeout=30, headers={
            "Authorization": f"Bearer {KEY_A}"}).json()["data"][0]["id"]}
    stream = _Stream(server)
    stream.thread.start()
    while len(stream.times) < 5:  # the stream is under way
        time.sleep(0.01)
    result: dict[str, Any] = {}
    big = threading.Thread(target=lambda: result.update(response=_post(
        server, path, KEY_A, body, timeout=300)))
    gc.disable()  # this process's own collections would count as the server's stalls
    try:
        start = time.monotonic()
        big.start()
        health = _health_while(server, big)
        big.join()
        end = time.monotonic()
    finally:
        gc.enable()
    stream.stop.set()
    stream.thread.join()
    assert result["response"].status_code in (200, 400), result["response"].text[:500]
    gap = stream.largest_gap(start, end)
    print(f"{path}: {end - start:.2f} s, /health at most {max(health, default=0):.3f} s "
          f"({len(health)} probes), the stream's largest gap {gap:.3f} s")  # pytest -s shows it
    assert health and max(health) < HEALTH_LIMIT_S, health
    assert gap < GAP_LIMIT_S
    assert len(health) >= 10, "the large request ended before it could be observed"


def _health_while(server: ServerProcess, big: threading.Thread) -> list[float]:
    """How long each ``/health`` took, asked every 20 ms until ``big`` ends, from 0.3 s on
    (when its body is sent and being tokenized), over one connection kept open as a load
    balancer's health check does (a new connection's cost is not the server's)."""
    health: list[float] = []
    with httpx.Client(base_url=server.url, timeout=30) as probe:
        assert probe.get("/health").status_code == 200
        time.sleep(0.3)
        while big.is_alive():
            before = time.monotonic()
            assert probe.get("/health").status_code == 200
            health.append(time.monotonic() - before)
            time.sleep(0.02)
    return health
