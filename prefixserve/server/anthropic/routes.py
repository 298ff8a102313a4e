"""The Messages API routes (see ``anthropic.py``) and their key check: ``x-api-key`` or
``Authorization: Bearer``. Annotations here are evaluated (no ``from __future__ import
annotations``): FastAPI reads the route parameters from them."""

import hmac
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import Response

from prefixserve.server.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from prefixserve.server.anthropic.serving import AnthropicServing, install_anthropic_errors
from prefixserve.server.config import ServerConfig
from prefixserve.server.errors import ApiError
from prefixserve.server.openapi import ErrorDocs, error_doc


def _key_check(keys: tuple[str, ...]) -> Callable[..., Coroutine[Any, Any, str | None]]:
    encoded = [key.encode("utf-8") for key in keys]

    async def check(x_api_key: Annotated[str | None, Header()] = None,
                    authorization: Annotated[str | None, Header()] = None) -> str | None:
        if not encoded:
            return None
        given = x_api_key
        if given is None and authorization and authorization.lower().startswith("bearer "):
            given = authorization[7:].strip()
        if given is None:
            raise ApiError(401, "missing API key: send the header 'x-api-key: <key>'",
                           code="missing_api_key")
        if not any([hmac.compare_digest(given.encode("utf-8"), key) for key in encoded]):
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        return given

    return check


def add_anthropic_routes(app: FastAPI, service: AnthropicServing, config: ServerConfig,
                         docs: ErrorDocs) -> None:
    """Declares ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` and gives every
    error under ``/v1/messages`` Anthropic's shape."""
    ApiKey = Annotated[str | None, Depends(_key_check(config.api_keys))]
    install_anthropic_errors(app)

    @app.post("/v1/messages", response_model=MessageResponse, tags=["Anthropic"],
              responses={**docs.generation, 529: error_doc("The waiting queue is full "
                                                           "(`overloaded_error`).")})
    async def messages(body: MessagesRequest, request: Request,
                       api_key: ApiKey) -> Response | MessageResponse:
        """Anthropic's Messages API: the assistant's reply, with `cache_control` breakpoints
        kept in the prefix cache for their TTL."""
        return await service.create_message(body, request, api_key)

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse,
              tags=["Anthropic"], responses=docs.generation)
    async def count_tokens(body: CountTokensRequest, api_key: ApiKey) -> CountTokensResponse:
        """The prompt's tokens, as `/v1/messages` would count them."""
        return await service.count_tokens(body)
