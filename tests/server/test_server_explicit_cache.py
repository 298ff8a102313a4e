"""Explicit prompt caching on a real server on 127.0.0.1: the official ``anthropic`` client
against ``/v1/messages`` with ``cache_control`` (creation then reads, streaming, count_tokens,
Anthropic-shaped errors), the OpenAI API's ``retention`` field under a flood of unique prompts
(LRU loses an unprotected 2,000-token system prompt, retention keeps it, and after its short TTL
it is evictable again), and the admin pin routes with their budget. Every test ends with the pool
idle: no block leaked."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
from server_helpers import HTTP, ServerProcess, idle

API_KEY = "tenant-key"
ADMIN_KEY = "admin-key"
MODEL = "smol"
BLOCK_SIZE = 16
NUM_BLOCKS = 64  # 1,024 tokens; the 512-token context leaves a pin budget of 32 blocks
MAX_MODEL_LEN = 512
SYSTEM_TOKENS = 248  # 15 full blocks, almost a quarter of the pool
PIN_TOKENS = 200  # 12 full blocks
FLOOD = (4, 272)  # 4 unique prompts of 17 blocks: more than the whole pool


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                             "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL,
                             "--api-key", API_KEY, "--admin-key", ADMIN_KEY,
                             "--metrics-key", ADMIN_KEY],
                            tmp_path_factory.mktemp("server") / "server.log",
                            metrics_key=ADMIN_KEY).start()
    yield process
    assert process.stop() == 0, process.log
    assert "Traceback" not in process.log, process.log


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def words(n: int) -> str:
    """About ``n`` tokens of text that no other call shares, from the first token on."""
    tag = uuid.uuid4().hex
    return f"{tag} " + " ".join(f"w{i % 97}x{tag[i % 32]}" for i in range(n // 4))


def system_block(text: str, ttl: str | None = None) -> list[dict]:
    control: dict = {"type": "ephemeral"}
    if ttl:
        control["ttl"] = ttl
    return [{"type": "text", "text": text, "cache_control": control}]


def ask(claude: anthropic.Anthropic, system: list[dict], question: str):
    return claude.messages.create(model=MODEL, max_tokens=4, system=system,
                                  messages=[{"role": "user", "content": question}],
                                  extra_body={"temperature": 0})


def test_cache_control_first_call_creates_second_reads(claude: anthropic.Anthropic,
                                                        server: ServerProcess) -> None:
    system = system_block(words(200), ttl="1h")
    first = ask(claude, system, "Who are you?")
    second = ask(claude, system, "What do you do?")
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens > 150
    assert second.usage.cache_creation_input_tokens == 0
    # reads cover the breakpoint's blocks, plus any implicit hit past it (the chat template's
    # turn header is shared too), never more than the first prompt held
    read = second.usage.cache_read_input_tokens
    assert read % BLOCK_SIZE == 0
    created = first.usage.cache_creation_input_tokens
    assert created <= read < created + first.usage.input_tokens
    counted = claude.messages.count_tokens(model=MODEL, system=system,
                                           messages=[{"role": "user", "content": "Who are you?"}])
    u = first.usage
    assert counted.input_tokens == (u.input_tokens + u.cache_creation_input_tokens
                                    + u.cache_read_input_tokens)
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 4
    server.wait_for_metrics(idle)


def test_count_tokens_matches_input_tokens_without_cache_control(
        claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": words(40)}]
    reply = claude.messages.create(model=MODEL, max_tokens=2, messages=messages)
    counted = claude.messages.count_tokens(model=MODEL, messages=messages)
    assert reply.usage.cache_read_input_tokens == 0
    assert counted.input_tokens == reply.usage.input_tokens


def test_streaming_events_parse_in_the_sdk(claude: anthropic.Anthropic,
                                           server: ServerProcess) -> None:
    system = system_block(words(200))
    ask(claude, system, "Hello")
    kinds = []
    with claude.messages.stream(model=MODEL, max_tokens=6, system=system,
                                messages=[{"role": "user", "content": "Hello"}],
                                extra_body={"temperature": 0}) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.usage.cache_read_input_tokens > 120 and final.usage.output_tokens == 6
    assert final.content[0].text and final.stop_reason == "max_tokens"
    server.wait_for_metrics(idle)


def test_top_level_cache_control_caches_the_whole_prompt(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": words(200)}]
    first = claude.messages.create(model=MODEL, max_tokens=2, messages=messages,
                                   cache_control={"type": "ephemeral"})
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = claude.messages.create(model=MODEL, max_tokens=2, messages=messages)
    assert first.usage.cache_creation_input_tokens > 150
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens


def test_stop_sequences_report_stop_sequence(claude: anthropic.Anthropic) -> None:
    reply = claude.messages.create(
        model=MODEL, max_tokens=30, stop_sequences=["2"], extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Count from 1 to 9, separated by spaces."}])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "2"
    assert "2" not in reply.content[0].text


@pytest.mark.parametrize(("system", "messages", "needle"), [
    ([{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}}
      for i in range(5)], [{"role": "user", "content": "hi"}], "at most 4"),
    (system_block("some text", ttl="10m"), [{"role": "user", "content": "hi"}], "ttl"),
    ([{"type": "text", "text": "", "cache_control": {"type": "ephemeral"}}],
     [{"role": "user", "content": "hi"}], "empty text block"),
    (None, [{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages"),
])
def test_bad_input_is_a_400_in_anthropic_shape(claude: anthropic.Anthropic,
                                               server: ServerProcess, system: list | None,
                                               messages: list, needle: str) -> None:
    kwargs = {} if system is None else {"system": system}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=2, messages=messages, **kwargs)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert needle in body["error"]["message"]
    assert "/" not in body["error"]["message"].replace("/v1", "")  # no server paths
    server.wait_for_metrics(idle)


def test_keys_and_unknown_models_in_anthropic_shape(server: ServerProcess) -> None:
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    good = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as caught_404:
        good.messages.create(model="nope", max_tokens=1,
                             messages=[{"role": "user", "content": "x"}])
    assert caught_404.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    plain = HTTP.post(server.url + "/v1/completions", json={"prompt": "x"},
                       headers={"Authorization": "Bearer wrong"})
    assert plain.status_code == 401 and "error" in plain.json()  # OpenAI's shape stays


def complete(oai: openai.OpenAI, prompt: list[int], **extra: object) -> int:
    """Runs ``prompt`` (token ids) for one token; returns its cached prompt tokens."""
    response = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body=extra or None)
    return response.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]


def unique_ids(n: int) -> list[int]:
    """``n`` token ids that no other prompt starts with."""
    seed = uuid.uuid4().int
    return [1000 + (seed >> (i % 96)) % 20000 + i % 7 for i in range(n)]


def flood(oai: openai.OpenAI) -> None:
    """Unique prompts whose blocks add up to more than the pool."""
    count, length = FLOOD
    for _ in range(count):
        complete(oai, unique_ids(length))


def admin(server: ServerProcess, method: str, path: str, **kwargs: object) -> httpx.Response:
    return HTTP.request(method, server.url + path, timeout=120,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kwargs)


@dataclass
class Flooded:
    """What one flood left of prompts sent before it: cached tokens of each on its return."""

    unprotected: int
    protected: int
    expired: int
    pinned: int
    metrics: dict[str, float]


@pytest.fixture(scope="module")
def flooded(oai: openai.OpenAI, server: ServerProcess) -> Flooded:
    """One flood for four prompts sent before it, the same way but for what protects them:
    nothing (LRU alone), a retention, a retention whose short TTL ran out before the flood, a
    pin (set, then kept through ``/reset_prefix_cache?keep_pins=true``). 15 + 15 protected or
    pinned blocks leave 34 for the flood's 68."""
    pinned = unique_ids(PIN_TOKENS)
    tenant = HTTP.post(server.url + "/v1/pins", json={"prompt_token_ids": pinned},
                        headers={"Authorization": f"Bearer {API_KEY}"})
    assert tenant.status_code == 403
    pin = admin(server, "POST", "/v1/pins",
                json={"id": "manual", "prompt_token_ids": pinned, "for_api_key": API_KEY})
    assert pin.status_code == 200, pin.text
    assert pin.json() == {"id": "manual", "num_blocks": 12, "num_tokens": PIN_TOKENS}
    assert admin(server, "POST", "/reset_prefix_cache?keep_pins=true").status_code == 200
    unprotected, protected, expiring = (unique_ids(SYSTEM_TOKENS) for _ in range(3))
    assert complete(oai, unprotected) == 0
    assert complete(oai, protected, retention={"priority": 80, "duration": 600}) == 0
    assert complete(oai, expiring, retention={"priority": 80, "duration": 1.0}) == 0
    time.sleep(1.2)
    flood(oai)
    return Flooded(complete(oai, unprotected), complete(oai, protected),
                   complete(oai, expiring), complete(oai, pinned),
                   server.metrics())  # not idle: the pin holds its blocks


