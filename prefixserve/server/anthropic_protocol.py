"""The HTTP models of Anthropic's Messages API (``POST /v1/messages``, ``/count_tokens``), as far
as this server implements it: text content blocks, ``cache_control`` breakpoints, sampling,
stop sequences, streaming. Torch-free, like ``protocol.py``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_BREAKPOINTS = 4
"""Anthropic allows at most four ``cache_control`` breakpoints per request."""

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


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


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class Metadata(_Model):
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(_Model):
    model: str = Field(..., min_length=1)
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None


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


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int
