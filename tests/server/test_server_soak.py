"""A bounded soak of one real server: a dozen concurrent streaming clients on shared prefixes,
some hanging up mid-stream, with malformed requests mixed in, for about 10 seconds. Afterwards
nothing answered 5xx, every malformed request got its 4xx in the OpenAI error shape, the server
is healthy and idle with every KV block back in the pool, a greedy request answers exactly as it
did before the soak, and SIGTERM exits 0 with no traceback in the log."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import HTTP, ServerProcess, idle

SEED = 20261130
CLIENTS = 12
SOAK_SECONDS = 10.0
#: Upper bound on the requests of one client, whatever the timing.
MAX_REQUESTS_PER_CLIENT = 200
#: Seconds one request may take before it counts as a hang.
REQUEST_TIMEOUT = 30.0
MAX_MODEL_LEN = 512
BODY_LIMIT = 64 * 1024
SERVER_ARGS = ["--dtype", "float32", "--num-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN),
               "--log-stats-interval", "0", "--max-request-body-size", "64KiB"]
GREEDY = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
WORDS = ("cache", "block", "prefix", "token", "model", "server", "stream", "batch", "queue",
         "answer", "question", "river", "mountain", "garden", "library", "window", "engine")
#: Three long system texts that many requests start with, so their blocks are shared.
PREFIXES = [f"Shared context {i}: " + " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)]
                                              for j in range(60)) for i in range(3)]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ERROR_FIELDS = {"message", "type", "param", "code"}


@dataclass
class Bad:
    """A malformed request: where it goes, what httpx sends, and the status it must get."""

    path: str
    send: dict[str, Any]
    status: int


def _raw(body: bytes) -> dict[str, Any]:
    return {"content": body, "headers": {"Content-Type": "application/json"}}


def _bad_json(rng: random.Random) -> Bad:
    body = json.dumps({"prompt": PREFIXES[0][:80], "max_tokens": 4}).encode()
    return Bad(COMPLETIONS, _raw(body[:rng.randint(1, len(body) - 1)]), 400)


def _wrong_type(rng: random.Random) -> Bad:
    field_, value = rng.choice([("max_tokens", "ten"), ("temperature", "hot"), ("n", 1.5),
                                ("stream", "yes"), ("prompt", {"text": "hi"}), ("stop", 5),
                                ("top_k", [1])])
    return Bad(COMPLETIONS, {"json": {"prompt": "Hello", "max_tokens": 4, field_: value}}, 400)


def _unknown_field(rng: random.Random) -> Bad:
    name = rng.choice(["max_token", "temprature", "prompts", f"field_{rng.randint(0, 999)}"])
    return Bad(COMPLETIONS, {"json": {"prompt": "Hello", name: 1}}, 400)


def _n_too_large(rng: random.Random) -> Bad:
    return Bad(COMPLETIONS, {"json": {"prompt": "Hello", "n": rng.randint(129, 10**6)}}, 400)


def _prompt_too_long(rng: random.Random) -> Bad:
    ids = [rng.randrange(1000, 30000) for _ in range(rng.randint(MAX_MODEL_LEN, 900))]
    return Bad(COMPLETIONS, {"json": {"prompt": ids, "max_tokens": 4}}, 400)


def _unknown_model(rng: random.Random) -> Bad:
    body = {"model": f"gpt-{rng.randint(2, 9)}", "messages": [{"role": "user", "content": "hi"}]}
    return Bad(CHAT, {"json": body}, 404)


def _oversized_body(rng: random.Random) -> Bad:
    text = "x" * (BODY_LIMIT + rng.randint(1, 20000))
    return Bad(COMPLETIONS, {"json": {"prompt": text, "max_tokens": 4}}, 413)


def _unsupported_field(rng: random.Random) -> Bad:
    functions = [{"name": f"f{rng.randint(0, 9)}"}]
    body = {"messages": [{"role": "user", "content": "hi"}], "functions": functions}
    return Bad(CHAT, {"json": body}, 400)


def _bad_messages(rng: random.Random) -> Bad:
    messages = rng.choice([[], [{"role": "wizard", "content": "hi"}], [{"content": "hi"}]])
    return Bad(CHAT, {"json": {"messages": messages}}, 400)


MALFORMED: dict[str, Callable[[random.Random], Bad]] = {
    "bad_json": _bad_json, "wrong_type": _wrong_type, "unknown_field": _unknown_field,
    "n_too_large": _n_too_large, "prompt_too_long": _prompt_too_long,
    "unknown_model": _unknown_model, "oversized_body": _oversized_body,
    "unsupported_field": _unsupported_field, "bad_messages": _bad_messages,
}


@dataclass
class Tally:
    """What the clients saw."""

    statuses: Counter[int] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


def _is_openai_error(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and set(error) == ERROR_FIELDS


async def send_malformed(client: httpx.AsyncClient, kind: str, rng: random.Random,
                         tally: Tally) -> None:
    bad = MALFORMED[kind](rng)
    response = await client.post(bad.path, **bad.send)
    tally.statuses[response.status_code] += 1
    tally.kinds[kind] += 1
    if response.status_code != bad.status or not _is_openai_error(response):
        tally.problems.append(f"{kind}: expected {bad.status}, got {response.status_code} "
                              f"{response.text[:200]!r}")


def valid_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A streamed completion or chat on a shared prefix, with varied sampling."""
    question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
    prefix = rng.choice(PREFIXES)
    body: dict[str, Any] = {"max_tokens": rng.randint(2, 12), "stream": True,
                            "temperature": rng.choice([0, 0.7, 1.0]),
                            "top_k": rng.choice([None, 40, 2**64]), "n": rng.choice([1, 1, 1, 2])}
    if rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return COMPLETIONS, {**body, "prompt": f"{prefix}\nQuestion: {question}"}
    messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
    return CHAT, {**body, "messages": messages}


