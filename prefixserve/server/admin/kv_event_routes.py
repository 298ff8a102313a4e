"""``GET /kv_events``: the prefix cache's KV events for a router outside the server (pull).

``GET /kv_events?epoch=E&after=N`` answers ``{"epoch", "seq", "batches": [...]}`` with the batches
after sequence number ``N`` of epoch ``E`` (docs/replicas.md item 2 gives their JSON form), and
adds ``"snapshot"`` (every cached hash value as of ``seq``) when the consumer must resync: on its
first call (no ``epoch``), after a restart (another epoch) or when batches it needs are no longer
kept. Events are switched on by the first call, so a server nobody asks pays nothing; a snapshot
then starts the stream. An admin action (the values name the cached prompts' blocks).

Annotations are evaluated (no ``from __future__ import annotations``): FastAPI reads them.
"""

from typing import Any

from fastapi import FastAPI, Query

from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.server.openapi import ResponseDocs, error_doc

REPLICA_ID = "server"
"""The replica id a single server publishes under."""


def add_kv_event_routes(app: FastAPI, engine: AsyncLLM, admin_key: Any,
                        admin_docs: ResponseDocs) -> None:
    """Declares ``GET /kv_events`` behind ``admin_key`` (the app's admin-key parameter type)."""

    responses: ResponseDocs = {400: error_doc("A query parameter is invalid."), **admin_docs}

    @app.get("/kv_events", tags=["Operations"], responses=responses)
    async def kv_events(admin_key: admin_key,
                        epoch: str | None = Query(None, max_length=64),
                        after: int = Query(0, ge=0)) -> dict[str, Any]:
        """The prefix cache's KV events after ``after`` (with a snapshot when needed). An admin
        action."""
        current = await engine.enable_kv_events(REPLICA_ID)
        _, seq, batches = await engine.kv_events(after if epoch == current else 0)
        body: dict[str, Any] = {"epoch": current, "seq": seq,
                                "batches": [b.to_wire() for b in batches or []]}
        if epoch != current or batches is None:
            snapshot = await engine.kv_snapshot()
            body["snapshot"] = snapshot.to_wire()
            body["batches"] = [b for b in body["batches"] if b["seq"] > snapshot.seq]
        return body
