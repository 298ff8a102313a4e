"""Hostile clients against real ``prefixserve serve`` processes on 127.0.0.1.

Part A, malformed and hostile requests: one server with two tenant keys and an admin key, a
2 s ``--request-read-timeout``, a 1 MiB ``--max-request-body-size`` and
``--no-enable-chunked-prefill``, gets a seeded corpus of bad requests of many kinds (malformed
JSON, wrong types, out-of-range values, unknown and unsupported fields, per-request limits,
prompts too long or never schedulable, oversized bodies, unknown models, missing, wrong and
underprivileged keys, wrong methods and routes) sent 16 at a time, with valid requests mixed
in as a control, while slowloris connections trickle partial requests. It prints the counts by
status code and by kind, the 5xx answers, the hangs (no answer within 60 s), the answers that
are not in the OpenAI error shape or not the expected status, how many slowloris connections
the server closed within the read timeout plus a margin, and whether the server is idle
afterwards with every KV block back in the pool.

Part B, the prefix-cache timing side channel: tenant A sends a fresh secret 512-token prompt
(random token ids) or not (a coin flip); tenant B then sends the same prompt with
``max_tokens`` 1 and times its first token, guessing "A sent it" below a threshold calibrated
on a few labelled trials (the geometric mean of their median times with and without A). It
runs on a default server (keys isolate the cache) and on one with ``--share-cache-across-keys``,
and prints B's mean times, the cached tokens B was told of, and B's guessing accuracy for both.

Usage (about 5 minutes on 2 cores; ``--quick`` about 2)::

    .venv/bin/python benchmarks/hostile_clients.py [--quick] [--dtype float32] [--seed N]

The servers run in the default dtype, bfloat16, unless ``--dtype`` says otherwise: on a CPU
without native bfloat16 arithmetic (AVX2 only) a bfloat16 prefill is an order of magnitude
slower than a float32 one, and part B's 512-token prefills then need ``--dtype float32`` to fit
in minutes (the side channel is the same: it is the cache hit that is timed).

The exit status is 1 if anything went wrong: a 5xx, a hang, an unexpected status or error
shape, a slowloris connection left open, a server not idle afterwards or not exiting 0, a
traceback in a server log, a cache hit across isolated tenants, or a side channel that does
not behave as expected (B guessing well when isolated, badly when shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
KEY_A, KEY_B, ADMIN_KEY = "tenant-a-key", "tenant-b-key", "admin-key"
READ_TIMEOUT = 2.0
#: Seconds past the read timeout a slow connection may stay open (a loaded machine).
CLOSE_MARGIN = 3.0
BODY_LIMIT = 1 << 20
#: A request not answered in this many seconds is a hang.
REQUEST_TIMEOUT = 60.0
CONCURRENCY = 16
STARTUP_TIMEOUT = 300.0
#: A prompt longer than the default ``--max-num-batched-tokens`` (2048): never schedulable
#: without chunked prefill.
UNSCHEDULABLE_LEN = 2100
SECRET_LEN = 512
#: Token ids secrets are drawn from (ordinary tokens of the default model's vocabulary).
SECRET_TOKENS = (1000, 40000)
HOSTILE_ARGS = ["--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN_KEY,
                "--request-read-timeout", str(READ_TIMEOUT), "--max-request-body-size", "1MiB",
                "--no-enable-chunked-prefill"]
TENANT_ARGS = ["--api-key", KEY_A, "--api-key", KEY_B]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ERROR_FIELDS = {"message", "type", "param", "code"}


# ====================================================================== servers
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """``python -m prefixserve serve ARGS`` on a free port, its output in ``log_path``."""

    def __init__(self, args: Sequence[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [sys.executable, "-m", "prefixserve", "serve", "--host", "127.0.0.1",
                        "--port", str(self.port), "--disable-access-log",
                        "--log-stats-interval", "0", *args]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self) -> Server:
        print("$ " + " ".join(self.command[self.command.index(sys.executable) + 1:]),
              flush=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=REPO)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not come up:\n{self.log[-3000:]}")

    def stop(self) -> int:
        """SIGTERM, then the exit status (-9 after SIGKILL if it does not exit in 60 s)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def gauges(self) -> dict[str, float]:
        """The samples of ``/metrics`` that carry no label but ``model_name``, by name."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {sample.name: sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples if set(sample.labels) <= {"model_name"}}

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Polls ``/metrics`` until nothing runs or waits and every block is free; returns the
        last gauges either way."""
        deadline = time.monotonic() + timeout
        while True:
            gauges = self.gauges()
            if is_idle(gauges) or time.monotonic() > deadline:
                return gauges
            time.sleep(0.2)


