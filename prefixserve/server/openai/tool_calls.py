"""Tool calling: the manifest in the prompt, the grammar of a forced call, and the parsers.

Formats, picked from the model's chat template (:func:`detect_format`):

- ``hermes``: the template renders ``tools`` itself and the model answers each call as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Qwen3, Hermes).
  Assistant ``tool_calls`` go to the template with their arguments as objects, ``tool``
  messages as they are.
- ``llama3_json``: the template renders ``tools`` (Llama 3.1-3.3) and a call is one JSON object
  ``{"name": ..., "parameters": {...}}`` (several joined by ``; ``), maybe after
  ``<|python_tag|>``.
- ``generic``: the template knows nothing of tools (SmolLM2, the default model). The server
  writes the manifest at the start of the first system message (one is added when there is
  none) in this documented text::

      # Tools
      <one line of instructions>
      <tools>
      {"type": "function", "function": {...}}        (one line per tool)
      </tools>
      <the call format: <tool_call> JSON </tool_call>, as hermes>

  Assistant ``tool_calls`` become the message's text in that call format, and a ``tool``
  message becomes a ``user`` message ``<tool_response>\\n{content}\\n</tool_response>``.

The manifest sits before the conversation, so it is the same prefix on every turn and is
served from the prefix cache from turn two on.

``tool_choice``: ``none`` renders the tools but parses nothing; ``auto`` parses calls out of
the text (and when the call's opening marker is one token, the grammar switches on at that
token: the call that follows is well-formed and its arguments validate); ``required`` and a
named function force calls with a grammar whose arguments follow each function's JSON schema.
``parallel_tool_calls: false`` allows one call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixserve.model.text.tokenizer import Tokenizer
from prefixserve.sampling_params import StructuredOutputsParams
from prefixserve.server.errors import ApiError, quote
from prefixserve.server.openai.agent_protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    NamedToolChoice,
    ResponseFunctionCall,
    ResponseToolCall,
    ToolDefinition,
)
from prefixserve.server.openai.structured import check_json_schema

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_CALL_PATTERN = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
#: JSON inside a grammar: fixed separators, no free whitespace.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

_GENERIC_INSTRUCTIONS = (
    "You can call the functions listed below when they help to answer. Each line between "
    "<tools> and </tools> describes one function as JSON.")
_GENERIC_CALL_FORMAT = (
    "To call functions, answer with nothing but the calls, one per block:\n"
    "<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<arguments as JSON>}}\n"
    "</tool_call>\nThe results come back in <tool_response></tool_response> blocks.")


def detect_format(template: str | None) -> str:
    """``hermes``, ``llama3_json`` or ``generic`` (see the module docstring)."""
    if not template or "tools" not in template:
        return "generic"
    if CALL_START in template:
        return "hermes"
    if _PYTHON_TAG in template or "tools_in_user_message" in template:
        return "llama3_json"
    return "generic"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def manifest_text(tools: Sequence[ToolDefinition]) -> str:
    """The generic format's tool manifest (the start of the system message)."""
    lines = [json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools]
    return "\n".join(["# Tools", _GENERIC_INSTRUCTIONS, "<tools>", *lines, "</tools>",
                      _GENERIC_CALL_FORMAT])


def check_tool_messages(messages: Sequence[Any]) -> None:
    """A 400 naming ``messages`` for a ``tool`` message that answers no call of an earlier
    assistant message."""
    known: set[str] = set()
    for index, message in enumerate(messages):
        for call in message.tool_calls or ():
            known.add(call.id)
        if message.role == "tool" and message.tool_call_id not in known:
            raise ApiError(400, f"messages[{index}]: the tool message answers the call "
                           f"{quote(message.tool_call_id)}, which no earlier assistant message "
                           "made",
                           param="messages", code="invalid_messages")