def test_flood_evicts_unprotected_system_prompt_keeps_protected(flooded: Flooded) -> None:
    """The same flood both ways: LRU alone loses the system prompt, retention keeps it all."""
    assert flooded.unprotected == 0
    assert flooded.protected == SYSTEM_TOKENS - SYSTEM_TOKENS % BLOCK_SIZE
    assert flooded.metrics["prefixserve:prefix_cache_priority_hits_total{priority=80}"] >= 15


def test_protected_prompt_is_evictable_after_its_ttl(flooded: Flooded) -> None:
    assert flooded.expired == 0
    assert flooded.metrics["prefixserve:prefix_cache_expired_retentions_total"] >= 15


def test_pins_survive_floods_and_resets_with_keep_pins(flooded: Flooded,
                                                       server: ServerProcess) -> None:
    assert flooded.pinned == PIN_TOKENS // BLOCK_SIZE * BLOCK_SIZE
    listed = admin(server, "GET", "/v1/pins").json()
    assert [p["id"] for p in listed["data"]] == ["manual"] and listed["num_pinned_blocks"] == 12
    assert server.metrics()["prefixserve:kv_cache_num_pinned_blocks"] == 12
    assert admin(server, "POST", "/reset_prefix_cache").status_code == 200
    assert admin(server, "GET", "/v1/pins").json()["data"] == []
    assert admin(server, "DELETE", "/v1/pins/manual").status_code == 404
    server.wait_for_metrics(idle)