def gauge(gauges: dict[str, float], name: str) -> float:
    """A gauge whatever its prefix (``prefixserve:`` or ``vllm:``)."""
    return next(value for key, value in gauges.items() if key.split(":")[-1] == name)


def is_idle(gauges: dict[str, float]) -> bool:
    return (gauge(gauges, "num_requests_running") == 0
            and gauge(gauges, "num_requests_waiting") == 0
            and leaked_blocks(gauges) == 0)


def leaked_blocks(gauges: dict[str, float]) -> int:
    return int(gauge(gauges, "kv_cache_num_blocks") - gauge(gauges, "kv_cache_num_free_blocks"))


# ====================================================================== the corpus
@dataclass
class Case:
    """One request of the corpus and the status it must get."""

    kind: str
    path: str
    send: dict[str, Any]
    status: int
    key: str | None = KEY_A
    method: str = "POST"


def raw(body: bytes, content_type: str = "application/json") -> dict[str, Any]:
    return {"content": body, "headers": {"Content-Type": content_type}}


def small_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega")) for _ in range(6))


def chat_body(rng: random.Random, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": small_prompt(rng)}], "max_tokens": 2,
            **extra}


def completion_body(rng: random.Random, **extra: Any) -> dict[str, Any]:
    return {"prompt": small_prompt(rng), "max_tokens": 2, **extra}


def malformed_json(rng: random.Random) -> Case:
    valid = json.dumps(completion_body(rng)).encode()
    body = rng.choice([
        valid[:rng.randint(1, len(valid) - 1)], valid + b"}", valid + b"trailing",
        valid.replace(b'"', b"'"), b'{"prompt": "\xff\xfe", "max_tokens": 2}',
        b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "top_p": Infinity}',
        b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}", b"", b"null", b"[]", b"42",
        b'"prompt"', bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))])
    return Case("malformed JSON", COMPLETIONS, raw(body), 400)


def wrong_content_type(rng: random.Random) -> Case:
    body = json.dumps(completion_body(rng)).encode()
    kind = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
    return Case("not JSON content type", COMPLETIONS, raw(body, kind), 400)


_WRONG_TYPES = [("max_tokens", "ten"), ("max_tokens", 2.5), ("max_tokens", True),
                ("temperature", "hot"), ("n", "2"), ("stream", "yes"), ("stream", 1),
                ("prompt", {"text": "hi"}), ("prompt", 5), ("prompt", [1, "a"]), ("stop", 5),
                ("top_k", [1]), ("seed", "7"), ("logprobs", 1.5), ("echo", "true"),
                ("stream_options", "usage"), ("model", 3), ("cache_salt", 9),
                ("stop_token_ids", "2"), ("ignore_eos", 0), ("metadata", "m")]


def wrong_type(rng: random.Random) -> Case:
    name, value = rng.choice(_WRONG_TYPES)
    return Case("wrong type", COMPLETIONS, {"json": completion_body(rng, **{name: value})}, 400)


_OUT_OF_RANGE = [("temperature", 3), ("temperature", -1), ("top_p", 0), ("top_p", 1.5),
                 ("n", 0), ("n", -3), ("logprobs", 21), ("seed", 2**64), ("max_tokens", 0),
                 ("max_tokens", -5), ("presence_penalty", 3), ("frequency_penalty", -2.5),
                 ("min_p", 2), ("repetition_penalty", 0), ("stop", ["s"] * 17), ("stop", ""),
                 ("cache_salt", ""), ("top_k", -2), ("min_tokens", -1), ("max_tokens", 10**30),
                 ("stream_options", {"include_usage": True})]


