"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every error the server answers goes through here: a request that fails validation is a 400 (never
FastAPI's 422), an unknown route a 404, a wrong method a 405, a missing or wrong API key a 401.
An unexpected error is a 500 ``internal_error`` that leaves the connection open. Bodies are
written with ASCII escapes only, so no client input, however malformed, can make an
error response itself fail.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("prefixserve.server")

#: Characters of a user's value an error message quotes (:func:`quote`) at most.
QUOTE_LIMIT = 80
#: Characters of an error message at most: a value quoted without :func:`quote` is cut too.
MESSAGE_LIMIT = 2000

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error",
          503: "service_unavailable_error"}


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (the rest counted), so
    that an error never echoes a large input back."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def _capped(message: str) -> str:
    if len(message) <= MESSAGE_LIMIT:
        return message
    return f"{message[:MESSAGE_LIMIT]}... ({len(message) - MESSAGE_LIMIT} more characters)"


class ApiError(Exception):
    """An error to answer with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


class AsciiJSONResponse(JSONResponse):
    """A JSON response with non-ASCII characters escaped (valid whatever the strings hold)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The error object of an OpenAI-style error response."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": _capped(message), "type": kind, "param": param, "code": code}}


def error_response(error: ApiError) -> JSONResponse:
    return AsciiJSONResponse(error_body(error.status, error.message, error.param, error.code),
                             status_code=error.status, headers=error.headers)


def _location(loc: Sequence[int | str]) -> str:
    """``("body", "prompt", "token_ids", 3)`` -> ``prompt.token_ids[3]``."""
    text = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def describe_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A message naming what is wrong, and the top-level field at fault, from pydantic's
    errors (the input values themselves are never repeated)."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    kind = first.get("type")
    param = str(loc[1]) if len(loc) > 1 and loc[0] == "body" else None
    if kind == "json_invalid":
        message = "the request body is not valid JSON"
        if first.get("ctx", {}).get("error"):
            message += f" ({first['ctx']['error']})"
        param = None
    elif kind == "missing" and loc == ("body",):
        message = "the request body is missing; send a JSON object"
    elif kind == "model_attributes_type" and loc == ("body",):
        message = "the request body must be a JSON object, sent with Content-Type: " \
                  "application/json"
    elif kind == "extra_forbidden":
        message = f"unrecognized request argument: {_location(loc)}"
    else:
        text = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        where = _location(loc)
        message = f"{where}: {text}" if where else text
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    """Makes ``app`` answer every error with an OpenAI-style body."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = describe_validation_errors(exc.errors())
        return error_response(ApiError(400, message, param=param, code="invalid_value"))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = f"no such route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        code = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
        return error_response(ApiError(exc.status_code, message, code=code,
                                       headers=exc.headers))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(ApiError(500, f"internal server error: {type(exc).__name__}",
                                       code="internal_error"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
    app.add_middleware(KeepAliveOnError, handlers=app.exception_handlers)


class KeepAliveOnError:
    """Answers an unexpected exception with the ``Exception`` handler's 500 and keeps the
    connection open. Starlette's outermost middleware answers it too, but then raises it
    again to the server, which closes the connection: the client's next request on it would
    get no answer. This one sits inside it and raises nothing once it has answered (an
    exception after the response started still reaches the server, which can only close)."""

    def __init__(self, app: ASGIApp, handlers: Mapping[Any, Any]) -> None:
        self.app = app
        self.handlers = handlers  # read at each error: a later wrapper of the handler applies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:
            if started:
                raise
            response = await self.handlers[Exception](Request(scope, receive), exc)
            await response(scope, receive, send)
