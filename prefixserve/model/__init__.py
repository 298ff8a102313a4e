"""Model layer: configuration, tokenizer, weights loading, decoder model and paged-KV runner.

Names are resolved lazily (PEP 562) so that ``import prefixserve.model.tokenizer`` and
``prefixserve.model.config`` do not import torch; the torch-based names (``load_model``,
``ModelRunner``, ...) import their modules on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixserve.model.config import (
        ModelConfig,
        default_model_path,
        kv_cache_bytes_per_token,
    )
    from prefixserve.model.loader import load_model
    from prefixserve.model.runner import ExecuteOutput, ModelRunner, SeqBatchInput
    from prefixserve.model.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

_EXPORTS = {
    "ModelConfig": "config",
    "default_model_path": "config",
    "kv_cache_bytes_per_token": "config",
    "load_model": "loader",
    "ExecuteOutput": "runner",
    "ModelRunner": "runner",
    "SeqBatchInput": "runner",
    "IncrementalDetokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

__all__ = [
    "ExecuteOutput",
    "IncrementalDetokenizer",
    "ModelConfig",
    "ModelRunner",
    "SeqBatchInput",
    "Tokenizer",
    "default_model_path",
    "kv_cache_bytes_per_token",
    "load_model",
    "load_tokenizer",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