def out_of_range(rng: random.Random) -> Case:
    name, value = rng.choice(_OUT_OF_RANGE)
    return Case("value out of range", COMPLETIONS,
                {"json": completion_body(rng, **{name: value})}, 400)


def unknown_field(rng: random.Random) -> Case:
    name = rng.choice(["max_token", "temprature", "prompts", "topk", "stream_option",
                       f"x_{rng.randrange(10**6)}"])
    body = rng.choice([completion_body(rng), chat_body(rng)])
    return Case("unknown field", CHAT if "messages" in body else COMPLETIONS,
                {"json": {**body, name: 1}}, 400)


_UNSUPPORTED = [("tools", [{"type": "function", "function": {"name": "f"}}]),
                ("tool_choice", "required"), ("functions", [{"name": "f"}]),
                ("function_call", {"name": "f"}), ("response_format", {"type": "json_object"}),
                ("logit_bias", {"50": 5}), ("modalities", ["audio"])]


def unsupported_field(rng: random.Random) -> Case:
    name, value = rng.choice(_UNSUPPORTED + [("suffix", "x"), ("best_of", 3)])
    if name in ("suffix", "best_of"):
        return Case("unsupported field", COMPLETIONS,
                    {"json": completion_body(rng, **{name: value})}, 400)
    return Case("unsupported field", CHAT, {"json": chat_body(rng, **{name: value})}, 400)


