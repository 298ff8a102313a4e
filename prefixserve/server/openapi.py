"""The server's OpenAPI document: error and event-stream response docs, and the final touches.

``/openapi.json`` describes exactly what each route accepts and answers. FastAPI's 422 is never
sent (validation errors are 400s), so it and its schemas are left out; the ``model`` field of
the generation requests lists the served names; and ``ChatCompletionChunk``, the event of a
streamed chat completion (no route returns it as its model), is added to the schemas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from prefixserve.server.config import ServerConfig
from prefixserve.server.openai.protocol import ChatCompletionChunk, ErrorResponse

#: The ``responses`` of a route: documented status codes (or ``"default"``) to their docs.
ResponseDocs = dict[int | str, dict[str, Any]]


def error_doc(description: str) -> dict[str, Any]:
    """The doc of an error response: an ``ErrorResponse`` body, for the given reason."""
    return {"model": ErrorResponse, "description": description}


def stream_doc(chunk: type) -> dict[str, Any]:
    """The 200 response of a generation route: JSON, or with ``stream`` server-sent events,
    each described (as OpenAPI 3.1 does without ``itemSchema``) by the schema of one event;
    ``chunk`` is the model each event carries."""
    data = (f"A {chunk.__name__} as JSON; an `ErrorResponse` as JSON if generation fails after "
            "the stream started; `[DONE]` last.")
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": data},
                            "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer"}}}
    return {"description": f"The response, or with `stream` server-sent events: `data: <"
            f"{chunk.__name__}>` lines, then `data: [DONE]`.",
            "content": {"text/event-stream": {"schema": event}}}


@dataclass(frozen=True)
class ErrorDocs:
    """The error responses each kind of route documents under a server's configuration.

    ``guarded``: routes that need an API key (401, only when the server has API keys).
    ``generation``: the two generation routes (400, the ``guarded`` ones, 404, 503).
    ``admin``: admin actions (401 and 403, when they are protected). ``metrics``: ``/metrics``
    (401 and 403, when the server has metrics keys).
    """

    guarded: ResponseDocs
    generation: ResponseDocs
    admin: ResponseDocs
    metrics: ResponseDocs

    @classmethod
    def for_config(cls, config: ServerConfig) -> ErrorDocs:
        """The error docs of a server with ``config``."""
        guarded: ResponseDocs = (
            {401: error_doc("Missing or wrong API key.")} if config.api_keys else {})
        admin: ResponseDocs = (
            {401: error_doc("Missing or wrong admin key."),
             403: error_doc("The key is not an admin key.")} if config.admin_protected else {})
        metrics: ResponseDocs = (
            {401: error_doc("Missing or wrong metrics key."),
             403: error_doc("The key is not a metrics or admin key.")}
            if config.metrics_keys else {})
        generation: ResponseDocs = {
            400: error_doc("Invalid request: bad JSON, wrong types or values, a field not "
                           "supported, over a per-request limit, prompt too long for the "
                           "context..."),
            **guarded,
            404: error_doc("The model is not served here (`model_not_found`)."),
            503: error_doc("The waiting queue is full (retry after `Retry-After` seconds) or "
                           "the engine is shutting down."),
        }
        return cls(guarded=guarded, generation=generation, admin=admin, metrics=metrics)


def install_openapi(app: FastAPI, config: ServerConfig) -> None:
    """Makes ``app.openapi()`` return FastAPI's document of the app's routes (built once, on
    the first call, then cached in ``app.openapi_schema``) with the changes this module's
    docstring lists; the served names are ``config.served_model_names``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            _drop_validation_errors(schema)
            schemas = schema.get("components", {}).get("schemas", {})
            _enumerate_models(schemas, config.served_model_names)
            _add_chat_chunk(schemas)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_validation_errors(schema: dict[str, Any]) -> None:
    """Removes the 422 response of every operation, and the schemas only it used."""
    for path_item in schema["paths"].values():
        for operation in path_item.values():
            operation.get("responses", {}).pop("422", None)
    schemas = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def _enumerate_models(schemas: dict[str, Any], names: tuple[str, ...]) -> None:
    """Restricts the string form of the generation requests' ``model`` field to ``names``."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        model = schemas[name]["properties"]["model"]
        model["anyOf"][0]["enum"] = list(names)


def _add_chat_chunk(schemas: dict[str, Any]) -> None:
    """Adds the ``ChatCompletionChunk`` schema, and those it refers to that are missing."""
    chunk = ChatCompletionChunk.model_json_schema(
        ref_template="#/components/schemas/{model}", mode="serialization")
    for name, definition in chunk.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas["ChatCompletionChunk"] = chunk