async def stream(client: httpx.AsyncClient, rng: random.Random, tally: Tally,
                 hang_up_after: int | None) -> None:
    """One streamed request, read to ``data: [DONE]`` or closed after ``hang_up_after``
    events."""
    path, body = valid_request(rng)
    kind = "stream" if hang_up_after is None else "hang_up"
    tally.kinds[kind] += 1
    async with client.stream("POST", path, json=body) as response:
        tally.statuses[response.status_code] += 1
        if response.status_code != 200:
            await response.aread()
            tally.problems.append(f"{kind}: {response.status_code} {response.text[:200]!r}")
            return
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return
            if "error" in json.loads(line.removeprefix("data: ")):  # not a token's text
                tally.problems.append(f"{kind}: error event {line[:200]!r}")
            events += 1
            if hang_up_after is not None and events >= hang_up_after:
                return  # leaving the block closes the connection mid-stream
    if hang_up_after is None:
        tally.problems.append(f"{kind}: the stream ended without data: [DONE]")


async def client_loop(url: str, index: int, deadline: float, tally: Tally) -> None:
    """One client: its first request is a malformed one (each kind is sent at least once),
    then streams, hang-ups and malformed requests at random until the deadline."""
    rng = random.Random(SEED * 1000 + index)
    kinds = list(MALFORMED)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT) as client:
        for count in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() > deadline:
                return
            roll = rng.random()
            try:
                if count == 0 or roll < 0.25:
                    kind = kinds[index % len(kinds)] if count == 0 else rng.choice(kinds)
                    await send_malformed(client, kind, rng, tally)
                else:
                    hang_up = rng.randint(1, 5) if roll < 0.5 else None
                    await stream(client, rng, tally, hang_up)
            except httpx.HTTPError as exc:
                tally.problems.append(f"client {index}: {type(exc).__name__}: {exc}")


async def soak(url: str) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + SOAK_SECONDS
    await asyncio.gather(*(client_loop(url, i, deadline, tally) for i in range(CLIENTS)))
    return tally


def greedy_text(server: ServerProcess) -> str:
    response = HTTP.post(server.url + COMPLETIONS, json=GREEDY, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.slow
def test_soak_with_hang_ups_and_malformed_requests_leaves_the_server_clean(
        tmp_path: Path) -> None:
    server = ServerProcess(SERVER_ARGS, tmp_path / "server.log").start()
    try:
        before = greedy_text(server)
        tally = asyncio.run(soak(server.url))
        print(f"statuses {dict(tally.statuses)}, requests {dict(tally.kinds)}")
        assert not [s for s in tally.statuses if s >= 500], tally.statuses
        assert not tally.problems, "\n".join(tally.problems[:20])
        assert set(MALFORMED) <= set(tally.kinds), tally.kinds
        assert tally.kinds["stream"] + tally.kinds["hang_up"] >= CLIENTS, tally.kinds
        assert tally.kinds["hang_up"] > 0, tally.kinds
        assert HTTP.get(server.url + "/health", timeout=10).status_code == 200
        server.wait_for_metrics(idle)
        assert greedy_text(server) == before
    finally:
        status = server.stop()
    assert status == 0, server.log
    assert "Traceback" not in server.log, server.log
