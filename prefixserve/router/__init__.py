"""Cache-aware routing over replicas: the per-replica cache index fed by KV events, the routing
policies and the prompt hashing a router needs (docs/replicas.md).

Pure Python over ``prefixserve.core``: no engine, no model, no Ray, so the estimator's simulation
and the Ray deployment route with the same code."""

from prefixserve.router.index import CacheIndex, ReplicaCache
from prefixserve.router.policy import ROUTING_POLICIES, RouteDecision, Router, RouteRequest
from prefixserve.router.prompt_hash import PromptHasher

__all__ = ["ROUTING_POLICIES", "CacheIndex", "PromptHasher", "ReplicaCache", "RouteDecision",
           "RouteRequest", "Router"]
