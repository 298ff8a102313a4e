"""The FastAPI application: routes, authentication, errors, metrics and the OpenAPI document.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` and
``POST /reset_prefix_cache`` (these need ``Authorization: Bearer <key>`` when the server has API
keys), and ``GET /health``, ``GET /version``, ``GET /metrics`` (always open). ``/openapi.json``
describes exactly what each route accepts and answers: FastAPI's 422 is never sent (validation
errors are 400s), so it is not documented either.

Annotations here are evaluated (no ``from __future__ import annotations``): FastAPI reads the
dependencies of the route functions, which are local to ``create_app``, from them.
"""

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request, Security
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefixserve import __version__
from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.server.config import ServerConfig
from prefixserve.server.errors import ApiError, install_error_handlers
from prefixserve.server.metrics import ServerMetrics
from prefixserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    StatusResponse,
    VersionResponse,
)
from prefixserve.server.serving import OpenAIServing

#: Largest request body accepted, in bytes (a 413 beyond).
MAX_BODY_SIZE = 32 << 20

_DESCRIPTION = """\
An OpenAI-compatible server for the prefixserve engine, built around automatic prefix caching.
Every response reports in `usage.prompt_tokens_details.cached_tokens` how many prompt tokens
came from the prefix cache. Errors have the OpenAI shape `{"error": {"message", "type", "param",
"code"}}`."""

AuthDependency = Callable[..., Coroutine[Any, Any, str | None]]


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


def _stream_doc(chunk: type) -> dict[str, Any]:
    """The 200 response of a generation route: JSON, or with ``stream`` server-sent events,
    each described (as OpenAPI 3.1 does without ``itemSchema``) by the schema of one event."""
    data = (f"A {chunk.__name__} as JSON; an `ErrorResponse` as JSON if generation fails after "
            "the stream started; `[DONE]` last.")
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": data},
                            "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer"}}}
    return {"description": f"The response, or with `stream` server-sent events: `data: <"
            f"{chunk.__name__}>` lines, then `data: [DONE]`.",
            "content": {"text/event-stream": {"schema": event}}}


def make_auth(api_keys: tuple[str, ...]) -> AuthDependency:
    """A dependency that returns the caller's API key, or raises a 401 when keys are set and
    the request carries none of them. Without keys it accepts everyone (and returns None)."""
    if not api_keys:
        async def open_access() -> str | None:
            return None

        return open_access

    bearer = HTTPBearer(auto_error=False, description="One of the server's API keys.")
    encoded = [key.encode("utf-8") for key in api_keys]

    async def check_key(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
    ) -> str | None:
        if credentials is None:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer "
                           "<key>'", code="missing_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        given = credentials.credentials.encode("utf-8")
        if not any([hmac.compare_digest(given, key) for key in encoded]):  # no early exit
            raise ApiError(401, "invalid API key", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return credentials.credentials

    return check_key


def create_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The server's application. It owns ``engine``: its lifespan ends by shutting it down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="prefixserve", version=__version__, description=_DESCRIPTION,
                  lifespan=lifespan, max_body_size=MAX_BODY_SIZE)
    install_error_handlers(app)
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(engine, config, metrics)
    ApiKey = Annotated[str | None, Depends(make_auth(config.api_keys))]
    started = int(time.time())
    guarded: dict[int | str, dict[str, Any]] = (
        {401: _error("Missing or wrong API key.")} if config.api_keys else {})
    generation_errors: dict[int | str, dict[str, Any]] = {
        400: _error("Invalid request: bad JSON, wrong types or values, unknown model, prompt "
                    "too long for the context..."),
        **guarded,
        503: _error("The waiting queue is full (retry after `Retry-After` seconds) or the "
                    "engine is shutting down."),
    }

    @app.post("/v1/completions", response_model=CompletionResponse, tags=["OpenAI"],
              responses={200: _stream_doc(CompletionResponse), **generation_errors})
    async def completions(body: CompletionRequest, request: Request,
                          api_key: ApiKey) -> Response | CompletionResponse:
        """Continues a prompt (a string, token ids, or a batch of either)."""
        return await serving.create_completion(body, request, api_key)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, tags=["OpenAI"],
              responses={200: _stream_doc(ChatCompletionChunk), **generation_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               api_key: ApiKey,
                               ) -> Response | ChatCompletionResponse:
        """Writes the assistant's next message of a conversation."""
        return await serving.create_chat_completion(body, request, api_key)

    @app.get("/v1/models", response_model=ModelList, tags=["OpenAI"], responses=guarded)
    async def models(api_key: ApiKey) -> ModelList:
        """The served model, once per served name."""
        return ModelList(data=[
            ModelCard(id=name, created=started, root=name,
                      max_model_len=serving.max_model_len)
            for name in config.served_model_names])

    @app.post("/reset_prefix_cache", response_model=StatusResponse, tags=["Operations"],
              responses={**guarded, 409: _error("Requests are running; try again when idle.")})
    async def reset_prefix_cache(api_key: ApiKey) -> StatusResponse:
        """Empties the prefix cache (its counters are kept); refused while requests run."""
        stats = engine.stats()
        if stats.num_running or stats.num_waiting or not await engine.reset_prefix_cache():
            raise ApiError(409, "cannot reset the prefix cache while requests are running; "
                           "try again when the server is idle", code="requests_running")
        return StatusResponse(status="reset")

    @app.get("/health", response_model=StatusResponse, tags=["Operations"],
             responses={503: _error("The engine has stopped.")})
    async def health() -> StatusResponse:
        """200 while the engine runs."""
        if not engine.is_running:
            raise ApiError(503, "the engine has stopped", code="engine_unavailable")
        return StatusResponse(status="ok")

    @app.get("/version", response_model=VersionResponse, tags=["Operations"])
    async def version() -> VersionResponse:
        """The prefixserve version."""
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=PlainTextResponse, tags=["Operations"])
    async def prometheus_metrics() -> Response:
        """Prometheus metrics, all named ``prefixserve:...``."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            for path_item in schema["paths"].values():
                for operation in path_item.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                model = schemas[name]["properties"]["model"]
                model["anyOf"][0]["enum"] = list(config.served_model_names)
            chunk = ChatCompletionChunk.model_json_schema(
                ref_template="#/components/schemas/{model}", mode="serialization")
            for name, definition in chunk.pop("$defs", {}).items():
                schemas.setdefault(name, definition)
            schemas["ChatCompletionChunk"] = chunk
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
