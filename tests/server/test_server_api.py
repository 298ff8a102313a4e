"""The OpenAI-compatible server as a real process on 127.0.0.1, driven by the official ``openai``
client and by plain HTTP: chat and completions, streamed and not; prefix-cache hits reported in
``usage`` and ``/metrics``; cache salts; 16 concurrent clients; disconnects that free their
blocks; bad input answered with 4xx OpenAI-style errors; ``/reset_prefix_cache``."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_helpers import HTTP, ServerProcess, idle

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024

SYSTEM = ("You are the help desk of a small public library. Answer questions about opening "
          "hours, borrowing rules, fines, the reading room, printing and events for children. "
          "The library opens at nine and closes at seven on weekdays, and closes at one on "
          "Saturdays; it is closed on Sundays. Members may borrow up to ten books for three "
          "weeks and renew them twice unless someone else has reserved them. Keep every answer "
          "short, friendly and precise. ")


def system_prompt() -> str:
    """The long system prompt, after a fresh tag so that no earlier test cached it."""
    return f"[session {uuid.uuid4().hex}] {SYSTEM}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # float32: results do not depend on batch shapes or on the path (cache hit or not). The
    # command itself, not forked (server_helpers.ServerProcess): this file also tests the start
    # of `python -m prefixserve serve` as a user runs it.
    process = ServerProcess(["--dtype", "float32", "--num-blocks", "256", "--block-size",
                             str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
                             "--served-model-name", "smol", "smollm2",
                             "--log-stats-interval", "1"],
                            tmp_path_factory.mktemp("server") / "server.log", fork=False).start()
    yield process
    status = process.stop()
    assert status == 0, process.log  # a graceful stop on SIGTERM
    log = process.log
    assert "Prefix cache hit rate:" in log  # the periodic stats line
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def chat(client: openai.OpenAI, system: str, question: str, **kwargs: object):
    return client.chat.completions.create(
        model="smol", messages=[{"role": "system", "content": system},
                                {"role": "user", "content": question}],
        max_tokens=4, temperature=0, **kwargs)


# ---------------------------------------------------------------------- plain endpoints
def test_models_health_version(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["smol", "smollm2"]
    assert HTTP.get(server.url + "/health").json() == {"status": "ok"}
    assert HTTP.get(server.url + "/version").json()["version"]
    raw = HTTP.get(server.url + "/v1/models").json()
    assert raw["data"][0]["max_model_len"] == MAX_MODEL_LEN
    for card in raw["data"]:  # no server path is revealed
        assert card["root"] == card["id"]
    assert "/" not in json.dumps(raw["data"])


def test_openapi_document_has_no_422_and_describes_the_extras(server: ServerProcess) -> None:
    schema = HTTP.get(server.url + "/openapi.json").json()
    assert "422" not in json.dumps(schema["paths"])
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                 "/version", "/metrics", "/reset_prefix_cache"):
        assert path in schema["paths"]
    components = schema["components"]["schemas"]
    assert "cache_salt" in components["CompletionRequest"]["properties"]
    assert components["CompletionRequest"]["additionalProperties"] is False
    assert "cached_tokens" in components["PromptTokensDetails"]["properties"]
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "503"} <= set(responses)
    assert "text/event-stream" in responses["200"]["content"]


# ---------------------------------------------------------------------- chat and completions
def test_chat_with_the_openai_client(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert response.model == "smol"
    assert response.id.startswith("chatcmpl-")
    usage = response.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    entries = choice.logprobs.content
    assert len(entries) == usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert "".join(e.token for e in entries).startswith(choice.message.content)


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model="smol", messages=messages, max_tokens=10,
                                           temperature=0, extra_body={"cache_salt": "whole"})
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_salt": "streamed"}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0  # its own salt: nothing cached
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_with_the_openai_client(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    response = client.completions.create(model="smol", prompt=prompt, max_tokens=5,
                                         temperature=0, echo=True, logprobs=2)
    choice = response.choices[0]
    assert choice.text.startswith(prompt) and "Paris" in choice.text
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 5
    logprobs = choice.logprobs
    prompt_tokens = response.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt_tokens + 5
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i])
                                    for i in range(len(logprobs.tokens))]
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])


def test_completion_streaming_token_ids_and_batches(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    whole = client.completions.create(model="smol", prompt=prompt, max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model="smol", prompt=prompt, max_tokens=6,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    two = list(client.completions.create(model="smol", prompt=prompt, max_tokens=6, n=2,
                                         temperature=0, stream=True))
    finishes = sorted(c.choices[0].index for c in two if c.choices[0].finish_reason)
    assert finishes == [0, 1]  # each choice finishes once
    for index in (0, 1):
        text = "".join(c.choices[0].text for c in two if c.choices[0].index == index)
        assert text == whole.choices[0].text
    # Two prompts (one as token ids), two sequences each: choices numbered prompt by prompt.
    batch = client.completions.create(
        model="smol", prompt=[[s for s in range(400, 404)], [s for s in range(500, 506)]],
        max_tokens=3, n=2, temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == 10
    assert batch.usage.completion_tokens == 12
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: n copies


def test_sampling_parameters_are_applied(client: openai.OpenAI) -> None:
    prompt = "List the days of the week: Monday,"
    first = client.completions.create(model="smol", prompt=prompt, max_tokens=8, seed=7,
                                      temperature=0.9, top_p=0.9,
                                      extra_body={"top_k": 20, "min_p": 0.05})
    again = client.completions.create(model="smol", prompt=prompt, max_tokens=8, seed=7,
                                      temperature=0.9, top_p=0.9,
                                      extra_body={"top_k": 20, "min_p": 0.05})
    assert first.choices[0].text == again.choices[0].text
    stopped = client.completions.create(model="smol", prompt=prompt, max_tokens=12,
                                        temperature=0, stop=[","])
    assert "," not in stopped.choices[0].text
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == ","
    penalised = client.completions.create(model="smol", prompt=prompt, max_tokens=8,
                                          temperature=0, frequency_penalty=2.0,
                                          presence_penalty=2.0)
    assert penalised.usage.completion_tokens >= 1


# ---------------------------------------------------------------------- prefix caching
def test_same_system_prompt_twice_hits_the_cache_and_the_counters(
        server: ServerProcess, client: openai.OpenAI) -> None:
    system = system_prompt()
    before = server.metrics()
    first = chat(client, system, "When do you open on Saturday?")
    second = chat(client, system, "How many books may I borrow?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK_SIZE == 0
    assert cached >= first.usage.prompt_tokens - 3 * BLOCK_SIZE  # all but the question
    after = server.metrics()
    hits = after["prefixserve:prefix_cache_hit_blocks_total"] - before[
        "prefixserve:prefix_cache_hit_blocks_total"]
    hit_tokens = after["prefixserve:prefix_cache_hits_total"] - before[
        "prefixserve:prefix_cache_hits_total"]
    assert hits == cached // BLOCK_SIZE
    assert hit_tokens == cached
    assert after["prefixserve:prefix_cache_query_blocks_total"] > before[
        "prefixserve:prefix_cache_query_blocks_total"]
    assert after["prefixserve:prefix_cache_queries_total"] > before[
        "prefixserve:prefix_cache_queries_total"]


def test_different_cache_salts_never_share_blocks(client: openai.OpenAI) -> None:
    system = system_prompt()
    salted = chat(client, system, "Is there a fine?", extra_body={"cache_salt": "tenant-a"})
    other = chat(client, system, "Is there a fine?", extra_body={"cache_salt": "tenant-b"})
    unsalted = chat(client, system, "Is there a fine?")
    same = chat(client, system, "Can I print?", extra_body={"cache_salt": "tenant-a"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens > 0


def test_reset_prefix_cache_works_while_requests_run(server: ServerProcess) -> None:
    """Blocks a running request holds stop being findable at once and come back uncached."""
    prompt = system_prompt() + "Count from one to a thousand: 1, 2, 3,"
    started, stop = threading.Event(), threading.Event()

    def cached(text: str) -> int:
        response = HTTP.post(server.url + "/v1/completions", timeout=60,
                              json={"prompt": text, "max_tokens": 1})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def long_stream() -> None:  # runs until told to stop (closing it aborts the request)
        with HTTP.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": 600,
                                "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                started.set()
                if stop.is_set():
                    break

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        assert started.wait(60)
        assert cached(prompt) >= 4 * BLOCK_SIZE  # the running request's blocks are found
        reset = HTTP.post(server.url + "/reset_prefix_cache")
        assert reset.status_code == 200 and reset.json() == {"status": "reset"}
        running = server.metrics()["prefixserve:num_requests_running"]
        after_reset = cached(prompt)
    finally:
        stop.set()
        thread.join(120)
    assert running == 1  # the reset happened under traffic
    assert after_reset == 0  # held blocks are no longer findable
    server.wait_for_metrics(idle)  # every block back in the pool
    cached(prompt)
    assert cached(prompt) >= 4 * BLOCK_SIZE  # caching goes on as before


def test_metrics_export_every_documented_family(server: ServerProcess,
                                                client: openai.OpenAI) -> None:
    chat(client, system_prompt(), "Are you open on Sunday?")
    samples = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "kv_cache_num_blocks", "kv_cache_num_free_blocks", "prefix_cache_hit_rate",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "prefix_cache_query_blocks_total", "prefix_cache_hit_blocks_total",
                 "num_preemptions_total"):
        assert "prefixserve:" + name in samples, name
    for name in ("prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"):
        assert samples["prefixserve:" + name] > 0, name
    assert samples["prefixserve:request_success_total{finished_reason=length}"] > 0
    assert samples["prefixserve:kv_cache_num_blocks"] == 256


# ---------------------------------------------------------------------- load and disconnects
def test_sixteen_concurrent_clients_get_their_own_answers(server: ServerProcess) -> None:
    prompts = [f"Question {i}: what comes after the number {10 * i + 3}? Answer:"
               for i in range(16)]
    base = server.url + "/v1"
    reference = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    batched = reference.completions.create(model="smol", prompt=prompts, max_tokens=6,
                                           temperature=0)
    expected = {c.index: c.text for c in batched.choices}

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0,
                                      timeout=120) as client:
            async def one(prompt: str, stream: bool) -> str:
                if stream:
                    chunks = await client.completions.create(model="smol", prompt=prompt,
                                                             max_tokens=6, temperature=0,
                                                             stream=True)
                    return "".join([c.choices[0].text async for c in chunks])
                response = await client.completions.create(model="smol", prompt=prompt,
                                                           max_tokens=6, temperature=0)
                return response.choices[0].text

            return await asyncio.gather(*(one(p, i % 2 == 0) for i, p in enumerate(prompts)))

    answers = asyncio.run(run_all())
    assert answers == [expected[i] for i in range(16)]
    server.wait_for_metrics(idle)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: ServerProcess) -> None:
    before = server.metrics()
    aborted = "prefixserve:request_success_total{finished_reason=abort}"
    with HTTP.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "Tell me a long story."}],
                            "max_tokens": 400, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events == 4:
                break
    after = server.wait_for_metrics(
        lambda s: idle(s) and s.get(aborted, 0) == before.get(aborted, 0) + 1)
    generated = after["prefixserve:generation_tokens_total"] - before[
        "prefixserve:generation_tokens_total"]
    assert 3 <= generated < 400


def test_disconnect_while_waiting_for_a_whole_response_aborts(server: ServerProcess) -> None:
    before = server.metrics()
    aborted = "prefixserve:request_success_total{finished_reason=abort}"
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(server.url + "/v1/completions", timeout=1.5,
                   json={"prompt": "Write a poem:", "max_tokens": 400, "ignore_eos": True})
    after = server.wait_for_metrics(
        lambda s: idle(s) and s.get(aborted, 0) == before.get(aborted, 0) + 1)
    assert after["prefixserve:generation_tokens_total"] - before[
        "prefixserve:generation_tokens_total"] < 400


# ---------------------------------------------------------------------- bad input
LONG_PROMPT = list(range(1000, 1000 + MAX_MODEL_LEN))

BAD_REQUESTS = [
    ("completions", {"prompt": "hi", "temperature": 3}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("completions", {"prompt": "hi", "logit_bias": {"42": 101}}, "logit_bias"),
    ("completions", {"prompt": "hi", "max_token": 3}, "max_token"),
    ("completions", {"prompt": ["hi"] * 257}, "prompt"),
    ("completions", {"prompt": ["hi"] * 3, "n": 100}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 129}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "function"}]}, "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_schema"}}, "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("completions", {"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": [10**9]}, "prompt"),
    ("completions", {"prompt": 3.5}, "prompt"),
    ("completions", {"prompt": LONG_PROMPT}, "prompt"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     None),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "stream_options": {"include_usage": True}}, None),
    ("chat/completions", {"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]},
     "messages"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD_REQUESTS)
def test_bad_requests_get_a_400_naming_the_problem(server: ServerProcess, endpoint: str,
                                                   body: dict, param: str | None) -> None:
    response = HTTP.post(f"{server.url}/v1/{endpoint}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


@pytest.mark.parametrize(("content", "content_type", "fragment"), [
    (b"{not json", "application/json", "not valid JSON"),
    (b"[1, 2]", "application/json", "JSON object"),
    (b'{"prompt": "hi"}', "text/plain", "JSON object"),
    (b"", "application/json", "missing"),
    (b'{"prompt": "hi", "temperature": NaN}', "application/json", "temperature"),
    (b'{"prompt": "\\ud800"}', "application/json", "Unicode"),
])
def test_malformed_bodies_get_a_400(server: ServerProcess, content: bytes, content_type: str,
                                    fragment: str) -> None:
    response = HTTP.post(server.url + "/v1/completions", content=content,
                          headers={"content-type": content_type})
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]


def test_unknown_routes_and_methods(server: ServerProcess) -> None:
    missing = HTTP.get(server.url + "/v1/engines")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    wrong_method = HTTP.get(server.url + "/v1/completions")
    assert wrong_method.status_code == 405
    assert "error" in wrong_method.json()


def test_the_openai_client_sees_bad_requests(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert caught.value.status_code == 404
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["param"] == "model"


# ---------------------------------------------------------------------- what real clients send
def test_fields_that_cannot_change_the_result_are_accepted_and_named(
        server: ServerProcess, client: openai.OpenAI) -> None:
    extra = {"store": False, "metadata": {"trace": "1"}, "service_tier": "auto",
             "prompt_cache_key": "session-1", "reasoning_effort": "low", "user": "u-1",
             "modalities": ["text"]}
    # supported fields at their neutral values change nothing and are not "ignored"
    neutral = {"tools": [], "tool_choice": "none", "parallel_tool_calls": True,
               "response_format": {"type": "text"}, "logit_bias": {}}
    messages = [{"role": "user", "content": "Say hello."}]
    # both requests below then hit the same cached prefix, so that they compute the same way
    # (a hit and a miss may differ in the last bits of a logit, and this model's second token
    # here is a near tie)
    HTTP.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 1, "temperature": 0})
    plain = HTTP.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 4, "temperature": 0})
    loose = HTTP.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 4, "temperature": 0, **extra, **neutral})
    assert loose.status_code == 200, loose.text
    assert loose.headers["x-ignored-fields"].split(",") == sorted(extra)
    assert "x-ignored-fields" not in plain.headers
    assert (loose.json()["choices"][0]["message"]["content"]
            == plain.json()["choices"][0]["message"]["content"])
    with HTTP.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": "Hi", "max_tokens": 2, "stream": True, "store": True}) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["x-ignored-fields"] == "store"
        assert list(streamed.iter_lines())[-2] == "data: [DONE]"
    sdk = client.chat.completions.create(model="smol", messages=messages, max_tokens=2,
                                         store=False, metadata={"k": "v"}, user="u")
    assert sdk.choices[0].message.content is not None


def test_completions_without_max_tokens_generate_16(server: ServerProcess) -> None:
    for body in ({}, {"max_tokens": None}):
        response = HTTP.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": "Once upon a time", "ignore_eos": True, **body})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 16
        assert response.json()["choices"][0]["finish_reason"] == "length"


def test_a_top_k_past_the_vocabulary_means_every_token(server: ServerProcess) -> None:
    def sample(top_k: int) -> str:
        response = HTTP.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": "The weather today is", "max_tokens": 12, "temperature": 1.0,
            "seed": 7, "top_k": top_k})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    every = sample(0)
    assert sample(10**15) == every
    assert sample(49152) == every  # exactly the vocabulary size
    assert sample(1) != every  # top_k does act


def test_chat_template_kwargs_are_accepted(server: ServerProcess) -> None:
    """SmolLM2's template reads no extra variable, so the same prompt comes out; a name the
    server sets itself is refused (see BAD_REQUESTS)."""
    def prompt_tokens(kwargs: dict | None) -> int:
        response = HTTP.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "chat_template_kwargs": kwargs})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert prompt_tokens({"enable_thinking": False}) == prompt_tokens(None)
