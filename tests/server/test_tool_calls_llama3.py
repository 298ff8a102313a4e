"""Tool calls in the Llama 3.x JSON format, end to end through a real server and the ``openai``
client: a tiny random-weight Llama model built here, with SmolLM2's vocabulary plus Llama 3's
header and end-of-turn tokens, and a chat template written for this test in the Llama 3.1 style
(tools as JSON in the first user turn, a call answered as ``{"name": ..., "parameters": ...}``,
results in an ``ipython`` turn).

A random model never chooses to call a tool by itself, so the calls are forced with
``tool_choice`` (a named function, ``required``): the grammar makes each call well-formed, and
the server's Llama 3 parser must read it back into ``tool_calls``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch
from server_helpers import HTTP, ServerProcess, openai_client, serve_for_module
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, LlamaConfig

from prefixserve.model.text.tokenizer import load_tokenizer

SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|eom_id|>", "<|python_tag|>"]

#: Written for this test in the manner of Llama 3.1's template: a system header (with
#: ``Environment: ipython`` when tools are given), the tools in the first user message when
#: ``tools_in_user_message`` (the default), calls as JSON objects joined by "; ", tool results
#: as ``ipython`` turns.
TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools_in_user_message is not defined %}{% set tools_in_user_message = true %}"
    "{% endif %}"
    "{%- if messages[0].role == 'system' %}{% set system_text = messages[0].content %}"
    "{% set turns = messages[1:] %}"
    "{%- else %}{% set system_text = '' %}{% set turns = messages %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}Environment: ipython\n{% endif %}"
    "{{ system_text }}<|eot_id|>"
    "{%- for message in turns %}"
    "{%- if loop.first and tools and tools_in_user_message and message.role == 'user' %}"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    "Functions you may call, one JSON object each:\n\n"
    "{% for tool in tools %}{{ tool | tojson }}\n\n{% endfor %}"
    "To call one, answer only with {\"name\": <its name>, \"parameters\": <an object of its "
    "arguments>}.\n\n{{ message.content }}<|eot_id|>"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message.tool_calls %}"
    "{{ {'name': call.function.name, 'parameters': call.function.arguments} | tojson }}"
    "{%- if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>"
    "{%- elif message.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- else %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time."}}
TOOLS = [WEATHER, CLOCK]
BLOCK_SIZE = 16
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"maxProperties": 0}
           for t in TOOLS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama3")
    backend = load_tokenizer(None).backend
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=64,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=backend.token_to_id("<|eot_id|>"),
                         bos_token_id=backend.token_to_id("<|begin_of_text|>"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve_for_module([str(model_dir), "--dtype", "float32", "--num-blocks", "256",
                             "--block-size", str(BLOCK_SIZE), "--served-model-name", "llama3"],
                                tmp_path_factory.mktemp("llama3-server") / "server.log")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, timeout=600)


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    options = {"max_tokens": 80, "temperature": 1, "seed": 3, "tools": TOOLS, **kwargs}
    return client.chat.completions.create(model="llama3", messages=messages, **options)


def rendered(server: ServerProcess, messages: list[dict[str, Any]]) -> str:
    tokens = HTTP.post(server.url + "/tokenize",
                        json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    return str(HTTP.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"])


def test_named_call_round_trips_through_the_template(server: ServerProcess,
                                                     client: openai.OpenAI) -> None:
    """Named call, its result in an ipython turn, a final answer under ``auto`` (plain text:
    the parser hands it back as content), turn one's prompt a cached prefix of turn two.
    Kills: the template's format not detected (the generic manifest would be added), a grammar
    whose arguments do not follow the schema, a parser that misses the ``parameters`` key
    (planted: caught), tool calls not handed to the template as Llama 3 expects them."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Weather in Oslo?"}]
    prompt = rendered(server, messages)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                             "Environment: ipython\nBe brief.<|eot_id|>")
    assert '{"type": "function", "function": {"name": "get_weather"' in prompt
    assert "# Tools" not in prompt  # the template renders the tools, not the generic manifest
    first = ask(client, messages,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'}]
    prompt = rendered(server, messages)
    arguments = json.dumps(json.loads(call.function.arguments))
    assert (f'<|start_header_id|>assistant<|end_header_id|>\n\n{{"name": "get_weather", '
            f'"parameters": {arguments}}}<|eot_id|>') in prompt
    assert prompt.endswith('<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 3}<|eot_id|>'
                           "<|start_header_id|>assistant<|end_header_id|>\n\n")
    final = ask(client, messages, tool_choice="auto", max_tokens=8, seed=5)
    assert final.choices[0].message.tool_calls in (None, [])
    assert final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens == len(HTTP.post(server.url + "/tokenize", json={
        "messages": messages, "tools": TOOLS}).json()["tokens"])
    # the system turn and the tools of turn one are a cached prefix of turn two
    cached = final.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE, cached


def test_required_calls_validate_and_stream_to_the_same_calls(client: openai.OpenAI) -> None:
    """``required`` with parallel calls (several joined by "; "), n = 3: every call validates;
    the same request streamed (same seed) reassembles to the same names and arguments, and no
    call text leaks into the content. Kills: a stream splitter that sends the JSON as content,
    deltas that do not concatenate to the whole call, a grammar that lets a wrong name in."""
    messages = [{"role": "user", "content": "Go."}]
    kwargs = {"tool_choice": "required", "seed": 11, "max_tokens": 120}
    whole = ask(client, messages, n=3, **kwargs)
    assert len(whole.choices) == 3
    for choice in whole.choices:
        assert choice.message.tool_calls and choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    [single] = ask(client, messages, **kwargs).choices
    parts: dict[int, list[str]] = {}
    content = ""
    finish = None
    for chunk in ask(client, messages, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for call in delta.tool_calls or ():
            entry = parts.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
    assert content == ""
    assert finish == "tool_calls"
    assert parts == {i: [c.function.name, c.function.arguments]
                     for i, c in enumerate(single.message.tool_calls)}
