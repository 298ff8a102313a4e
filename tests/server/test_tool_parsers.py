"""Reading tool calls back out of text (no model): the Hermes/generic ``<tool_call>`` format,
Llama 3.x JSON, calls cut by ``max_tokens``, and the streaming splitter holding back text that
may start a call marker."""

from __future__ import annotations

import json

from prefixserve.server.openai.agent_protocol import ToolDefinition
from prefixserve.server.openai.tool_calls import ToolCalling, detect_format

TOOL = ToolDefinition.model_validate({"type": "function", "function": {
    "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}})


def calling(fmt: str, choice: str = "auto") -> ToolCalling:
    return ToolCalling([TOOL], choice, None, True, fmt)


def test_hermes_calls_content_and_a_call_cut_short() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>\n<tool_call>\n{"na')
    content, calls = calling("hermes").parse(text)
    assert content == "Let me look."
    assert [json.loads(c.function.arguments) for c in calls] == [{"x": 1}, {"x": 2}]
    assert len({c.id for c in calls}) == 2
    assert calling("hermes").parse("<tool_call>\nnot json\n</tool_call>") == (
        "<tool_call>\nnot json\n</tool_call>", [])
    assert calling("hermes", "none").parse(text)[1] == []


def test_llama3_json_calls() -> None:
    content, calls = calling("llama3_json").parse(
        '<|python_tag|>{"name": "f", "parameters": {"x": 3}}; {"name": "f", "parameters": {}}')
    assert content is None and [c.function.arguments for c in calls] == ['{"x": 3}', "{}"]
    assert calling("llama3_json").parse("plain answer") == ("plain answer", [])


def test_stream_holds_back_a_split_marker_and_sends_calls_at_the_end() -> None:
    stream = calling("generic").stream()
    sent = [stream.feed(piece) for piece in ["Sure <tool", "_ca", "ll>\n{\"name\": \"f\", ",
                                             "\"arguments\": {\"x\": 5}}\n</tool_call>"]]
    assert sent == ["Sure ", "", "", ""]
    rest, deltas = stream.finish()
    assert rest == ""  # "Sure " went out already
    assert deltas[0].id and deltas[0].function.name == "f" and deltas[0].function.arguments == ""
    assert "".join(d.function.arguments or "" for d in deltas) == '{"x": 5}'
    plain = calling("generic").stream()
    assert plain.feed("a <to") == "a " and plain.finish() == ("<to", [])
    assert calling("generic").stream().feed("a <b") == "a <b"  # cannot start a marker


def test_format_detection() -> None:
    assert detect_format(None) == "generic"
    assert detect_format("{{ messages }}") == "generic"
    assert detect_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_format("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"
