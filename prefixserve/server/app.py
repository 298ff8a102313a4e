"""The FastAPI application: routes, authentication, errors, metrics and the OpenAPI document.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (these need
``Authorization: Bearer <key>`` when the server has API keys); ``POST /reset_prefix_cache``, an
admin action (an admin key is needed once the server has any key: a tenant's key gets 403);
``GET /metrics`` (open unless the server has metrics keys; an admin key works too); and
``GET /health``, ``GET /version`` (always open). ``/openapi.json``
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
from prefixserve.server.transport import install_transport_guards

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


def make_auth(keys: tuple[str, ...], *, what: str = "API key",
              other_keys: tuple[str, ...] = (), protected: bool | None = None,
              ) -> AuthDependency:
    """A dependency that returns the caller's key, or raises: 401 when ``keys`` are needed and
    the request carries none of them (``missing_api_key`` / ``invalid_api_key``), 403 when it
    carries one of ``other_keys`` (a valid key, without this right). Without ``keys`` (and
    unless ``protected``) it accepts everyone and returns None; ``protected`` with no ``keys``
    refuses everyone (admin actions on a server with API keys but no admin key)."""
    protected = bool(keys) if protected is None else protected
    if not protected:
        async def open_access() -> str | None:
            return None

        return open_access

    bearer = HTTPBearer(auto_error=False, description=f"An {what} of the server.")
    encoded = [key.encode("utf-8") for key in keys]
    others = [key.encode("utf-8") for key in other_keys]
    challenge = {"WWW-Authenticate": "Bearer"}

    async def check_key(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
    ) -> str | None:
        if credentials is None:
            raise ApiError(401, f"missing {what}: send the header 'Authorization: Bearer "
                           "<key>'", code="missing_api_key", headers=challenge)
        given = credentials.credentials.encode("utf-8")
        if _matches(given, encoded):
            return credentials.credentials
        if _matches(given, others):
            raise ApiError(403, f"this key may not do this: it needs an {what}",
                           code="permission_denied")
        raise ApiError(401, f"invalid {what}", code="invalid_api_key", headers=challenge)

    return check_key


def _matches(given: bytes, keys: list[bytes]) -> bool:
    """Whether ``given`` is one of ``keys``, compared in constant time (no early exit)."""
    return any([hmac.compare_digest(given, key) for key in keys])


def create_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The server's application. It owns ``engine``: its lifespan ends by shutting it down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="prefixserve", version=__version__, description=_DESCRIPTION,
                  lifespan=lifespan, redirect_slashes=False)
    install_error_handlers(app)
    install_transport_guards(app, config)
    metrics = ServerMetrics(engine, config.served_model_names[0], config.metrics_prefix)
    serving = OpenAIServing(engine, config, metrics)
    ApiKey = Annotated[str | None, Depends(make_auth(config.api_keys))]
    AdminKey = Annotated[str | None, Depends(make_auth(
        config.admin_keys, what="admin key", other_keys=config.api_keys + config.metrics_keys,
        protected=config.admin_protected))]
    MetricsKey = Annotated[str | None, Depends(make_auth(
        config.metrics_keys + config.admin_keys, what="metrics key",
        other_keys=config.api_keys, protected=bool(config.metrics_keys)))]
    started = int(time.time())
    guarded: dict[int | str, dict[str, Any]] = (
        {401: _error("Missing or wrong API key.")} if config.api_keys else {})
    admin_errors: dict[int | str, dict[str, Any]] = (
        {401: _error("Missing or wrong admin key."),
         403: _error("The key is not an admin key.")} if config.admin_protected else {})
    metrics_errors: dict[int | str, dict[str, Any]] = (
        {401: _error("Missing or wrong metrics key."),
         403: _error("The key is not a metrics or admin key.")} if config.metrics_keys else {})
    generation_errors: dict[int | str, dict[str, Any]] = {
        400: _error("Invalid request: bad JSON, wrong types or values, a field not supported, "
                    "over a per-request limit, prompt too long for the context..."),
        **guarded,
        404: _error("The model is not served here (`model_not_found`)."),
        503: _error("The waiting queue is full (retry after `Retry-After` seconds) or the "
                    "engine is shutting down."),
    }

    @app.post("/v1/completions", response_model=CompletionResponse, tags=["OpenAI"],
              responses={200: _stream_doc(CompletionResponse), **generation_errors})
    async def completions(body: CompletionRequest, request: Request, response: Response,
                          api_key: ApiKey) -> Response | CompletionResponse:
        """Continues a prompt (a string, token ids, or a batch of either)."""
        return await serving.create_completion(body, request, api_key, response)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, tags=["OpenAI"],
              responses={200: _stream_doc(ChatCompletionChunk), **generation_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               response: Response, api_key: ApiKey,
                               ) -> Response | ChatCompletionResponse:
        """Writes the assistant's next message of a conversation."""
        return await serving.create_chat_completion(body, request, api_key, response)

    @app.get("/v1/models", response_model=ModelList, tags=["OpenAI"], responses=guarded)
    async def models(api_key: ApiKey) -> ModelList:
        """The served model, once per served name."""
        return ModelList(data=[
            ModelCard(id=name, created=started, root=name,
                      max_model_len=serving.max_model_len)
            for name in config.served_model_names])

    @app.post("/reset_prefix_cache", response_model=StatusResponse, tags=["Operations"],
              responses=admin_errors)
    async def reset_prefix_cache(admin_key: AdminKey) -> StatusResponse:
        """Empties the prefix cache (its counters are kept), also while requests run: blocks
        they hold stop being findable and return to the pool uncached. An admin action."""
        await engine.reset_prefix_cache()
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

    @app.get("/metrics", response_class=PlainTextResponse, tags=["Operations"],
             responses=metrics_errors)
    async def prometheus_metrics(metrics_key: MetricsKey) -> Response:
        """Prometheus metrics, named ``prefixserve:...`` (or ``vllm:...``); needs a metrics
        or admin key when the server has metrics keys."""
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
