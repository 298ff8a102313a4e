"""Who looks at the console, and what of the cache board each may see.

Three kinds of viewer, from the caller's bearer key:

* **admin**: an admin key, or anyone on a server without keys (every route is open there).
  Sees everything: each namespace by name (``API key #2``, ``salt 'x'``, an adapter), the
  pool, the tiers, pins, the request log and the what-if.
* **operator**: a metrics key. Sees the pool-wide figures that ``/metrics`` shows, and the
  namespaces and prefixes without names.
* **tenant**: an API key. Sees its own namespaces only (those its key's salt made, named
  ``yours`` with its own ``cache_salt`` and adapter; with ``--share-cache-across-keys`` the
  namespaces of no salt, which every key shares) and their prefixes, and the pool's blocks by
  state, as ``/metrics`` does when open.

Names of namespaces never contain a key: a tenant's salt is the SHA-256 of its key, which the
console maps back to the key's position on the command line.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

from prefixserve.engine.cache_board import BoardView, Namespace
from prefixserve.engine.llm_engine import EngineStats
from prefixserve.server.config import ServerConfig
from prefixserve.server.errors import ApiError

ADMIN, OPERATOR, TENANT = "admin", "operator", "tenant"


@dataclass(frozen=True)
class Viewer:
    role: str
    tenant_salt: str | None = None
    """A tenant's own salt (the SHA-256 of its key) when keys salt the cache."""


def viewer_of(config: ServerConfig, key: str | None) -> Viewer:
    """The viewer a bearer ``key`` makes (401 for a missing or unknown key on a server with
    keys)."""
    if not config.admin_protected:
        return Viewer(ADMIN)
    if key is None:
        raise ApiError(401, "missing key: send the header 'Authorization: Bearer <key>'",
                       code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
    given = key.encode("utf-8")
    if _any(given, config.admin_keys):
        return Viewer(ADMIN)
    if _any(given, config.metrics_keys):
        return Viewer(OPERATOR)
    if _any(given, config.api_keys):
        salt = hashlib.sha256(given).hexdigest() if config.salt_by_api_key else None
        return Viewer(TENANT, salt)
    raise ApiError(401, "invalid key", code="invalid_api_key",
                   headers={"WWW-Authenticate": "Bearer"})


def _any(given: bytes, keys: tuple[str, ...]) -> bool:
    return any([hmac.compare_digest(given, k.encode("utf-8")) for k in keys])


def require_admin(viewer: Viewer) -> None:
    """403 unless ``viewer`` is an admin."""
    if viewer.role != ADMIN:
        raise ApiError(403, "this key may not do this: it needs an admin key",
                       code="permission_denied")


class NamespaceNames:
    """Display names of namespaces: the key's position for a tenant's salt, the client's salt,
    the adapter."""

    def __init__(self, config: ServerConfig) -> None:
        self._tenants = {hashlib.sha256(k.encode("utf-8")).hexdigest(): f"API key #{i + 1}"
                         for i, k in enumerate(config.api_keys)}

    def name(self, namespace: Namespace, owner: str | None = None) -> str:
        """The namespace's name; ``owner`` replaces the key's position (a tenant's "yours")."""
        salt, adapter = namespace
        parts = []
        if salt is None:
            parts.append(owner or "shared")
        else:
            tenant, _, client = salt.partition(":")
            if tenant in self._tenants:
                parts.append(owner or self._tenants[tenant])
                if client:
                    parts.append(f"salt {client!r}")
            else:
                parts.append(f"salt {salt!r}")
        if adapter is not None:
            parts.append(f"adapter {adapter}")
        return ", ".join(parts)


def _visible(viewer: Viewer, namespace: Namespace) -> bool:
    if viewer.role != TENANT:
        return True
    salt = namespace[0]
    if viewer.tenant_salt is None:  # keys share the cache: its shared namespaces, not the
        return salt is None         # ones other clients' cache_salt made
    return salt is not None and (salt == viewer.tenant_salt
                                 or salt.startswith(viewer.tenant_salt + ":"))


def view_json(viewer: Viewer, view: BoardView, stats: EngineStats,
              names: NamespaceNames) -> dict[str, Any]:
    """The cache view a viewer may see, as JSON data (the console's ``/v1/cache/view``)."""
    visible = {ns: c for ns, c in view.namespaces.items() if _visible(viewer, ns)}
    labels = {ns: (names.name(ns) if viewer.role == ADMIN else
                   names.name(ns, owner="yours") if viewer.role == TENANT
                   else f"namespace {i + 1}")
              for i, ns in enumerate(sorted(visible, key=repr))}
    out: dict[str, Any] = {
        "role": viewer.role, "time": time.time(), "block_size": view.block_size,
        "blocks": {"total": view.total_blocks, "running": view.running_blocks,
                   "cached": view.cached_blocks, "empty": view.empty_blocks,
                   "pinned": view.pinned_blocks},
        "namespaces": [{"name": labels[ns], "blocks": c.blocks, "sequences": c.sequences,
                        "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens}
                       for ns, c in sorted(visible.items(), key=lambda i: -i[1].blocks)],
        "prefixes": [{"hash": f"{p.hash_id:016x}", "tokens": p.num_tokens, "hits": p.hits,
                      "last_use": p.last_use, "namespace": labels[p.namespace],
                      "held_by": "KV cache" if p.in_pool else (
                          p.source if p.source != "pool" else "evicted")}
                     for p in view.prefixes if p.namespace in labels],
    }
    mine = list(visible.values())
    out["counters"] = {"query_tokens": sum(c.prompt_tokens for c in mine),
                       "hit_tokens": sum(c.cached_tokens for c in mine),
                       "queries": sum(c.prompt_blocks for c in mine),
                       "hits": sum(c.cached_blocks for c in mine),
                       "sequences": sum(c.sequences for c in mine)}
    if viewer.role != TENANT:
        out["counters"].update(_pool_counters(stats))
        out["tiers"] = [{"name": t.name, "up": t.up, "writable": t.writable,
                         "hit_blocks": t.hit_blocks, "stored_blocks": t.stored_blocks,
                         "miss_blocks": t.miss_blocks, "errors": t.errors}
                        for t in stats.kv_tiers]
        out["logged_requests"] = view.logged_requests
    return out


def _pool_counters(stats: EngineStats) -> dict[str, Any]:
    """The engine's counters since start, as ``/metrics`` exports them."""
    return {"query_tokens": stats.prefix_cache_query_tokens,
            "hit_tokens": stats.prefix_cache_hit_tokens,
            "queries": stats.prefix_cache_queries, "hits": stats.prefix_cache_hits,
            "evictions": sum((stats.evictions_by_priority or {}).values()),
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "running": stats.num_running, "waiting": stats.num_waiting,
            "retained_hits": sum((stats.retained_hits or {}).values())}
