"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), behind an API key.

``/tokenize`` takes either ``prompt`` (text, encoded as ``/v1/completions`` would) or
``messages`` (with ``tools``, ``add_generation_prompt`` and ``chat_template_kwargs``, rendered
exactly as ``/v1/chat/completions`` renders them, tool manifest included), and answers the
token ids with their count and the context length; ``return_token_strs`` adds each token's
vocabulary string. The ids returned stop at the context length (``truncated`` says so; ``count``
is the whole input's) unless ``return_all_tokens`` asks for all of them. Encoding runs in a
worker thread, off the event loop. ``/detokenize`` turns token ids back into text.

Annotations here are evaluated (no ``from __future__ import annotations``), as in ``app.py``.
"""

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefixserve.server.errors import ApiError
from prefixserve.server.openai.agent_protocol import ToolChoice, ToolDefinition
from prefixserve.server.openai.protocol import ChatCompletionRequest, ChatMessage, TokenId
from prefixserve.server.openai.serving import OpenAIServing
from prefixserve.server.openapi import ResponseDocs


class TokenizeRequest(BaseModel):
    """Text (``prompt``) or a conversation (``messages``) to turn into token ids."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = Field(True, description="With `prompt`: add what the "
                                     "tokenizer adds (for SmolLM2: nothing).")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    return_token_strs: bool = False
    return_all_tokens: bool = Field(False, description="Return every token id, also past the "
                                    "context length (by default the ids stop there).")

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None
    truncated: bool = Field(False, description="`tokens` stops at `max_model_len` (of `count`).")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def _chat_ids(serving: OpenAIServing, body: TokenizeRequest) -> list[int]:
    chat = ChatCompletionRequest.model_validate({
        "messages": [m.model_dump(exclude_none=True) for m in body.messages or ()],
        "add_generation_prompt": body.add_generation_prompt,
        "chat_template_kwargs": body.chat_template_kwargs,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()] or None,
        "tool_choice": body.tool_choice if isinstance(body.tool_choice, str | None)
        else body.tool_choice.model_dump()}, strict=False)
    return serving.chat_prompt(chat, serving.tool_calling(chat))


def _ids(serving: OpenAIServing, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        return serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return _chat_ids(serving, body)


def add_tokenize_routes(app: FastAPI, serving: OpenAIServing, api_key: Any,
                        docs: ResponseDocs) -> None:
    """Declares ``POST /tokenize`` and ``POST /detokenize``; ``api_key`` is the parameter type
    that checks an API key (``KeyParameters.api``)."""
    if TYPE_CHECKING:
        ApiKey = str | None
    else:
        ApiKey = api_key

    @app.post("/tokenize", response_model=TokenizeResponse, tags=["Tokens"], responses=docs)
    async def tokenize(body: TokenizeRequest, key: ApiKey) -> TokenizeResponse:
        """Token ids of a prompt, or of a conversation as the chat template renders it."""
        serving.resolve_model(body.model)
        ids = await asyncio.to_thread(_ids, serving, body)
        count, limit = len(ids), serving.max_model_len
        truncated = count > limit and not body.return_all_tokens
        if truncated:
            ids = ids[:limit]
        strs = serving.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=count, max_model_len=limit, tokens=ids, token_strs=strs,
                                truncated=truncated)

    @app.post("/detokenize", response_model=DetokenizeResponse, tags=["Tokens"],
              responses=docs)
    async def detokenize(body: DetokenizeRequest, key: ApiKey) -> DetokenizeResponse:
        """The text of token ids (special tokens included)."""
        serving.resolve_model(body.model)
        bad = next((t for t in body.tokens if t >= serving.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, "
                           f"{serving.vocab_size})", param="tokens", code="invalid_value")
        return DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens,
                                                                  skip_special_tokens=False))
