"""The HTTP models of Anthropic's Messages API (``POST /v1/messages``, ``/count_tokens``), as far
as this server implements it: text, ``image`` (a model that takes images), ``tool_use`` and
``tool_result`` content blocks, ``tools``
and ``tool_choice``, ``cache_control`` breakpoints, sampling, stop sequences, streaming.
Torch-free, like ``protocol.py``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefixserve.core.retention import CACHE_CONTROL_TTLS
from prefixserve.server.openai.agent_protocol import FUNCTION_NAME_PATTERN

MAX_BREAKPOINTS = 4
"""Anthropic allows at most four ``cache_control`` breakpoints per request."""

TTL_SECONDS = CACHE_CONTROL_TTLS


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CacheControl(_Model):
    type: Literal["ephemeral"]
    ttl: str | None = Field(None, description="\"5m\" (the default) or \"1h\".")


class TextBlock(_Model):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class Base64ImageSource(_Model):
    type: Literal["base64"]
    media_type: str = Field(..., description="image/png, image/jpeg, image/webp or image/gif.")
    data: str


class UrlImageSource(_Model):
    """An ``http(s)`` URL, fetched only from a host ``--allowed-media-domains`` names."""

    type: Literal["url"]
    url: str


class ImageBlock(_Model):
    """An image in a user message (a model that takes images)."""

    type: Literal["image"]
    source: Annotated[Base64ImageSource | UrlImageSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None


class ToolUseBlock(_Model):
    """A call the assistant made (in an assistant message)."""

    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = Field(None, description="Sent back by the SDK; ignored.")
    toolset_name: str | None = Field(None, description="Sent back by the SDK; ignored.")


class ToolResultBlock(_Model):
    """The result of an earlier ``tool_use`` (in a user message)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock,
                         Field(discriminator="type")]


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Model):
    """A client tool: its name, what it does, the JSON schema of its ``input``."""

    type: Literal["custom"] | None = None
    name: str = Field(..., pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class _Choice(_Model):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(_Choice):
    type: Literal["auto"]


class ToolChoiceAny(_Choice):
    type: Literal["any"]


class ToolChoiceTool(_Choice):
    type: Literal["tool"]
    name: str


class ToolChoiceNone(_Model):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class Metadata(_Model):
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(_Model):
    model: str = Field(..., min_length=1)
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = Field(
        None, description="Automatic caching: a breakpoint on the last block of the last "
        "message (counts towards the four).")
    service_tier: str | None = Field(None, description="Accepted and ignored.")


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int