def bad_chat(rng: random.Random) -> Case:
    messages = rng.choice([
        [], [{"role": "wizard", "content": "hi"}], [{"content": "hi"}], [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": "hi", "tool_calls": []}], "hi"])
    body = {"messages": messages}
    if rng.random() < 0.2:
        body = chat_body(rng, chat_template_kwargs={"messages": []})
    return Case("bad chat messages", CHAT, {"json": body}, 400)


def too_many_prompts(rng: random.Random) -> Case:
    prompts = ["hi"] * rng.randint(257, 600)
    return Case("too many prompts", COMPLETIONS, {"json": {"prompt": prompts}}, 400)


def n_too_large(rng: random.Random) -> Case:
    return Case("n too large", COMPLETIONS,
                {"json": completion_body(rng, n=rng.choice([129, 1000, 10**9]))}, 400)


def too_many_sequences(rng: random.Random) -> Case:
    prompts, n = rng.choice([(3, 100), (3, 86), (64, 5), (16, 17)])
    return Case("too many sequences", COMPLETIONS,
                {"json": {"prompt": ["hi"] * prompts, "n": n, "max_tokens": 2}}, 400)


def prompts_200_n_128(rng: random.Random) -> Case:
    prompts = [small_prompt(rng) for _ in range(200)]
    return Case("200 prompts x n=128", COMPLETIONS,
                {"json": {"prompt": prompts, "n": 128, "max_tokens": 2}}, 400)


def random_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*SECRET_TOKENS) for _ in range(count)]


def make_too_long(context: int) -> Callable[[random.Random], Case]:
    def too_long(rng: random.Random) -> Case:
        if rng.random() < 0.5:
            body = {"prompt": random_ids(rng, context + rng.randint(0, 500)), "max_tokens": 1}
        else:
            body = {"prompt": random_ids(rng, 100), "max_tokens": context}
        return Case("prompt too long", COMPLETIONS, {"json": body}, 400)

    return too_long


def unschedulable(rng: random.Random) -> Case:
    body = {"prompt": random_ids(rng, UNSCHEDULABLE_LEN), "max_tokens": 1}
    return Case("never schedulable (no chunked prefill)", COMPLETIONS, {"json": body}, 400)


def bad_token_ids(rng: random.Random) -> Case:
    ids = random_ids(rng, 8)
    ids[rng.randrange(8)] = rng.choice([-1, 49152, 10**6, 2**63, 2**70])
    prompt = rng.choice([ids, [ids]])
    return Case("token ids outside the vocabulary", COMPLETIONS,
                {"json": {"prompt": prompt, "max_tokens": 2}}, 400)


def oversized_body(rng: random.Random) -> Case:
    body = json.dumps(completion_body(rng, user="u" * (BODY_LIMIT + rng.randint(1, 50000))))
    if rng.random() < 0.5:
        return Case("oversized body (Content-Length)", COMPLETIONS, raw(body.encode()), 413)
    data = body.encode()
    chunks = [data[i:i + 65536] for i in range(0, len(data), 65536)]
    return Case("oversized body (chunked)", COMPLETIONS,
                {"content": chunks, "headers": {"Content-Type": "application/json"}}, 413)


def unknown_model(rng: random.Random) -> Case:
    name = rng.choice(["gpt-4o", "SmolLM2", "../../etc/passwd", "x" * 300, ""])
    body = rng.choice([completion_body(rng, model=name), chat_body(rng, model=name)])
    path = CHAT if "messages" in body else COMPLETIONS
    return Case("unknown model", path, {"json": body}, 404)


def bad_key(rng: random.Random) -> Case:
    header = rng.choice([None, "Bearer wrong-key", "Bearer", "Basic dXNlcjpwYXNz", KEY_A,
                         f"Bearer {KEY_A}x", f"Bearer {ADMIN_KEY[:-1]}", f"Token {KEY_A}"])
    send: dict[str, Any] = {"json": completion_body(rng)}
    if header is not None:
        send["headers"] = {"Authorization": header}
    path = rng.choice([COMPLETIONS, CHAT, "/v1/models"])
    method = "GET" if path == "/v1/models" else "POST"
    return Case("missing or wrong key", path, send, 401, key=None, method=method)


def tenant_resets_cache(rng: random.Random) -> Case:
    return Case("tenant key on /reset_prefix_cache", "/reset_prefix_cache", {}, 403,
                key=rng.choice([KEY_A, KEY_B]))


def wrong_route(rng: random.Random) -> Case:
    method, path, status = rng.choice([
        ("GET", COMPLETIONS, 405), ("PUT", CHAT, 405), ("DELETE", "/v1/models", 405),
        ("GET", "/v1/embeddings", 404), ("POST", "/v1/completion", 404),
        ("GET", "/%2e%2e/%2e%2e/etc/passwd", 404), ("GET", "/v1/" + "a" * 5000, 404)])
    return Case("wrong method or route", path, {}, status, method=method)


def control(rng: random.Random) -> Case:
    body = rng.choice([completion_body(rng, top_k=2**64), chat_body(rng, stream=True),
                       completion_body(rng, n=2, stop_token_ids=[10**30])])
    return Case("valid (control)", CHAT if "messages" in body else COMPLETIONS,
                {"json": body}, 200, key=rng.choice([KEY_A, KEY_B]))


def admin_reset(rng: random.Random) -> Case:
    return Case("valid (control)", "/reset_prefix_cache", {}, 200, key=ADMIN_KEY)


def corpus(rng: random.Random, scale: float, context: int) -> list[Case]:
    """The seeded corpus: each kind's count times ``scale``, shuffled."""
    counts: list[tuple[Callable[[random.Random], Case], int]] = [
        (malformed_json, 60), (wrong_content_type, 10), (wrong_type, 60), (out_of_range, 50),
        (unknown_field, 25), (unsupported_field, 25), (bad_chat, 25), (too_many_prompts, 10),
        (n_too_large, 10), (too_many_sequences, 10), (prompts_200_n_128, 3),
        (make_too_long(context), 12), (unschedulable, 3), (bad_token_ids, 15),
        (oversized_body, 12), (unknown_model, 15), (bad_key, 30), (tenant_resets_cache, 10),
        (wrong_route, 15), (control, 20), (admin_reset, 2)]
    cases = [make(rng) for make, count in counts for _ in range(max(1, round(count * scale)))]
    rng.shuffle(cases)
    return cases


# ====================================================================== sending it
@dataclass
class Outcome:
    case: Case
    status: int | None  # None: no answer in time (a hang) or the connection failed
    seconds: float
    problem: str | None = None


def check(case: Case, response: httpx.Response) -> str | None:
    """What is wrong with an answer: not the expected status, or an error not in the OpenAI
    shape."""
    if response.status_code != case.status:
        return f"expected {case.status}, got {response.status_code}: {response.text[:300]!r}"
    if case.status < 400:
        return None
    try:
        error = response.json()["error"]
        if isinstance(error, dict) and set(error) == ERROR_FIELDS:
            return None
    except (ValueError, KeyError, TypeError):
        pass
    return f"not an OpenAI error: {response.text[:300]!r}"


async def send(client: httpx.AsyncClient, case: Case) -> Outcome:
    headers = dict(case.send.get("headers", {}))
    if case.key is not None:
        headers["Authorization"] = f"Bearer {case.key}"
    content = case.send.get("content")
    if isinstance(content, list):
        content = _chunked(content)
    started = time.monotonic()
    try:
        response = await client.request(case.method, case.path, json=case.send.get("json"),
                                        content=content, headers=headers)
    except httpx.TimeoutException:
        return Outcome(case, None, time.monotonic() - started, "hang: no answer in time")
    except httpx.HTTPError as exc:
        return Outcome(case, None, time.monotonic() - started, f"{type(exc).__name__}: {exc}")
    return Outcome(case, response.status_code, time.monotonic() - started,
                   check(case, response))


async def _chunked(chunks: list[bytes]) -> Any:
    for chunk in chunks:
        yield chunk


async def send_all(url: str, cases: list[Case]) -> list[Outcome]:
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT) as client:
        async def one(case: Case) -> Outcome:
            async with limit:
                return await send(client, case)

        return list(await asyncio.gather(*(one(case) for case in cases)))


