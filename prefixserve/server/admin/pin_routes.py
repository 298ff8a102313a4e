"""The admin pin routes (see ``retention.py``). Annotations here are evaluated (no ``from
__future__ import annotations``): FastAPI reads the local key dependency from them."""

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.server.openai.protocol import StatusResponse
from prefixserve.server.openai.retention import PinService
from prefixserve.server.openai.retention_protocol import PinInfo, PinList, PinRequest
from prefixserve.server.openapi import ErrorDocs, ResponseDocs, error_doc

Handler = Callable[[Request, Exception], Awaitable[Response]]


def add_pin_routes(app: FastAPI, engine: AsyncLLM, admin_key: Any, docs: ErrorDocs,
                   salt: Callable[[str | None, str | None], str | None]) -> None:
    """Declares ``POST /v1/pins``, ``GET /v1/pins`` and ``DELETE /v1/pins/{pin_id}``, each an
    admin action (``admin_key`` is the admin-key parameter type of ``KeyParameters``; ``salt``
    the server's salt of a request's ``cache_salt`` and key, ``OpenAIServing.cache_salt``)."""
    service = PinService(engine, {})
    bad: ResponseDocs = {400: error_doc(
        "Invalid request: bad JSON or values, not exactly one prompt, over the pin budget "
        "(`pin_budget_exceeded`), a pin id in use...")}
    busy: ResponseDocs = {503: error_doc(
        "The waiting queue is full or the engine is shutting down.")}
    if TYPE_CHECKING:
        AdminKey = str | None
    else:
        AdminKey = admin_key

    @app.post("/v1/pins", response_model=PinInfo, tags=["Operations"],
              responses={**bad, **docs.admin, **busy})
    async def pin(body: PinRequest, key: AdminKey) -> PinInfo:
        """Computes a prefix and pins its full blocks until unpinned. An admin action."""
        return await service.pin(body, salt(body.cache_salt, body.for_api_key))

    @app.get("/v1/pins", response_model=PinList, tags=["Operations"], responses=docs.admin)
    async def pins(key: AdminKey) -> PinList:
        """The pins, with their blocks and tokens. An admin action."""
        return await service.list()

    @app.delete("/v1/pins/{pin_id}", response_model=StatusResponse, tags=["Operations"],
                responses={**docs.admin, 404: error_doc("No pin of that id.")})
    async def unpin(pin_id: str, key: AdminKey) -> StatusResponse:
        """Releases a pin. An admin action."""
        await service.unpin(pin_id)
        return StatusResponse(status="unpinned")

    _list_every_method_in_allow(app)


def _list_every_method_in_allow(app: FastAPI) -> None:
    """A 405 lists in ``Allow`` the methods of every route of the path (``/v1/pins`` has two;
    the router alone names only the first route's)."""
    original = cast(Handler, app.exception_handlers[HTTPException])

    async def with_allow(request: Request, exc: Exception) -> Response:
        response = await original(request, exc)
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            methods = sorted({method for route in app.routes if isinstance(route, APIRoute)
                              and route.path_regex.match(request.url.path)
                              for method in route.methods or ()})
            if methods:
                response.headers["allow"] = ", ".join(methods)
        return response

    app.add_exception_handler(HTTPException, with_allow)