def test_bad_retention_is_a_400(oai: openai.OpenAI) -> None:
    for retention, needle in (({"priority": 101, "duration": 5}, "priority"),
                              ({"priority": 80, "duration": 10**6}, "max-retention-duration"),
                              ({"priority": 80}, "duration")):
        with pytest.raises(openai.BadRequestError, match=needle):
            complete(oai, [1, 2, 3], retention=retention)


def test_pin_over_budget_is_a_400_and_leaks_nothing(server: ServerProcess) -> None:
    first = admin(server, "POST", "/v1/pins", json={"id": "a", "prompt_token_ids": unique_ids(200)})
    assert first.status_code == 200
    over = admin(server, "POST", "/v1/pins", json={"prompt_token_ids": unique_ids(400)})
    assert over.status_code == 400
    error = over.json()["error"]
    assert error["code"] == "pin_budget_exceeded" and "pin budget is 32" in error["message"]
    assert admin(server, "GET", "/v1/pins").json()["num_pinned_blocks"] == 12
    assert admin(server, "DELETE", "/v1/pins/a").status_code == 200
    both = admin(server, "POST", "/v1/pins", json={"prompt": "a", "prompt_token_ids": [1]})
    assert both.status_code == 400
    server.wait_for_metrics(idle)
    assert admin(server, "GET", "/v1/pins").json()["num_pinned_blocks"] == 0


# ---------------------------------------------------------------------- tools with cache_control
def tool(name: str, description: str, cached: bool = False) -> dict:
    schema = {"type": "object", "properties": {"city": {"type": "string",
                                                        "enum": ["Paris", "Rome"]}},
              "required": ["city"]}
    out: dict = {"name": name, "description": description, "input_schema": schema}
    if cached:
        out["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    return out


def priority_hits(server: ServerProcess) -> float:
    return server.metrics().get("prefixserve:prefix_cache_priority_hits_total{priority=80}", 0.0)


def test_turn_two_reads_the_cached_tool_manifest(claude: anthropic.Anthropic,
                                                 server: ServerProcess) -> None:
    """Turn one forces a call (``tool_choice: tool``) and writes the manifest under the
    breakpoint on the last tool; turn two sends the call back with its ``tool_result`` and
    reads the manifest's blocks from the cache, at the breakpoint's priority. Kills: tools'
    cache_control ignored (no creation tokens, no priority-80 hits), tool_use/tool_result
    blocks refused or rendered differently on turn two (the manifest prefix is lost)."""
    # ~420 prompt tokens (the random tags tokenize to a few more or less per run) + 60 to
    # generate, inside the 512-token context
    tools = [tool("get_weather", words(48)), tool("get_time", words(64), cached=True)]
    messages: list = [{"role": "user", "content": "Weather in Paris?"}]
    # greedy: at the default temperature 1 the call's JSON ran past 60 tokens about once in
    # eight runs
    first = claude.messages.create(model=MODEL, max_tokens=60, tools=tools, messages=messages,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_") and call.input["city"] in ("Paris", "Rome")
    created = first.usage.cache_creation_input_tokens
    assert created >= 160 and first.usage.cache_read_input_tokens < created
    before = priority_hits(server)
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "18 C, sunny"}]}]
    second = claude.messages.create(model=MODEL, max_tokens=2, tools=tools, messages=messages,
                                    tool_choice={"type": "none"})
    assert second.usage.cache_read_input_tokens >= created + first.usage.cache_read_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    assert priority_hits(server) - before >= created // BLOCK_SIZE
    assert second.content[0].type == "text"
    server.wait_for_metrics(idle)


