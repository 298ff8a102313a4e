"""The admin pin routes (see ``retention.py``). Annotations here are evaluated (no ``from
__future__ import annotations``): FastAPI reads the local key dependency from them."""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.server.openapi import ErrorDocs
from prefixserve.server.protocol import StatusResponse
from prefixserve.server.retention import PinService
from prefixserve.server.retention_protocol import PinInfo, PinList, PinRequest


def add_pin_routes(app: FastAPI, engine: AsyncLLM, admin_key: Any, docs: ErrorDocs,
                   salt: Callable[[str | None, str | None], str | None]) -> None:
    """Declares ``POST /v1/pins``, ``GET /v1/pins`` and ``DELETE /v1/pins/{pin_id}``, each an
    admin action (``admin_key`` is the admin-key parameter type of ``KeyParameters``; ``salt``
    the server's salt of a request's ``cache_salt`` and key, ``OpenAIServing.cache_salt``)."""
    service = PinService(engine, {})
    if TYPE_CHECKING:
        AdminKey = str | None
    else:
        AdminKey = admin_key

    @app.post("/v1/pins", response_model=PinInfo, tags=["Operations"], responses=docs.admin)
    async def pin(body: PinRequest, key: AdminKey) -> PinInfo:
        """Computes a prefix and pins its full blocks until unpinned. An admin action."""
        return await service.pin(body, salt(body.cache_salt, body.for_api_key))

    @app.get("/v1/pins", response_model=PinList, tags=["Operations"], responses=docs.admin)
    async def pins(key: AdminKey) -> PinList:
        """The pins, with their blocks and tokens. An admin action."""
        return await service.list()

    @app.delete("/v1/pins/{pin_id}", response_model=StatusResponse, tags=["Operations"],
                responses=docs.admin)
    async def unpin(pin_id: str, key: AdminKey) -> StatusResponse:
        """Releases a pin. An admin action."""
        await service.unpin(pin_id)
        return StatusResponse(status="unpinned")
