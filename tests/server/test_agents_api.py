"""Agent features on a real server with the default model (SmolLM2), driven by the ``openai``
client and plain HTTP: structured outputs (``response_format``, ``structured_outputs``,
``guided_*``) with n > 1, streaming and stop strings; ``logit_bias`` and
``allowed_token_ids``; tool calls in the generic format (named and required choices, streamed
deltas, the manifest as a cached prefix); ``/tokenize``, ``/detokenize``; ``/v1/responses``;
CORS; and the 400s of bad input. Grammar state after preemption is checked on the engine
itself."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_helpers import HTTP, ServerProcess, openai_client, serve_for_module

from prefixserve.engine.config import EngineConfig
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.sampling_params import SamplingParams, StructuredOutputsParams

BLOCK_SIZE = 16
MODEL = "smol"
ORIGIN = "https://agent.example"

#: Nested objects, enums, arrays and required fields; lengths bounded so 50 samples at
#: temperature 1 finish within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"enum": ["admin", "user", "guest"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "role", "age", "address", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve_for_module(["--dtype", "float32", "--num-blocks", "1024", "--block-size",
                             str(BLOCK_SIZE), "--max-model-len", "2048",
                             "--served-model-name", MODEL, "--allowed-origins", ORIGIN,
                             "--max-stored-responses", "2"],
                                tmp_path_factory.mktemp("agents") / "server.log")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, timeout=900)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, timeout=900)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------- structured outputs
@pytest.mark.slow
def test_json_schema_valid_in_16_of_16_samples_at_temperature_1(client: openai.OpenAI) -> None:
    """Kills: the mask not applied (or applied to the wrong row) in a batch of 16."""
    response = client.chat.completions.create(
        model=MODEL, messages=user("Describe a user of a web shop."), n=16, temperature=1,
        max_tokens=120, seed=7, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}})
    assert len(response.choices) == 16
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_streamed_json_with_stop_strings_and_n_2_is_valid(client: openai.OpenAI) -> None:
    """Kills: a stop string cutting a constrained document (``"`` occurs in every one)."""
    stream = client.chat.completions.create(
        model=MODEL, messages=user("A user as JSON."), n=2, temperature=1, max_tokens=160,
        seed=3, stop=['"', "}"], stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_on_completions_and_the_vllm_forms(server: ServerProcess) -> None:
    body = {"prompt": "Data:", "max_tokens": 60, "temperature": 1, "seed": 1}
    obj = post(server, "/v1/completions", {**body, "response_format": {"type": "json_object"}})
    assert obj.status_code == 200, obj.text
    assert isinstance(json.loads(obj.json()["choices"][0]["text"]), dict)
    regex = post(server, "/v1/completions", {**body, "guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert regex.status_code == 200, regex.text
    text = regex.json()["choices"][0]["text"]
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
    choice = post(server, "/v1/completions", {**body, "n": 8,
                                              "guided_choice": ["red", "green", "blue"]})
    assert {c["text"] for c in choice.json()["choices"]} <= {"red", "green", "blue"}
    grammar = post(server, "/v1/completions", {**body, "structured_outputs": {
        "grammar": 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]/'}})
    assert grammar.json()["choices"][0]["text"] in {"yes", "no", *(f"maybe {d}"
                                                                    for d in "0123456789")}
    schema = post(server, "/v1/completions", {**body, "guided_json": PERSON,
                                              "max_tokens": 160})
    jsonschema.validate(json.loads(schema.json()["choices"][0]["text"]), PERSON)


@pytest.mark.parametrize(("path", "extra", "param", "code"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "invalid_json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?=a)b"}}}},
     "response_format", "invalid_grammar"),
    ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex", "invalid_grammar"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: ("}}, "structured_outputs",
     "invalid_grammar"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice",
     "invalid_value"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias", "invalid_value"),
    ("/v1/completions", {"allowed_token_ids": [999999]}, "allowed_token_ids", "invalid_value"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice", "invalid_value"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ("/v1/chat/completions", {"tools": TOOLS, "messages": [
        *user("hi"), {"role": "tool", "tool_call_id": "call_1", "content": "12"}]},
     "messages", "invalid_messages"),
])
def test_bad_agent_input_is_a_400_naming_the_parameter(
        server: ServerProcess, path: str, extra: dict[str, Any], param: str, code: str) -> None:
    body: dict[str, Any] = {"max_tokens": 4}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": user("hi")})
    body.update(extra)
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def _nested(levels: int) -> dict[str, Any]:
    """A schema of ``levels`` objects, each the one required property of the one above."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _deep_schema_requests(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    chat = {"messages": user("hi"), "max_tokens": 4}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return [
        ("/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}},
         "response_format"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4,
                             "guided_json": json.dumps(schema)}, "guided_json"),
        ("/v1/chat/completions", {**chat, "structured_outputs": {"json": schema}},
         "structured_outputs"),
        ("/v1/chat/completions", {**chat, "tools": [tool]}, "tools"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": user("hi"),
                          "tools": [{"name": "f", "input_schema": schema}]}, "tools"),
    ]


def test_a_deep_schema_is_a_400_naming_the_limit_and_the_connection_serves_on(
        server: ServerProcess) -> None:
    """200 nested objects, in each place a schema goes: a 400 naming the depth limit (it used
    to be a 500 ``RecursionError`` from the schema check, after which the server closed the
    keep-alive connection), and the next request on the same connection is answered. A
    schema of 30 levels, within the limit, still constrains the output."""
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=900)
    for path, body, param in _deep_schema_requests(_nested(200)):
        connection.request("POST", path, json.dumps(body),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 400, (path, error)
        assert "--max-json-schema-depth" in error["message"], error
        if path != "/v1/messages":
            assert error["param"] == param, error
        connection.request("POST", "/tokenize", json.dumps({"prompt": "still here"}),
                           {"Content-Type": "application/json"})
        follow_up = connection.getresponse()
        assert follow_up.status == 200 and json.loads(follow_up.read())["count"] > 0
    connection.close()
    body = {"messages": user("hi"), "max_tokens": 200, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "ok", "schema": _nested(30)}}}
    answer = post(server, "/v1/chat/completions", body).json()
    jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), _nested(30))


def test_grammar_survives_preemption_and_is_rebuilt_from_the_tokens() -> None:
    """Kills: a matcher that keeps its state across a recompute (it would consume the
    outputs twice) or is not rebuilt. A KV cache of 8 blocks of 16 tokens cannot hold 4
    sequences of ~60 tokens, so the scheduler preempts."""
    engine = LLMEngine(EngineConfig(num_blocks=8, block_size=16, dtype="float32"))
    spec = StructuredOutputsParams(json=PERSON)
    rebuilds = 0
    engine.add_request("A user:", SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=120,
                                                  structured_outputs=spec), "r")
    texts: dict[int, str] = {}
    while engine.has_unfinished_requests():
        for sequence in engine.sequences("r") if engine.has_unfinished_requests() else ():
            state = engine.structured.state(sequence.request.request_id)
            rebuilds = max(rebuilds, state.rebuilds if state else 0)
        for output in engine.step():
            for completion in output.outputs:
                texts[completion.index] = texts.get(completion.index, "") + completion.text
    assert engine.scheduler.num_preemptions > 0
    assert rebuilds > 0
    assert len(engine.structured) == 0  # finished sequences leave nothing behind
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


# ---------------------------------------------------------------------- token controls
def test_logit_bias_and_allowed_token_ids_change_the_output(server: ServerProcess) -> None:
    """Kills: either field accepted and ignored."""
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "logprobs": 1}
    plain = post(server, "/v1/completions", body).json()["choices"][0]
    first = plain["logprobs"]["tokens"][0]
    first_id = post(server, "/tokenize", {"prompt": first})
    banned = first_id.json()["tokens"][0]
    forced_id = post(server, "/tokenize", {"prompt": " banana"}).json()["tokens"][0]
    biased = post(server, "/v1/completions", {**body, "logit_bias": {
        str(banned): -100, str(forced_id): 100}}).json()["choices"][0]
    assert biased["logprobs"]["tokens"] == [" banana"] * 6
    # raw logprobs: the biased token is reported with the model's own logprob
    assert biased["logprobs"]["token_logprobs"][0] < plain["logprobs"]["token_logprobs"][0]
    ids = post(server, "/tokenize", {"prompt": " yes no"}).json()["tokens"]
    allowed = post(server, "/v1/completions", {**body, "temperature": 1, "seed": 2,
                                               "allowed_token_ids": ids}).json()["choices"][0]
    assert set(allowed["logprobs"]["tokens"]) <= {" yes", " no"}


# ---------------------------------------------------------------------- tool calls
def _call_chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    options = {"max_tokens": 120, "temperature": 1, "seed": 11, **kwargs}
    return client.chat.completions.create(model=MODEL, tools=TOOLS, **options)


def test_named_tool_choice_returns_arguments_that_validate(client: openai.OpenAI) -> None:
    response = _call_chat(client, messages=user("What time is it in Oslo?"), n=4,
                          tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


def test_required_tool_choice_calls_some_tool_with_valid_arguments(
        client: openai.OpenAI) -> None:
    response = _call_chat(client, messages=user("Weather in Rome?"), n=4,
                          tool_choice="required", parallel_tool_calls=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in response.choices:
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client: openai.OpenAI) -> None:
    kwargs = {"messages": user("Weather in Lima?"), "temperature": 0,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = _call_chat(client, **kwargs).choices[0].message.tool_calls[0]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in _call_chat(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["name"] == whole.function.name == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)
    assert calls[0]["id"].startswith("call_")


def test_turn_two_of_a_tool_conversation_hits_the_cache_for_the_whole_manifest(
        server: ServerProcess, client: openai.OpenAI) -> None:
    """The generic format writes the manifest first, so turn one's prompt (manifest included)
    is a prefix of turn two's: turn two's cached tokens are exactly turn one's full blocks
    (turn one samples one token, so nothing past its prompt is computed). Kills: a manifest
    placed after the conversation, or rendered differently per turn."""
    system = {"role": "system", "content": "You answer travel questions. [cache test]"}
    turn1 = [system, *user("Weather in Quito?")]
    first = _call_chat(client, messages=turn1, max_tokens=1)
    call = {"id": "call_quito", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Quito", "unit": "celsius"}'}}
    turn2 = [*turn1, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_quito", "content": '{"temp": 21}'}]
    ids1 = post(server, "/tokenize", {"messages": turn1, "tools": TOOLS}).json()["tokens"]
    ids2 = post(server, "/tokenize", {"messages": turn2, "tools": TOOLS}).json()["tokens"]
    manifest = post(server, "/tokenize", {"messages": [system], "tools": TOOLS,
                                          "add_generation_prompt": False}).json()["count"]
    assert ids2[:len(ids1)] == ids1
    second = _call_chat(client, messages=turn2, temperature=0, max_tokens=4, tool_choice="none")
    assert first.usage.prompt_tokens == len(ids1) and second.usage.prompt_tokens == len(ids2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == len(ids1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached >= manifest // BLOCK_SIZE * BLOCK_SIZE >= 10 * BLOCK_SIZE
    assert second.choices[0].message.tool_calls == []  # tool_choice none: text only


def test_tool_round_trip_in_the_generic_format(client: openai.OpenAI) -> None:
    """Call, tool result, final answer: the model's own call goes back as the assistant
    message, and the answer to the tool result is text."""
    messages = user("Weather in Quito?")
    first = _call_chat(client, messages=messages, tool_choice="required",
                       parallel_tool_calls=False)
    [call] = first.choices[0].message.tool_calls
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    final = _call_chat(client, messages=messages, tool_choice="none", max_tokens=16)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls == []


# ---------------------------------------------------------------------- tokens, responses, CORS
def test_tokenize_and_detokenize_round_trip(server: ServerProcess) -> None:
    tokens = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    body = tokens.json()
    assert body["count"] == len(body["tokens"]) == 2 and body["max_model_len"] == 2048
    assert body["token_strs"] == ["Hello", "Ġworld"]
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json() == {
        "prompt": "Hello world"}
    chat = post(server, "/tokenize", {"messages": user("hi")}).json()
    text = post(server, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert post(server, "/detokenize", {"tokens": [10**7]}).json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": "a", "messages": user("b")}).status_code == 400


def test_responses_text_with_previous_response_id_and_streaming(
        server: ServerProcess, client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Name a colour.", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    assert first.status in ("completed", "incomplete") and first.output_text
    second = client.responses.create(model=MODEL, input="Another one.", instructions="Be brief.",
                                     previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0)
    # the conversation so far is a prefix of turn two: its full blocks come from the cache
    assert second.usage.input_tokens_details.cached_tokens >= BLOCK_SIZE
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 1
    with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=40,
                                 temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output[0].content[0].text
    for _ in range(2):  # the store holds 2: the first response is dropped
        client.responses.create(model=MODEL, input="x", max_output_tokens=1)
    gone = post(server, "/v1/responses", {"input": "y", "previous_response_id": first.id})
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "previous_response_id"


def test_cors_only_for_allowed_origins(server: ServerProcess) -> None:
    preflight = {"Access-Control-Request-Method": "POST"}
    ok = httpx.options(server.url + "/v1/chat/completions",
                       headers={"Origin": ORIGIN, **preflight})
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/chat/completions",
                          headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