def test_a_tool_breakpoint_ends_at_its_own_tool(claude: anthropic.Anthropic) -> None:
    """A breakpoint on the first of two tools covers the manifest up to that tool, one on the
    second the second's ~120 tokens too. Kills: a tool breakpoint placed at the end of the
    manifest (or of the prompt) whichever tool it is on."""
    def created(cached_index: int) -> int:
        tools = [tool("a", words(30), cached_index == 0), tool("b", words(120),
                                                                cached_index == 1)]
        reply = claude.messages.create(model=MODEL, max_tokens=1, tools=tools,
                                       messages=[{"role": "user", "content": "hi"}])
        return reply.usage.cache_creation_input_tokens + reply.usage.cache_read_input_tokens

    on_first, on_second = created(0), created(1)
    assert on_first >= 3 * BLOCK_SIZE
    assert on_second - on_first >= 90


def test_a_tool_use_breakpoint_covers_the_call_and_no_more(claude: anthropic.Anthropic) -> None:
    """``cache_control`` on an assistant's ``tool_use`` block (Anthropic accepts it there) is a
    breakpoint at the end of that turn: it covers the call's turn (~50 tokens of input, ~124 in
    all) past a breakpoint on the question before it, and not the tool_result after it (~120
    tokens of text, ~183 with its wrapping and the generation prompt). (``words`` varies in
    length with its random tag: with a 70-token input the prompt passed the 512-token context
    once in a full suite run.)
    Kills: a tool_use breakpoint refused (400), ignored, or placed at the prompt's end."""
    control = {"type": "ephemeral"}

    def covered(on_call: bool) -> tuple[int, int]:
        note = words(50)
        use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
               "input": {"city": "Paris", "note": note}}
        question = {"type": "text", "text": "Weather in Paris?"}
        if on_call:
            use["cache_control"] = control
        else:
            question["cache_control"] = control
        messages = [{"role": "user", "content": [question]},
                    {"role": "assistant", "content": [use]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                  "content": words(120)}]}]
        reply = claude.messages.create(model=MODEL, max_tokens=1, messages=messages,
                                       tools=[tool("get_weather", "Weather of a city.")])
        usage = reply.usage
        return usage.cache_creation_input_tokens + usage.cache_read_input_tokens, \
            usage.input_tokens

    on_question, _ = covered(False)
    on_call, after = covered(True)
    assert on_call - on_question >= 96  # ~124: the call's turn, in whole blocks
    assert after >= 150  # ~183: the tool_result and the generation prompt


def test_streamed_tool_use_parses_in_the_sdk(claude: anthropic.Anthropic,
                                             server: ServerProcess) -> None:
    tools = [tool("get_weather", "Weather of a city.")]
    # greedy: the schema allows properties beyond ``city``, and at the default temperature 1
    # the model wrote some that ran past 60 tokens in 2 of 60 calls
    with claude.messages.stream(model=MODEL, max_tokens=60, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "Rome?"}],
                                extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert uses[0].input["city"] in ("Paris", "Rome")
    server.wait_for_metrics(idle)


_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                          "name": "get_weather", "input": {"city": "Rome"}}]}
_CONTROL = {"type": "ephemeral"}


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"messages": [{"role": "user", "content": "x"}, _USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "18 C"}]}]},
     "tool_use_id 'toolu_2'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "", "cache_control": _CONTROL}]}]}, "empty text block"),
    ({"tools": [{**tool("a", "x"), "cache_control": _CONTROL},
                {**tool("b", "y"), "cache_control": _CONTROL}],
      "system": [{"type": "text", "text": f"s{i}", "cache_control": _CONTROL} for i in (1, 2)],
      "messages": [{"role": "user", "content": [
          {"type": "text", "text": "x", "cache_control": _CONTROL}]}]},
     "this one has 5 (tools 2, system 2, messages 1)"),
    ({"tools": None, "messages": [{"role": "user", "content": "x"}, _USE, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]},
     "must define tools"),
    ({"tools": [{"name": "a", "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
])
def test_bad_tool_input_is_a_400_naming_the_problem(claude: anthropic.Anthropic,
                                                    server: ServerProcess, kwargs: dict,
                                                    needle: str) -> None:
    request: dict = {"tools": [tool("get_weather", "Weather of a city.")],
                     "messages": [{"role": "user", "content": "x"}], **kwargs}
    if request["tools"] is None:
        del request["tools"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=2, **request)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert needle in body["error"]["message"], body
    server.wait_for_metrics(idle)
