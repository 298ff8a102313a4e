"""Tools in the Messages API, mapped onto the tool calling of the OpenAI path
(``openai/tool_calls.py``).

- ``tools`` (``name``, ``description``, ``input_schema``) become OpenAI function definitions, so
  the manifest enters the prompt exactly as for ``/v1/chat/completions`` (the model's template,
  or the generic manifest at the start of the system message: before the conversation, the
  same prefix on every turn).
- ``tool_choice``: ``auto`` -> ``auto``, ``any`` -> ``required``, ``{"type": "tool", "name"}``
  -> that function (forced by a grammar), ``none`` -> ``none``;
  ``disable_parallel_tool_use`` -> one call at most.
- Messages become OpenAI-shaped turns (:class:`Turn`): an assistant message's text blocks are
  its content and its ``tool_use`` blocks its ``tool_calls`` (``input`` as JSON arguments); a
  user message's ``tool_result`` blocks become ``tool`` turns (``tool_call_id`` =
  ``tool_use_id``), its text blocks a user turn after them.
- A model's calls come back as ``tool_use`` content blocks (ids ``toolu_...``).

Checks (400s naming the block): ``tool_use``/``tool_result`` blocks without ``tools``, a
``tool_use`` in a user message or a ``tool_result`` in an assistant one, a ``tool_result``
whose ``tool_use_id`` no earlier ``tool_use`` has, an ``input_schema`` that is not an object
schema, ``tool_choice`` naming a tool not in ``tools``, ``any``/``tool`` without tools.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from prefixserve.server.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    TextBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
)
from prefixserve.server.errors import ApiError, quote
from prefixserve.server.openai.agent_protocol import (
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ResponseFunctionCall,
    ResponseToolCall,
    ToolDefinition,
)
from prefixserve.server.openai.tool_calls import ToolCalling

SENTINEL = "\ue000\ue001"  # private-use characters: marks a breakpoint while rendering
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_WRONG_ROLE = {("assistant", "tool_result"): "a tool_result block belongs in a user message",
               ("user", "tool_use"): "a tool_use block belongs in an assistant message",
               ("assistant", "image"): "an image block belongs in a user message"}


@dataclass
class Turn:
    """One message as ``ToolCalling.messages`` reads it (the OpenAI chat shape)."""

    role: str
    content: str
    tool_calls: list[ResponseToolCall] | None = None
    tool_call_id: str | None = None

    def item(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content}


def tool_calling(body: CountTokensRequest, template: str | None,
                 max_schema_depth: int) -> ToolCalling | None:
    """The request's tools as the OpenAI path's ``ToolCalling`` (None without tools)."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is not None and choice.type in ("any", "tool") and not tools:
        raise ApiError(400, f"tool_choice: {quote(choice.type)} needs tools, and none are given")
    if not tools and _uses_tools(body):
        raise ApiError(400, "messages: requests with tool_use or tool_result blocks must "
                       "define tools")
    definitions = [_definition(i, tool) for i, tool in enumerate(tools)]
    kind: Any = "auto" if choice is None else _CHOICES.get(choice.type)
    if choice is not None and choice.type == "tool":
        kind = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    parallel = not getattr(choice, "disable_parallel_tool_use", None)
    return ToolCalling.for_request(definitions, kind, parallel, template, max_schema_depth)


def _definition(index: int, tool: Tool) -> ToolDefinition:
    if tool.input_schema.get("type") != "object":
        raise ApiError(400, f"tools.{index}.input_schema: the schema's type must be "
                       "\"object\"")
    return ToolDefinition(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.input_schema))


def _uses_tools(body: CountTokensRequest) -> bool:
    return any(isinstance(block, ToolUseBlock | ToolResultBlock)
               for message in body.messages if not isinstance(message.content, str)
               for block in message.content)


