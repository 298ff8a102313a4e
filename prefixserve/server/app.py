"""The FastAPI application: routes, authentication, errors, metrics and the OpenAPI document.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (these need
``Authorization: Bearer <key>`` when the server has API keys); ``POST /reset_prefix_cache``, an
admin action (an admin key is needed once the server has any key: a tenant's key gets 403);
``GET /metrics`` (open unless the server has metrics keys; an admin key works too); and
``GET /health``, ``GET /version`` (always open). ``/openapi.json``
describes exactly what each route accepts and answers (see :mod:`prefixserve.server.openapi`):
FastAPI's 422 is never sent (validation errors are 400s), so it is not documented either.

:func:`create_app` builds the app, installs the error handlers and transport guards, declares
the routes (:func:`_add_openai_routes`, :func:`_add_operation_routes`) and installs the OpenAPI
document.

Annotations here are evaluated (no ``from __future__ import annotations``): FastAPI reads the
dependencies of the route functions, which are local to the ``_add_..._routes`` functions,
from them.
"""

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Request, Security
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefixserve import __version__
from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.server.admin.kv_event_routes import add_kv_event_routes
from prefixserve.server.admin.kv_event_zmq import install_kv_event_publisher
from prefixserve.server.admin.lora_routes import LoRACollector, add_lora_routes
from prefixserve.server.admin.pin_routes import add_pin_routes
from prefixserve.server.anthropic.routes import add_anthropic_routes
from prefixserve.server.anthropic.serving import AnthropicServing
from prefixserve.server.config import ServerConfig
from prefixserve.server.console.routes import add_console_routes
from prefixserve.server.errors import ApiError, install_error_handlers
from prefixserve.server.metrics import ServerMetrics
from prefixserve.server.openai.agent_routes import add_agent_routes
from prefixserve.server.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    StatusResponse,
    VersionResponse,
)
from prefixserve.server.openai.serving import OpenAIServing
from prefixserve.server.openapi import ErrorDocs, error_doc, install_openapi, stream_doc
from prefixserve.server.transport import install_transport_guards

_DESCRIPTION = """\
An OpenAI-compatible server for the prefixserve engine, built around automatic prefix caching.
Every response reports in `usage.prompt_tokens_details.cached_tokens` how many prompt tokens
came from the prefix cache. Errors have the OpenAI shape `{"error": {"message", "type", "param",
"code"}}`."""

AuthDependency = Callable[..., Coroutine[Any, Any, str | None]]


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


@dataclass(frozen=True)
class KeyParameters:
    """The types of the route parameters that check a key: each is ``Annotated[str | None,
    Depends(<a make_auth dependency>)]``, and a route with a parameter of that type answers 401
    or 403 as :func:`make_auth` says, or gets the caller's key.

    ``api``: an API key (open without API keys). ``admin``: an admin key; API and metrics keys
    get 403 (open while admin actions are not protected). ``metrics``: a metrics or admin key;
    API keys get 403 (open without metrics keys).
    """

    api: Any
    admin: Any
    metrics: Any

    @classmethod
    def for_config(cls, config: ServerConfig) -> "KeyParameters":
        """The key checks of a server with ``config``."""
        api = make_auth(config.api_keys)
        admin = make_auth(config.admin_keys, what="admin key",
                          other_keys=config.api_keys + config.metrics_keys,
                          protected=config.admin_protected)
        metrics = make_auth(config.metrics_keys + config.admin_keys, what="metrics key",
                            other_keys=config.api_keys, protected=bool(config.metrics_keys))
        return cls(api=Annotated[str | None, Depends(api)],
                   admin=Annotated[str | None, Depends(admin)],
                   metrics=Annotated[str | None, Depends(metrics)])


#: The 200 of ``/metrics``: Prometheus' text format (its errors are JSON, as every route's).
_PROMETHEUS_DOC: dict[str, Any] = {
    "description": "Prometheus metrics in the text exposition format.",
    "content": {"text/plain": {"schema": {"type": "string"}}}}


def create_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The server's application. It owns ``engine``: its lifespan ends by shutting it down."""
    app = FastAPI(title="prefixserve", version=__version__, description=_DESCRIPTION,
                  lifespan=_shutting_down(engine), redirect_slashes=False)
    install_error_handlers(app)
    install_transport_guards(app, config)
    metrics = ServerMetrics(engine, config.served_model_names[0], config.metrics_prefix)
    serving = OpenAIServing(engine, config, metrics)
    keys = KeyParameters.for_config(config)
    docs = ErrorDocs.for_config(config)
    _add_openai_routes(app, serving, config, keys, docs)
    add_agent_routes(app, serving, config, keys.api, docs)
    _add_operation_routes(app, engine, metrics, keys, docs)
    add_pin_routes(app, engine, keys.admin, docs, serving.cache_salt)
    add_anthropic_routes(app, AnthropicServing(serving, engine.block_size), config, docs)
    if engine.lora_enabled:
        add_lora_routes(app, engine, config, keys.admin, docs)
        metrics.registry.register(LoRACollector(engine, config.served_model_names[0],
                                                config.metrics_prefix))
    add_kv_event_routes(app, engine, keys.admin, docs.admin)
    add_console_routes(app, engine, config, page=config.console)
    if config.kv_events_zmq:
        install_kv_event_publisher(app, engine, config.kv_events_zmq)
    install_openapi(app, config)
    return app