# ====================================================================== slowloris
async def slowloris(port: int, kind: str) -> float | None:
    """A connection that trickles an incomplete request (``headers``: a header line;
    ``body``: a body shorter than its Content-Length; ``silent``: nothing at all) one byte
    every half second; the seconds until the server closed it, or None if still open at the
    read timeout plus the margin."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    if kind == "headers":
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    elif kind == "body":
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100000\r\n\r\n{")
    try:
        while time.monotonic() - started < READ_TIMEOUT + CLOSE_MARGIN:
            try:
                if not await asyncio.wait_for(reader.read(4096), 0.5):
                    return time.monotonic() - started
            except TimeoutError:
                if kind != "silent":
                    writer.write(b"a")
                    await writer.drain()
    except ConnectionError:
        return time.monotonic() - started
    finally:
        writer.close()
    return None


# ====================================================================== part A
def show_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def report_corpus(outcomes: list[Outcome]) -> int:
    """Prints the tables; returns the number of problems."""
    by_status = Counter(str(o.status) if o.status is not None else "no answer"
                        for o in outcomes)
    show_table("Answers by status", ["status", "requests"], sorted(by_status.items()))
    kinds: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        kinds[outcome.case.kind].append(outcome)
    rows = [(kind, len(items), _statuses(items), f"{max(o.seconds for o in items):.2f}",
             sum(o.problem is not None for o in items)) for kind, items in kinds.items()]
    show_table("By kind", ["kind", "requests", "statuses", "slowest (s)", "problems"],
               sorted(rows))
    problems = [o for o in outcomes if o.problem is not None]
    for outcome in problems[:30]:
        case = outcome.case
        body = json.dumps(case.send.get("json"))[:200] if "json" in case.send else "(raw)"
        print(f"PROBLEM {case.kind}: {case.method} {case.path} {body}: {outcome.problem}")
    return len(problems)


def _statuses(items: list[Outcome]) -> str:
    counts = Counter(o.status for o in items)
    return ", ".join(f"{status}: {count}" for status, count in sorted(
        counts.items(), key=lambda item: item[0] or 0))


async def attack(server: Server, cases: list[Case], slow: int) -> tuple[list[Outcome],
                                                                        list[float | None]]:
    kinds = ("headers", "body", "silent")
    slow_tasks = [asyncio.create_task(slowloris(server.port, kinds[i % 3])) for i in range(slow)]
    outcomes = await send_all(server.url, cases)
    return outcomes, list(await asyncio.gather(*slow_tasks))


def part_a(args: argparse.Namespace, out: Path) -> int:
    print("\n## Part A: malformed and hostile requests", flush=True)
    server = Server([*HOSTILE_ARGS, "--dtype", args.dtype], out / "hostile.log").start()
    problems = 0
    try:
        context = httpx.get(server.url + "/v1/models", timeout=10,
                            headers={"Authorization": f"Bearer {KEY_A}"}
                            ).json()["data"][0]["max_model_len"]
        cases = corpus(random.Random(args.seed), 0.3 if args.quick else 1.0, context)
        started = time.monotonic()
        outcomes, closed = asyncio.run(attack(server, cases, 4 if args.quick else 12))
        print(f"\n{len(cases)} requests in {time.monotonic() - started:.1f} s "
              f"({CONCURRENCY} at a time), context {context} tokens")
        problems += report_corpus(outcomes)
        problems += report_health(server, outcomes, closed)
    finally:
        problems += report_exit(server)
    return problems


def report_health(server: Server, outcomes: list[Outcome], closed: list[float | None]) -> int:
    server_errors = sum(o.status is not None and o.status >= 500 for o in outcomes)
    hangs = sum(o.status is None for o in outcomes)
    shut = [seconds for seconds in closed if seconds is not None]
    print(f"\n5xx answers: {server_errors}; hangs or failed connections: {hangs}")
    print(f"slowloris: {len(shut)}/{len(closed)} connections closed by the server within "
          f"{READ_TIMEOUT:g} s + {CLOSE_MARGIN:g} s" + (
              f" (after {min(shut):.1f}-{max(shut):.1f} s)" if shut else ""))
    health = httpx.get(server.url + "/health", timeout=10).status_code
    gauges = server.wait_idle()
    print(f"afterwards: /health {health}, running {gauge(gauges, 'num_requests_running'):g}, "
          f"waiting {gauge(gauges, 'num_requests_waiting'):g}, free blocks "
          f"{gauge(gauges, 'kv_cache_num_free_blocks'):g} of "
          f"{gauge(gauges, 'kv_cache_num_blocks'):g} (leaked: {leaked_blocks(gauges)})")
    return (server_errors + hangs + (len(closed) - len(shut)) + (health != 200)
            + (not is_idle(gauges)))


def report_exit(server: Server) -> int:
    status = server.stop()
    traceback = "Traceback" in server.log
    print(f"server exit status {status}; traceback in its log: {'yes' if traceback else 'no'} "
          f"({server.log_path})")
    return (status != 0) + traceback


# ====================================================================== part B
@dataclass
class Trial:
    sent: bool
    seconds: float
    cached_tokens: int


@dataclass
class Tenant:
    client: httpx.Client
    key: str

    def ttft(self, prompt: list[int]) -> tuple[float, int]:
        """Seconds to the first token of ``prompt`` (max_tokens 1), and the cached tokens
        the usage reports."""
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        started = time.monotonic()
        first: float | None = None
        cached = 0
        with self.client.stream("POST", COMPLETIONS, json=body, headers={
                "Authorization": f"Bearer {self.key}"}) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event["choices"] and first is None:
                    first = time.monotonic() - started
                if event.get("usage"):
                    cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first is not None, "no token came back"
        return first, cached


def trial(a: Tenant, b: Tenant, rng: random.Random, sent: bool) -> Trial:
    secret = random_ids(rng, SECRET_LEN)
    if sent:
        a.ttft(secret)
    seconds, cached = b.ttft(secret)
    return Trial(sent, seconds, cached)


@dataclass
class Setting:
    name: str
    threshold: float
    trials: list[Trial] = field(default_factory=list)

    def times(self, sent: bool) -> str:
        """B's mean TTFT in milliseconds over the trials where A sent the secret (or not),
        with the range."""
        ms = [t.seconds * 1000 for t in self.trials if t.sent == sent]
        return f"{statistics.fmean(ms):.0f} ({min(ms):.0f}-{max(ms):.0f})" if ms else "-"

    def cached(self, sent: bool) -> float:
        return statistics.fmean(t.cached_tokens for t in self.trials if t.sent == sent)

    @property
    def accuracy(self) -> float:
        right = sum((t.seconds < self.threshold) == t.sent for t in self.trials)
        return right / len(self.trials)


def side_channel(name: str, args: list[str], rng: random.Random, calibration: int,
                 trials: int, out: Path) -> tuple[Setting, int]:
    server = Server(args, out / f"side-channel-{name.split()[0]}.log").start()
    try:
        with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT) as client:
            a, b = Tenant(client, KEY_A), Tenant(client, KEY_B)
            trial(a, b, rng, sent=False)  # warm-up
            known = [trial(a, b, rng, sent=i % 2 == 0) for i in range(2 * calibration)]
            sent = statistics.median(t.seconds for t in known if t.sent)
            unsent = statistics.median(t.seconds for t in known if not t.sent)
            setting = Setting(name, statistics.geometric_mean([sent, unsent]))
            setting.trials = [trial(a, b, rng, sent=rng.random() < 0.5) for _ in range(trials)]
    finally:
        problems = report_exit(server)
    return setting, problems


def part_b(args: argparse.Namespace, out: Path) -> int:
    print("\n## Part B: the prefix-cache timing side channel", flush=True)
    rng = random.Random(args.seed + 1)
    calibration, trials = (2, 12) if args.quick else (4, 40)
    problems = 0
    settings = []
    for name, extra in (("isolated (default)", []),
                        ("shared (--share-cache-across-keys)", ["--share-cache-across-keys"])):
        setting, failed = side_channel(name, [*TENANT_ARGS, "--dtype", args.dtype, *extra],
                                       rng, calibration, trials, out)
        settings.append(setting)
        problems += failed
    rows = [(s.name, len(s.trials), sum(t.sent for t in s.trials),
             s.times(True), s.times(False),
             f"{s.cached(True):.0f} / {s.cached(False):.0f}", f"{s.threshold * 1000:.0f}",
             f"{s.accuracy:.0%}") for s in settings]
    show_table(f"B's TTFT for a {SECRET_LEN}-token secret ({calibration} + {calibration} "
               "labelled calibration trials per setting)",
               ["setting", "trials", "A sent", "mean TTFT, A sent (ms)",
                "mean TTFT, A did not (ms)", "B's cached tokens (sent / not)",
                "threshold (ms)", "B's accuracy"], rows)
    isolated, shared = settings
    leaks = sum(t.cached_tokens > 0 for t in isolated.trials)
    if leaks or isolated.accuracy > 0.75 or shared.accuracy < 0.9:
        print(f"PROBLEM side channel: isolated accuracy {isolated.accuracy:.0%} with {leaks} "
              f"cache hits across tenants, shared accuracy {shared.accuracy:.0%}")
        problems += 1
    return problems


# ====================================================================== main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (about 2 minutes)")
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the servers' dtype (default: the server's default, bfloat16)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/hostile_clients"),
                        help="where the server logs go")
    parser.add_argument("--parts", default="a,b", help="which parts to run (a, b or a,b)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    problems = 0
    if "a" in args.parts:
        problems += part_a(args, args.out)
    if "b" in args.parts:
        problems += part_b(args, args.out)
    print(f"\n{problems} problem(s) in {time.monotonic() - started:.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
