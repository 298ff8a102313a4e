"""LoRA adapter routes and metrics: ``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``.

Both are admin actions (an admin key once the server has any key, as ``/reset_prefix_cache``),
declared only when the engine has LoRA slots (``--enable-lora`` or ``--lora-modules``), with
vLLM's bodies: ``{"lora_name": ..., "lora_path": ...}`` and ``{"lora_name": ...}``. Answers:
200 ``{"status": "loaded"|"unloaded", "lora_name", "lora_id"}``; 400 ``invalid_lora`` for an
adapter that cannot be used (unreadable, another base model, rank above ``--max-lora-rank``:
the message says which, and never names a path of the server), or a name that is taken (also
by the base model); 404 ``lora_not_found`` to unload a name that is not loaded; 409
``lora_in_use`` to unload an adapter that running or waiting requests use.

``LoRACollector`` exports, per adapter (label ``lora_name``; the base model is the served model
name), the prompt tokens looked up in the prefix cache and found there, and the requests
admitted: ``lora_prefix_cache_queries_total``, ``lora_prefix_cache_hits_total``,
``lora_requests_total`` (see ``engine/lora_registry.py``).
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.engine.lora_registry import LoRAInUseError
from prefixserve.model.arch.lora import LoRAError
from prefixserve.server.config import ServerConfig
from prefixserve.server.errors import ApiError, quote
from prefixserve.server.openapi import ErrorDocs, error_doc

MODEL_NAME_LABEL = "model_name"


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096,
                           description="A PEFT adapter directory or a GGUF LoRA file on the "
                           "server.")


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = Field(default=None, description="Accepted and ignored (vLLM).")


class LoRAStatus(BaseModel):
    status: str
    lora_name: str
    lora_id: str = Field(description="The adapter's content id: the same weights have the "
                         "same id on every server.")


def add_lora_routes(app: FastAPI, engine: AsyncLLM, config: ServerConfig, admin_key: Any,
                    docs: ErrorDocs) -> None:
    """Declares the two routes (behind ``admin_key``, a ``KeyParameters.admin`` type)."""
    if TYPE_CHECKING:
        AdminKey = str | None
    else:
        AdminKey = admin_key
    load_docs = {**docs.admin, 400: error_doc("The adapter cannot be used, or the name is "
                                              "taken (`invalid_lora`).")}
    unload_docs = {**docs.admin, 404: error_doc("No adapter of that name (`lora_not_found`)."),
                   409: error_doc("Requests use the adapter (`lora_in_use`).")}

    @app.post("/v1/load_lora_adapter", response_model=LoRAStatus, tags=["LoRA"],
              responses=load_docs)
    async def load_lora_adapter(body: LoadLoRARequest, key: AdminKey) -> LoRAStatus:
        """Loads a LoRA adapter to serve as ``model: lora_name``. An admin action."""
        if body.lora_name in config.served_model_names:
            raise ApiError(400, f"{quote(body.lora_name)} is the base model's name; give the "
                           "adapter another", param="lora_name", code="invalid_lora")
        try:
            info = await engine.add_lora(body.lora_name, body.lora_path)
        except LoRAError as exc:
            raise ApiError(400, str(exc), param="lora_path", code="invalid_lora") from exc
        return LoRAStatus(status="loaded", lora_name=info.name, lora_id=info.lora_id)

    @app.post("/v1/unload_lora_adapter", response_model=LoRAStatus, tags=["LoRA"],
              responses=unload_docs)
    async def unload_lora_adapter(body: UnloadLoRARequest, key: AdminKey) -> LoRAStatus:
        """Unloads a LoRA adapter that no request uses. An admin action."""
        known = {info.name: info for info in engine.lora_adapters}
        if body.lora_name not in known:
            raise ApiError(404, f"no LoRA adapter named {quote(body.lora_name)} is loaded",
                           param="lora_name", code="lora_not_found")
        try:
            await engine.remove_lora(body.lora_name)
        except LoRAInUseError as exc:
            raise ApiError(409, str(exc), param="lora_name", code="lora_in_use") from exc
        except KeyError as exc:  # unloaded meanwhile by another call
            raise ApiError(404, f"no LoRA adapter named {quote(body.lora_name)} is loaded",
                           param="lora_name", code="lora_not_found") from exc
        info = known[body.lora_name]
        return LoRAStatus(status="unloaded", lora_name=info.name, lora_id=info.lora_id)


class LoRACollector(Collector):
    """Per-adapter prefix-cache counters from the engine's latest stats, at each scrape."""

    def __init__(self, engine: AsyncLLM, model_name: str, prefix: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        counts = self.engine.stats().lora_cache
        families = (
            ("lora_prefix_cache_queries", "Prompt tokens looked up in the prefix cache, per "
             "LoRA adapter (the base model under the served model name).", "queries"),
            ("lora_prefix_cache_hits", "Prompt tokens found in the prefix cache, per LoRA "
             "adapter.", "hits"),
            ("lora_requests", "Sequences admitted, per LoRA adapter.", "requests"),
        )
        for name, documentation, attr in families:
            family = CounterMetricFamily(f"{self.prefix}:{name}", documentation,
                                         labels=[MODEL_NAME_LABEL, "lora_name"])
            for lora_name, value in sorted(counts.items()):
                family.add_metric([self.model_name, lora_name or self.model_name],
                                  getattr(value, attr))
            yield family