def _shutting_down(engine: AsyncLLM,
                   ) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """A lifespan that does nothing at startup and shuts ``engine`` down (in a thread) at the
    end."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.shutdown)

    return lifespan


def _add_openai_routes(app: FastAPI, serving: OpenAIServing, config: ServerConfig,
                       keys: KeyParameters, docs: ErrorDocs) -> None:
    """Declares ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/models``
    (in that order), each behind an API key."""
    if TYPE_CHECKING:  # a route gets the caller's key; FastAPI reads the dependency below
        ApiKey = str | None
    else:
        ApiKey = keys.api
    started = int(time.time())

    @app.post("/v1/completions", response_model=CompletionResponse, tags=["OpenAI"],
              responses={200: stream_doc(CompletionResponse), **docs.generation})
    async def completions(body: CompletionRequest, request: Request, response: Response,
                          api_key: ApiKey) -> Response | CompletionResponse:
        """Continues a prompt (a string, token ids, or a batch of either)."""
        return await serving.create_completion(body, request, api_key, response)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, tags=["OpenAI"],
              responses={200: stream_doc(ChatCompletionChunk), **docs.generation})
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               response: Response, api_key: ApiKey,
                               ) -> Response | ChatCompletionResponse:
        """Writes the assistant's next message of a conversation."""
        return await serving.create_chat_completion(body, request, api_key, response)

    @app.get("/v1/models", response_model=ModelList, tags=["OpenAI"], responses=docs.guarded)
    async def models(api_key: ApiKey) -> ModelList:
        """The served model, once per served name, then each LoRA adapter (with its base as
        ``parent``)."""
        base = config.served_model_names[0]
        return ModelList(data=[
            ModelCard(id=name, created=started, root=name,
                      max_model_len=serving.max_model_len)
            for name in config.served_model_names] + [
            ModelCard(id=info.name, created=started, root=info.lora_id, parent=base,
                      max_model_len=serving.max_model_len)
            for info in serving.engine.lora_adapters])


def _add_operation_routes(app: FastAPI, engine: AsyncLLM, metrics: ServerMetrics,
                          keys: KeyParameters, docs: ErrorDocs) -> None:
    """Declares ``POST /reset_prefix_cache`` (an admin action), ``GET /health``,
    ``GET /version`` (open) and ``GET /metrics`` (behind a metrics key), in that order."""
    if TYPE_CHECKING:  # a route gets the caller's key; FastAPI reads the dependencies below
        AdminKey = str | None
        MetricsKey = str | None
    else:
        AdminKey, MetricsKey = keys.admin, keys.metrics

    @app.post("/reset_prefix_cache", response_model=StatusResponse, tags=["Operations"],
              responses=docs.admin)
    async def reset_prefix_cache(admin_key: AdminKey, keep_pins: bool = False
                                 ) -> StatusResponse:
        """Empties the prefix cache (its counters are kept), also while requests run: blocks
        they hold stop being findable and return to the pool uncached. Pins are released too
        unless ``?keep_pins=true``. An admin action."""
        await engine.reset_prefix_cache(keep_pins=keep_pins)
        return StatusResponse(status="reset")

    @app.get("/health", response_model=StatusResponse, tags=["Operations"],
             responses={503: error_doc("The engine has stopped.")})
    async def health() -> StatusResponse:
        """200 while the engine runs."""
        if not engine.is_running:
            raise ApiError(503, "the engine has stopped", code="engine_unavailable")
        return StatusResponse(status="ok")

    @app.get("/version", response_model=VersionResponse, tags=["Operations"])
    async def version() -> VersionResponse:
        """The prefixserve version."""
        return VersionResponse(version=__version__)

    @app.get("/metrics", tags=["Operations"], response_class=Response,
             responses={200: _PROMETHEUS_DOC, **docs.metrics})
    async def prometheus_metrics(metrics_key: MetricsKey) -> Response:
        """Prometheus metrics, named ``prefixserve:...`` (or ``vllm:...``); needs a metrics
        or admin key when the server has metrics keys."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
