"""The engine's LoRA adapters: names, the model's adapter slots, admission, per-adapter counts.

:class:`LoRARegistry` knows every loaded adapter by its served name (several names may hold the
same weights: they share one content id, one slot and one cache namespace) and which adapter
sits in each of the model's ``max_loras`` slots (:class:`~prefixserve.model.arch.lora.LoRAModel`).

Admission (the scheduler's gate, :meth:`LoRARegistry.may_admit`): a waiting request under an
adapter is admitted only once its adapter is in a slot. A resident adapter is used as it is;
otherwise it takes an empty slot, or the least recently used slot that no running request
uses (its weights are copied in: a swap). When every slot is used by running requests, the
request stays where it is in the queue and the scheduler goes on with the requests behind it,
so base-model traffic (and traffic of resident adapters) is never blocked by an adapter that
must wait. Invariants: an adapter that a running request uses is never swapped out; an adapter
is removed only when no request (running or waiting) uses it.

Counts (:meth:`LoRARegistry.admitted`): prompt tokens looked up and found in the prefix cache
per adapter id (None: the base model), at each admission (a preempted request that comes back
is looked up, and counted, again), leaving out prompt-logprob requests as the core does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from prefixserve.engine.errors import RequestError
from prefixserve.engine.request import Request
from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.lora import (
    LoRAAdapter,
    LoRAError,
    LoRAModel,
    load_adapter,
    validate_adapter,
)

__all__ = ["LoRACacheCounts", "LoRAInUseError", "LoRAInfo", "LoRARegistry"]


class LoRAInUseError(RequestError):
    """An adapter cannot be removed while requests use it."""


@dataclass
class LoRACacheCounts:
    """Prompt tokens looked up in the prefix cache (``queries``) and found there (``hits``)
    under one adapter, and the requests admitted."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class LoRAInfo:
    """What callers may know of a loaded adapter (never its path)."""

    name: str
    lora_id: str
    rank: int


class LoRARegistry:
    """Adapters by name, slots by adapter id, and per-adapter cache counts."""

    def __init__(self, lora: LoRAModel, model_config: ModelConfig) -> None:
        self.lora = lora
        self.model_config = model_config
        self.adapters: dict[str, LoRAAdapter] = {}
        self._slot_ids: list[str | None] = [None] * lora.max_loras
        self._slot_of: dict[str, int] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()  # resident ids, oldest first
        self.counts: dict[str | None, LoRACacheCounts] = {}
        self.num_swaps = 0

    # ------------------------------------------------------------------ names
    def add(self, name: str, path: str) -> LoRAInfo:
        """Loads and validates the adapter at ``path`` under ``name``; ``LoRAError`` (a
        ``ValueError``) when it cannot be used or the name is taken."""
        if not name or name in self.adapters:
            raise LoRAError(f"an adapter named {name!r} is already loaded" if name
                            else "an adapter needs a name")
        adapter = load_adapter(path, name)
        validate_adapter(adapter, self.model_config, self.lora.max_rank)
        self.adapters[name] = adapter
        return self.info(name)

    def remove(self, name: str, in_use: set[str]) -> None:
        """Forgets ``name``; ``KeyError`` if unknown, ``LoRAInUseError`` while a request under
        its adapter (an id of ``in_use``) runs or waits. Its slot is emptied unless another
        name holds the same weights."""
        adapter = self.adapters[name]
        if adapter.lora_id in in_use:
            raise LoRAInUseError(f"the adapter {name!r} is in use by running or waiting "
                                 "requests; unload it when they have finished",
                                 code="lora_in_use", param="lora_name")
        del self.adapters[name]
        if any(a.lora_id == adapter.lora_id for a in self.adapters.values()):
            return
        slot = self._slot_of.pop(adapter.lora_id, None)
        self._recent.pop(adapter.lora_id, None)
        if slot is not None:
            self._slot_ids[slot] = None
            self.lora.load_slot(slot, None)

    def get(self, name: str) -> LoRAAdapter | None:
        return self.adapters.get(name)

    def info(self, name: str) -> LoRAInfo:
        adapter = self.adapters[name]
        return LoRAInfo(name, adapter.lora_id, adapter.rank)

    def infos(self) -> list[LoRAInfo]:
        return [self.info(name) for name in self.adapters]

    def name_of(self, lora_id: str | None) -> str | None:
        """The first name that holds the adapter ``lora_id`` (None if none does)."""
        return next((n for n, a in self.adapters.items() if a.lora_id == lora_id), None)

    # ------------------------------------------------------------------ slots
    def slot(self, lora_id: int | str | None) -> int | None:
        """The slot of a resident adapter (None for the base model or a plain cache key)."""
        return self._slot_of.get(lora_id) if isinstance(lora_id, str) else None

    def _adapter(self, lora_id: str) -> LoRAAdapter | None:
        return next((a for a in self.adapters.values() if a.lora_id == lora_id), None)

    def acquire(self, lora_id: str, busy: set[str]) -> int | None:
        """The slot of adapter ``lora_id``, swapping it in if needed (into an empty slot, else
        the least recently used one whose adapter is not in ``busy``); None when every slot is
        busy. Marks it most recently used."""
        slot = self._slot_of.get(lora_id)
        if slot is None:
            adapter = self._adapter(lora_id)
            if adapter is None:
                return None
            slot = self._free_slot(busy)
            if slot is None:
                return None
            self._slot_ids[slot] = lora_id
            self._slot_of[lora_id] = slot
            self.lora.load_slot(slot, adapter)
            self.num_swaps += 1
        self._recent[lora_id] = None
        self._recent.move_to_end(lora_id)
        return slot

    def _free_slot(self, busy: set[str]) -> int | None:
        if None in self._slot_ids:
            return self._slot_ids.index(None)
        victim = next((i for i in self._recent if i not in busy), None)
        if victim is None:
            return None
        slot = self._slot_of.pop(victim)
        del self._recent[victim]
        self._slot_ids[slot] = None
        return slot

    # ------------------------------------------------------------------ the scheduler's gate
    def may_admit(self, request: Request, running: list[Request]) -> bool:
        """Whether ``request`` may start now: always for the base model (or a cache key that
        names no adapter); for an adapter, once it holds a slot (see the module docstring)."""
        lora_id = request.lora_id
        if not isinstance(lora_id, str) or self._adapter(lora_id) is None:
            return True
        busy = {r.lora_id for r in running if isinstance(r.lora_id, str)}
        return self.acquire(lora_id, busy) is not None

    def admitted(self, request: Request, num_cached: int) -> None:
        """Counts an admission and its prefix-cache hits under the request's adapter."""
        if request.wants_prompt_logprobs:
            return
        lora_id = request.lora_id
        key = lora_id if isinstance(lora_id, str) and self._adapter(lora_id) else None
        counts = self.counts.get(key)
        if counts is None:
            counts = self.counts[key] = LoRACacheCounts()
        counts.requests += 1
        counts.queries += request.num_tokens
        counts.hits += num_cached
