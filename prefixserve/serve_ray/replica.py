"""One engine replica of the Ray Serve deployment: the whole prefixserve HTTP application over an
``AsyncLLM``, driven in-process through ASGI, plus the replica's KV events.

The ingress forwards each HTTP request (method, path, query, headers, body) to ``handle_http``,
which runs it through the same FastAPI application ``prefixserve serve`` runs, so every route,
error shape, key check and limit is the single server's. The response comes back as a stream:
first ``{"status", "headers"}``, then body chunks (bytes).

``record_routing_stats`` is Ray Serve's periodic call (``request_routing_stats_period_s``): its
result reaches every request router of the deployment as ``RunningReplica.routing_stats``. It
carries this replica's KV event stream (docs/replicas.md item 6): the epoch, the last sequence
number, the wall time before its events were read (``at``: a router's memory of what it routed
here ends with the first report after the request finished, ``prefixserve.router.routed``), the
batches kept since ``STATS_BATCHES`` reports ago and, every ``SNAPSHOT_EVERY``
reports, a snapshot for routers that found a gap; also the process id (operators' view, ``GET
/router/replicas``) and the LoRA adapters served (name -> content id, which the ingress folds
into the prompt's block hashes as the core does).

Each replica also keeps the LoRA loads and unloads it took at run time (``adapter_requests``):
a restarted ingress reads them back, so that replicas started after it still get them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

STATS_BATCHES = 16
"""Event batches repeated in each routing-stats report, 8 s of them at one report per 0.5 s: a
router that misses a few reports still gets every batch; one that misses more resyncs from the
snapshot of every ``SNAPSHOT_EVERY`` reports."""

SNAPSHOT_EVERY = 8
"""Reports between two snapshots in the routing stats."""


class EngineReplica:
    """The engine replica's deployment class (``serve.deployment`` is applied by ``app``)."""

    def __init__(self, args: dict[str, Any]) -> None:
        from prefixserve.engine.async_llm import AsyncLLM
        from prefixserve.server.app import create_app
        from prefixserve.server.launch import engine_config, server_config

        namespace = argparse.Namespace(**args)
        self.engine = AsyncLLM(engine_config(namespace))
        self.app = create_app(self.engine, server_config(namespace))
        self.replica_id = _replica_id()
        self.epoch = ""
        self._reports = 0
        self._reported_seq = 0
        self._adapter_requests: dict[str, dict[str, Any]] = {}
        """Adapter name -> the latest run-time load or unload this replica took, as forwarded."""

    async def ready(self) -> str:
        """This replica's id, once its KV events are on."""
        if not self.epoch:
            self.epoch = await self.engine.enable_kv_events(self.replica_id, history=1024)
        return self.replica_id

    async def handle_http(self, request: dict[str, Any], route: dict[str, Any] | None = None,
                          replica: str | None = None) -> AsyncIterator[Any]:
        """Runs one forwarded HTTP request through the application; yields the start, then the
        body chunks. ``route`` and ``replica`` are for the request router (unused here)."""
        await self.ready()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        body: bytes = request["body"]
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # never: the client stays until cancelled
            raise AssertionError("unreachable")

        async def send(message: MutableMapping[str, Any]) -> None:
            await queue.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": request["method"], "scheme": "http", "path": request["path"],
                 "raw_path": request["path"].encode(), "root_path": "",
                 "query_string": request["query"].encode(),
                 "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                             for k, v in request["headers"]],
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            async for item in _drain(queue, task):
                if isinstance(item, dict) and item["status"] < 400:
                    self._took(request)
                yield item
        finally:
            if not task.done():
                task.cancel()

    def _took(self, request: dict[str, Any]) -> None:
        """Remembers a run-time LoRA load or unload the application accepted."""
        if request["method"] != "POST" or not request["path"].endswith("_lora_adapter"):
            return
        from prefixserve.serve_ray.ingress import LORA_ADMIN_PATHS

        if request["path"] not in LORA_ADMIN_PATHS:
            return
        try:
            name = json.loads(request["body"]).get("lora_name")
        except (ValueError, AttributeError):
            return
        self._adapter_requests.pop(str(name), None)  # the latest last
        self._adapter_requests[str(name)] = request

    async def adapter_requests(self, replica: str | None = None) -> dict[str, dict[str, Any]]:
        """The run-time LoRA loads and unloads this replica took, the latest per adapter name,
        in the order taken, as forwarded (``replica`` pins the call for the request router)."""
        return dict(self._adapter_requests)

    async def lora_ids(self) -> dict[str, str]:
        """The adapters served: name -> content id."""
        return {a.name: a.lora_id for a in self.engine.lora_adapters}

    async def record_routing_stats(self) -> dict[str, Any]:
        """This replica's KV event stream for the request routers (see the module docstring)."""
        await self.ready()
        after = max(0, self._reported_seq - STATS_BATCHES)
        at = time.time()  # the events read below include everything stored before this
        epoch, seq, batches = await self.engine.kv_events(after)
        stats: dict[str, Any] = {"replica": self.replica_id, "epoch": epoch, "seq": seq,
                                 "report": self._reports, "at": at, "pid": os.getpid(),
                                 "loras": await self.lora_ids(),
                                 "batches": [b.to_wire() for b in batches or []]}
        if batches is None or self._reports % SNAPSHOT_EVERY == 0:
            stats["snapshot"] = (await self.engine.kv_snapshot()).to_wire()
        self._reports += 1
        self._reported_seq = seq
        return stats

    async def check_health(self) -> None:
        """Ray Serve's health check: a stopped engine gets the replica restarted."""
        if not self.engine.is_running:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5.0)


async def _drain(queue: asyncio.Queue[Any], task: asyncio.Future[Any]) -> AsyncIterator[Any]:
    """ASGI messages from ``queue`` as the stream ``handle_http`` yields, until the body ends."""
    while True:
        getter = asyncio.ensure_future(queue.get())
        done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if getter not in done:
            getter.cancel()
            task.result()  # raises what the application raised
            return
        message = getter.result()
        if message["type"] == "http.response.start":
            yield {"status": message["status"],
                   "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                               for k, v in message.get("headers", [])]}
        elif message["type"] == "http.response.body":
            if message.get("body"):
                yield bytes(message["body"])
            if not message.get("more_body", False):
                return


def _replica_id() -> str:
    """Ray Serve's id of this replica (the process id outside Ray)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a replica
        return f"pid-{os.getpid()}"
