"""Tool calls through a chat template that renders tools (Hermes style, as Qwen2.5 / Qwen3):
a tiny random-weight Qwen2 model built here, with SmolLM2's vocabulary plus ``<tool_call>``
and ``</tool_call>`` as tokens, served by a real server.

A random model never chooses to call a tool, so ``logit_bias`` pushes the ``<tool_call>``
token under ``tool_choice: "auto"``; from that token on the lazy grammar makes the call
well-formed, and the server's parser must read it back out of the template's format."""

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
from transformers import AutoModelForCausalLM, Qwen2Config

from prefixserve.model.text.tokenizer import load_tokenizer

#: A Hermes-style template written for this test: tools in the system turn, calls as
#: <tool_call> JSON, results as <tool_response> in a user turn.
TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 16},
        "top": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["query", "top"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time."}}
TOOLS = [SEARCH, CLOCK]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hermes")
    backend = load_tokenizer(None).backend
    backend.add_tokens([AddedToken("<tool_call>", normalized=False),
                        AddedToken("</tool_call>", normalized=False)])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=backend.get_vocab_size(), hidden_size=64,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve_for_module([str(model_dir), "--dtype", "float32", "--num-blocks", "256",
                             "--served-model-name", "hermes"],
                                tmp_path_factory.mktemp("hermes-server") / "server.log")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, timeout=600)


@pytest.fixture(scope="module")
def call_token(server: ServerProcess) -> int:
    [token] = HTTP.post(server.url + "/tokenize", json={"prompt": "<tool_call>"}).json()["tokens"]
    return token


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    options = {"max_tokens": 120, "temperature": 1, "seed": 4, "tools": TOOLS, **kwargs}
    return client.chat.completions.create(model="hermes", messages=messages, **options)


def test_auto_tool_call_round_trips_through_the_template(
        server: ServerProcess, client: openai.OpenAI, call_token: int) -> None:
    """Call, tool result, final answer. Kills: a parser that misses the template's format,
    tools not given to the template, a lazy grammar that never switches on."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Find cats."}]
    first = ask(client, messages, tool_choice="auto", parallel_tool_calls=False,
                logit_bias={str(call_token): 100})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    [call] = choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
    assert call.function.name in schemas
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schemas[call.function.name] or {"maxProperties": 0})
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "3 results"}]
    rendered = HTTP.post(server.url + "/detokenize", json={"tokens": HTTP.post(
        server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]})
    prompt = rendered.json()["prompt"]
    assert '{"type": "function", "function": {"name": "search"' in prompt  # the template's
    assert f'"name": "{call.function.name}"' in prompt and "<tool_response>\n3 results" in prompt
    final = ask(client, messages, tool_choice="auto", max_tokens=12,
                logit_bias={str(call_token): -100})
    assert final.choices[0].message.tool_calls == []
    assert final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")


def test_streamed_auto_call_reassembles_to_the_whole_one(
        client: openai.OpenAI, call_token: int) -> None:
    kwargs = {"tool_choice": "auto", "parallel_tool_calls": False,
              "logit_bias": {str(call_token): 100}, "seed": 9}
    messages = [{"role": "user", "content": "Search dogs."}]
    [whole] = ask(client, messages, **kwargs).choices[0].message.tool_calls
    parts: dict[int, list[str]] = {}
    content = ""
    for chunk in ask(client, messages, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = parts.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
    assert content == ""  # the call marker and the call are never sent as text
    assert parts == {0: [whole.function.name, whole.function.arguments]}


def test_required_parallel_calls_all_validate(client: openai.OpenAI) -> None:
    response = ask(client, [{"role": "user", "content": "Go."}], tool_choice="required", n=4,
                   max_tokens=200)
    for choice in response.choices:
        assert choice.message.tool_calls, choice.message.content
        for call in choice.message.tool_calls:
            schema = SEARCH["function"]["parameters"] if call.function.name == "search" \
                else {"maxProperties": 0}
            jsonschema.validate(json.loads(call.function.arguments), schema)
