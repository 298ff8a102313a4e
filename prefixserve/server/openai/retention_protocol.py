"""The HTTP models of explicit prompt caching: the ``retention`` field and the pin routes'
bodies (torch-free, like ``protocol.py``; the behaviour is in ``retention.py``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prefixserve.core.retention import MAX_PRIORITY, MIN_PRIORITY


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class RetentionRangeSpec(_Strict):
    """Prompt tokens ``[start, end)`` (``end`` omitted: to the prompt's end)."""

    start: int = Field(0, ge=0)
    end: int | None = Field(None, ge=1)
    priority: int = Field(..., ge=MIN_PRIORITY, le=MAX_PRIORITY)
    duration: float = Field(..., gt=0, description="Seconds after each use.")


class RetentionSpec(_Strict):
    """How long and how firmly to keep this request's prompt in the prefix cache."""

    priority: int | None = Field(None, ge=MIN_PRIORITY, le=MAX_PRIORITY,
                                 description="The whole prompt's priority (35 is the default "
                                 "of every block; higher is kept longer).")
    duration: float | None = Field(None, gt=0, description="Seconds the whole prompt keeps "
                                   "its priority after each use.")
    ranges: list[RetentionRangeSpec] | None = Field(None, min_length=1, max_length=16)


class PinRequest(_Strict):
    """A prefix to pin: exactly one of ``prompt``, ``messages``, ``prompt_token_ids``."""

    id: str | None = Field(None, min_length=1, max_length=128,
                           description="The pin's name (default: a fresh one).")
    prompt: str | None = Field(None, min_length=1)
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    prompt_token_ids: list[int] | None = Field(None, min_length=1)
    cache_salt: str | None = Field(None, min_length=1)
    for_api_key: str | None = Field(
        None, min_length=1, description="The tenant whose requests should hit the pin: with "
        "per-key cache isolation (the default with API keys) a pin is salted like that key's "
        "requests.")


class PinInfo(BaseModel):
    id: str
    num_blocks: int
    num_tokens: int


class PinList(BaseModel):
    object: str = "list"
    data: list[PinInfo]
    num_pinned_blocks: int


class ResetRequest(_Strict):
    keep_pins: bool = False