def with_tools_ending_at(calling: ToolCalling, index: int) -> ToolCalling:
    """``calling`` with its tools up to ``index`` and then a tool no request can name: the
    rendering agrees with the real one exactly up to the end of tool ``index`` (and maybe the
    start of the next entry's header, which holds no ``}``)."""
    stranger = ToolDefinition.model_construct(
        type="function", function=FunctionDefinition.model_construct(
            name=SENTINEL, description=None, parameters=None, strict=None))
    return replace(calling, tools=[*calling.tools[:index + 1], stranger])


def common_length(text: str, other: str) -> int:
    """The length of the longest common prefix of two renderings."""
    n = 0
    limit = min(len(text), len(other))
    while n < limit and text[n] == other[n]:
        n += 1
    return n


def tool_cut(text: str, other: str) -> int:
    """Where a tool's entry ends in ``text``: the last ``}`` of the part that ``other`` (the
    rendering of :func:`with_tools_ending_at`) shares with it; 0 when there is none."""
    return text.rfind("}", 0, common_length(text, other)) + 1


def _text(blocks: Sequence[TextBlock], mark: object) -> str:
    return "\n".join(b.text + (SENTINEL if b is mark else "") for b in blocks)


def _result_text(block: ToolResultBlock, mark: object) -> str:
    content = block.content
    text = content if isinstance(content, str) else _text(content or [], mark)
    if block.is_error:
        text = f"Error: {text}"
    return text + (SENTINEL if block is mark else "")


def conversation(system: Sequence[TextBlock], turns: Sequence[tuple[str, list[ContentBlock]]],
                 mark: object) -> list[Turn]:
    """The OpenAI-shaped turns of the conversation, with ``SENTINEL`` after the block
    ``mark`` (compared by identity; None marks nothing)."""
    out = [Turn("system", _text(system, mark))] if system else []
    known: set[str] = set()
    for i, (role, blocks) in enumerate(turns):
        for j, block in enumerate(blocks):
            wrong = _WRONG_ROLE.get((role, block.type))
            if wrong is not None:
                raise ApiError(400, f"messages.{i}.content.{j}: {wrong}")
        if role == "assistant":
            out.append(_assistant(blocks, mark, known))
        else:
            out.extend(_user(i, blocks, mark, known))
    return out


def _assistant(blocks: list[ContentBlock], mark: object, known: set[str]) -> Turn:
    texts: list[TextBlock] = []
    calls: list[ResponseToolCall] = []
    for block in blocks:
        if isinstance(block, ToolUseBlock):
            known.add(block.id)
            calls.append(ResponseToolCall(id=block.id, function=ResponseFunctionCall(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
        elif isinstance(block, TextBlock):
            texts.append(block)
    return Turn("assistant", _text(texts, mark), tool_calls=calls or None)


def _user(index: int, blocks: list[ContentBlock], mark: object, known: set[str]) -> list[Turn]:
    out: list[Turn] = []
    texts: list[TextBlock] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block)
            continue
        if not isinstance(block, ToolResultBlock):
            continue  # a tool_use: refused by conversation()
        if block.tool_use_id not in known:
            raise ApiError(400, f"messages.{index}.content.{j}: tool_result answers "
                           f"tool_use_id {quote(block.tool_use_id)}, which no earlier tool_use "
                           "block has")
        if texts:
            out.append(Turn("user", _text(texts, mark)))
            texts = []
        out.append(Turn("tool", _result_text(block, mark), tool_call_id=block.tool_use_id))
    if texts or not out:
        out.append(Turn("user", _text(texts, mark)))
    return out


def tool_use_blocks(calls: Sequence[ResponseToolCall]) -> list[ToolUseOut] | None:
    """The ``tool_use`` blocks of parsed calls; None when an argument is not a JSON object
    (the text then stands as it is)."""
    out = []
    for call in calls:
        try:
            value = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict):
            return None
        out.append(ToolUseOut(id=f"toolu_{uuid.uuid4().hex[:24]}", name=call.function.name,
                              input=value))
    return out
