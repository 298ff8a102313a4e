"""What the agent-facing part adds to the app: ``/tokenize``, ``/detokenize``,
``/v1/responses`` and CORS (``--allowed-origins``; off by default, so no browser page of
another origin can call the API)."""

from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from prefixserve.server.config import ServerConfig
from prefixserve.server.openai.responses import add_responses_route
from prefixserve.server.openai.serving import OpenAIServing
from prefixserve.server.openai.tokenize_routes import add_tokenize_routes
from prefixserve.server.openapi import ErrorDocs


def add_agent_routes(app: FastAPI, serving: OpenAIServing, config: ServerConfig,
                     api_key: Any, docs: ErrorDocs) -> None:
    """Declares the routes above (behind ``api_key``, ``KeyParameters.api``) and installs CORS
    when origins are allowed."""
    add_tokenize_routes(app, serving, api_key, {**docs.guarded, 400: docs.generation[400],
                                                404: docs.generation[404]})
    add_responses_route(app, serving, config, api_key, docs.generation)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                           expose_headers=["x-ignored-fields"], max_age=600)
