"""The console's routes: the page at ``/`` (unless ``--no-ui``) and the JSON it reads.

* ``GET /`` and ``GET /console/{asset}``: the page and its script and style, from the package
  (no CDN, nothing fetched from elsewhere).
* ``GET /v1/cache/view``: the cache board as the caller may see it (``viewer.py``).
* ``GET /v1/cache/requests``: the request log as a mooncake trace (JSON lines), an admin action.
* ``GET /v1/cache/what_if``: the estimator on that log (``what_if.py``), an admin action.

The page calls these and the OpenAI routes with the key its user types in; it has no access of
its own. Annotations here are evaluated (no ``from __future__ import annotations``): FastAPI
reads the key dependency from them.
"""

import json
from importlib import resources
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Security
from fastapi.responses import HTMLResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.server.config import ServerConfig
from prefixserve.server.console.viewer import (
    NamespaceNames,
    Viewer,
    require_admin,
    view_json,
    viewer_of,
)
from prefixserve.server.console.what_if import WhatIf
from prefixserve.server.errors import ApiError
from prefixserve.server.openapi import ResponseDocs, error_doc

#: The page's files and their media types; nothing else is served from the package.
ASSETS = {"console.js": "text/javascript; charset=utf-8",
          "console.css": "text/css; charset=utf-8"}


def read_asset(name: str) -> str:
    """A file of the page, from the package."""
    return resources.files("prefixserve.server.console").joinpath("assets", name).read_text(
        encoding="utf-8")


def add_console_routes(app: FastAPI, engine: AsyncLLM, config: ServerConfig,
                       page: bool = True) -> None:
    """Declares the console's JSON routes and, with ``page``, the page itself."""
    bearer = HTTPBearer(auto_error=False, description="An API, metrics or admin key.")
    names = NamespaceNames(config)
    what_if = WhatIf(engine.block_size, engine.num_kv_blocks)
    keyed: ResponseDocs = ({401: error_doc("Missing or wrong key.")}
                           if config.admin_protected else {})
    admin: ResponseDocs = ({**keyed, 403: error_doc("The key is not an admin key.")}
                           if config.admin_protected else {})
    bad_query: ResponseDocs = {400: error_doc("A query parameter out of its range.")}

    async def viewer(credentials: Annotated[HTTPAuthorizationCredentials | None,
                                            Security(bearer)]) -> Viewer:
        return viewer_of(config, None if credentials is None else credentials.credentials)

    Who = Annotated[Viewer, Depends(viewer)]

    @app.get("/v1/cache/view", tags=["Console"], responses={**keyed, **bad_query})
    async def cache_view(who: Who, top: Annotated[int, Query(ge=1, le=200)] = 20,
                         ) -> dict[str, Any]:
        """The prefix cache now: blocks by state, namespaces, the ``top`` hottest prefixes
        (hash ids, never text), counters; a tenant sees its own namespaces, an admin all."""
        board = await engine.cache_view(top)
        return view_json(who, board, engine.stats(), names)

    @app.get("/v1/cache/requests", tags=["Console"], response_class=Response,
             responses={200: {"description": "JSON lines: a mooncake trace.",
                              "content": {"application/jsonl": {"schema": {"type": "string"}}}},
                        **admin})
    async def request_log(who: Who) -> Response:
        """The recent requests as a mooncake trace (block hash ids and lengths, no text), the
        input of ``prefixserve estimate``. An admin action."""
        require_admin(who)
        lines = [json.dumps(r, separators=(",", ":")) for r in await engine.request_log()]
        return Response("".join(line + "\n" for line in lines), media_type="application/jsonl")

    @app.get("/v1/cache/what_if", tags=["Console"], responses={
        **admin, **bad_query, 500: error_doc("The estimator failed."),
        503: error_doc("The estimator took too long.")})
    async def cache_what_if(who: Who, replicas: Annotated[int, Query(ge=2, le=16)] = 4,
                            tier_blocks: Annotated[int | None, Query(ge=1)] = None,
                            ) -> dict[str, Any]:
        """The hit rate the recent requests would have had with 0.5x-4x the KV memory, with a
        disk tier of ``tier_blocks`` (default 8x the pool) and over ``replicas`` replicas:
        ``prefixserve estimate`` on ``/v1/cache/requests``. An admin action."""
        require_admin(who)
        log = await engine.request_log()
        return await what_if.answer(log, tier_blocks or 8 * engine.num_kv_blocks, replicas)

    if page:
        _add_page(app)


def _add_page(app: FastAPI) -> None:
    index = read_asset("index.html")
    assets = {name: read_asset(name) for name in ASSETS}

    @app.get("/", include_in_schema=False)
    async def console_page() -> HTMLResponse:
        return HTMLResponse(index, headers={"Cache-Control": "no-cache"})

    @app.get("/console/{name}", include_in_schema=False)
    async def console_asset(name: str) -> Response:
        if name not in assets:
            raise ApiError(404, f"no console file {name!r}", code="not_found")
        return Response(assets[name], media_type=ASSETS[name],
                        headers={"Cache-Control": "no-cache"})