def _arguments_object(text: str, index: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ApiError(400, f"messages[{index}].tool_calls: arguments must be JSON text",
                       param="messages", code="invalid_messages") from None


@dataclass
class ToolCalling:
    """The tools of one chat request: how they enter the prompt, the output's grammar, and how
    calls are read back out of the text."""

    tools: list[ToolDefinition]
    choice: str  # none, auto, required, or "function" (a named one: ``forced``)
    forced: str | None
    parallel: bool
    format: str

    @classmethod
    def for_request(cls, tools: list[ToolDefinition] | None, choice: Any,
                    parallel: bool | None, template: str | None,
                    max_schema_depth: int) -> ToolCalling | None:
        """None without tools (and ``tool_choice`` absent or ``none``); a 400 naming
        ``tool_choice`` for a choice the tools cannot satisfy, or ``tools`` for parameters that
        are no JSON schema or nest more than ``max_schema_depth`` levels."""
        tools = list(tools or [])
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise ApiError(400, "tools: function names must be unique", param="tools",
                           code="invalid_value")
        kind = choice.type if isinstance(choice, NamedToolChoice) else (choice or "auto")
        forced = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if forced is not None and forced not in names:
            raise ApiError(400, f"tool_choice names the function {quote(forced)}, which is not in "
                           f"tools ({', '.join(names) or 'none given'})", param="tool_choice",
                           code="invalid_value")
        if kind == "required" and not tools:
            raise ApiError(400, "tool_choice is required but no tools are given",
                           param="tool_choice", code="invalid_value")
        if not tools:
            return None
        for tool in tools:
            if tool.function.parameters is not None:
                check_json_schema(tool.function.parameters, "tools", max_schema_depth)
        return cls(tools, kind, forced, parallel is not False, detect_format(template))

    # ------------------------------------------------------------------ the prompt
    def messages(self, messages: list[dict[str, Any]],
                 originals: Sequence[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The template's messages and extra variables (``tools``) for this format."""
        if self.format == "generic":
            return self._generic_messages(messages, originals), {}
        result = []
        for index, (item, message) in enumerate(zip(messages, originals, strict=True)):
            if message.tool_calls:
                item = {**item, "tool_calls": [
                    {"id": call.id, "type": "function", "function": {
                        "name": call.function.name,
                        "arguments": _arguments_object(call.function.arguments, index)}}
                    for call in message.tool_calls]}
                item.setdefault("content", "")
            if message.tool_call_id is not None:
                item = {**item, "tool_call_id": message.tool_call_id}
            result.append(item)
        return result, {"tools": [t.model_dump(exclude_none=True) for t in self.tools]}

    def _generic_messages(self, messages: list[dict[str, Any]],
                          originals: Sequence[Any]) -> list[dict[str, Any]]:
        manifest = manifest_text(self.tools)
        result: list[dict[str, Any]] = []
        for index, (item, message) in enumerate(zip(messages, originals, strict=True)):
            if message.tool_calls:
                calls = [call_text(c.function.name,
                                   _arguments_object(c.function.arguments, index))
                         for c in message.tool_calls]
                text = "\n".join(filter(None, [item.get("content") or "", *calls]))
                item = {"role": "assistant", "content": text}
            elif message.role == "tool":
                item = {"role": "user",
                        "content": f"<tool_response>\n{item['content']}\n</tool_response>"}
            result.append(item)
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": f"{manifest}\n\n{result[0]['content']}"}
        else:
            result.insert(0, {"role": "system", "content": manifest})
        return result

    # ------------------------------------------------------------------ the grammar
    def _call_schema(self) -> dict[str, Any]:
        key = "parameters" if self.format == "llama3_json" else "arguments"
        options = []
        for tool in self.tools:
            if self.forced is not None and tool.function.name != self.forced:
                continue
            options.append({"type": "object", "properties": {
                "name": {"const": tool.function.name},
                key: tool.function.parameters or _NO_ARGUMENTS},
                "required": ["name", key], "additionalProperties": False})
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "x-guidance": _COMPACT}

    def grammar(self, tokenizer: Tokenizer | None = None) -> str:
        """The Lark grammar (llguidance's, with ``%json``) of one or more calls. A marker that
        is an added token of ``tokenizer``'s vocabulary is written as that token (llguidance
        treats added tokens as special: their text does not spell them)."""
        schema = json.dumps(self._call_schema(), ensure_ascii=False)
        many = self.parallel and self.forced is None
        if self.format == "llama3_json":
            more = ' ("; " call)*' if many else ""
            return f"start: call{more}\ncall: %json {schema}\n"
        more = ' ("\\n" call)*' if many else ""
        start, end = _marker(CALL_START, tokenizer), _marker(CALL_END, tokenizer)
        return (f"start: call{more}\n"
                f'call: {start} "\\n" %json {schema} "\\n" {end}\n')

    def constraint(self, tokenizer: Tokenizer) -> StructuredOutputsParams | None:
        """The output's grammar: forced calls for ``required`` / a named function; for
        ``auto`` a lazy one that starts at the call marker when it is a single token."""
        if self.choice in ("required", "function"):
            return StructuredOutputsParams(grammar=self.grammar(tokenizer))
        if self.choice == "auto" and self.format != "llama3_json":
            marker = tokenizer.encode(CALL_START, add_special_tokens=False)
            if len(marker) == 1:
                return StructuredOutputsParams(grammar=self.grammar(tokenizer),
                                               trigger_token_ids=tuple(marker))
        return None

    # ------------------------------------------------------------------ reading calls back
    def parse(self, text: str) -> tuple[str | None, list[ResponseToolCall]]:
        """The message's content (None when only calls remain) and its tool calls."""
        if self.choice == "none":
            return text, []
        if self.format == "llama3_json":
            return _parse_llama3(text)
        return _parse_hermes(text)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def _marker(text: str, tokenizer: Tokenizer | None) -> str:
    """The grammar term of a call marker: the added token itself, or its text."""
    if tokenizer is not None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in tokenizer.backend.get_added_tokens_decoder():
            return text
    return json.dumps(text)


def call_text(name: str, arguments: Any) -> str:
    """One call in the ``<tool_call>`` format."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_START}\n{body}\n{CALL_END}"


def _to_call(value: Any, key: str) -> ResponseToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, value.get("arguments", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return ResponseToolCall(id=new_call_id(),
                            function=ResponseFunctionCall(name=value["name"], arguments=text))


def _parse_hermes(text: str) -> tuple[str | None, list[ResponseToolCall]]:
    if CALL_START not in text:
        return text, []
    calls: list[ResponseToolCall] = []
    matches = list(_CALL_PATTERN.finditer(text))
    for number, match in enumerate(matches):
        try:
            call = _to_call(json.loads(match.group(1)), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None and calls and number == len(matches) - 1 and \
                not match.group(0).endswith(CALL_END):
            break  # a last call cut short (max_tokens): the complete ones stand
        if call is None:
            return text, []  # not a well-formed call: hand the text back as it is
        calls.append(call)
    content = text[:text.index(CALL_START)].strip()
    return content or None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[ResponseToolCall]]:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(body):
        try:
            value, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return text, []
        call = _to_call(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        position = end
        while position < len(body) and body[position] in "; \n":
            position += 1
    return None, calls


@dataclass
class ToolCallStream:
    """Splits one choice's streamed text into content deltas and tool-call deltas.

    Text that could still be the start of a call marker is held back; once a marker is seen
    the rest is held until the choice ends, then parsed whole: each call is sent as two
    deltas (``id``, ``type``, ``function.name`` with empty arguments, then the arguments), so
    concatenating the deltas gives the same calls as a whole response."""

    calling: ToolCalling
    _held: str = ""
    _sent: int = 0
    _in_calls: bool = False
    calls: list[ResponseToolCall] = field(default_factory=list)

    def _marker(self) -> str:
        return _PYTHON_TAG if self.calling.format == "llama3_json" else CALL_START

    def feed(self, text: str) -> str:
        """Content to send now for the new ``text``."""
        if self.calling.choice == "none":
            return text
        self._held += text
        if self._in_calls:
            return ""
        marker = self._marker()
        if self.calling.format == "llama3_json" and self._held.lstrip().startswith("{"):
            self._in_calls = True
            return ""
        found = self._held.find(marker)
        if found >= 0:
            self._in_calls = True
            out, self._held = self._held[:found], self._held[found:]
            return out
        keep = next((n for n in range(min(len(marker) - 1, len(self._held)), 0, -1)
                     if marker.startswith(self._held[-n:])), 0)
        out = self._held[:len(self._held) - keep]
        self._held = self._held[len(out):]
        return out

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """The held content and the call deltas, once the choice has ended."""
        held, self._held = self._held, ""
        if not self._in_calls:
            return held, []
        content, self.calls = self.calling.parse(held)
        if not self.calls:
            return held, []
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(self.calls):
            deltas.append(DeltaToolCall(index=index, id=call.id, type="function",
                                        function=DeltaFunctionCall(name=call.function.name,
                                                                   arguments="")))
            deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                arguments=call.function.arguments)))
        return content or "", deltas
