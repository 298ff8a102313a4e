"""Model layer: configuration, tokenizer, weights loading, decoder model and paged-KV runner.

Names are resolved lazily (PEP 562) so that ``import prefixserve.model.text.tokenizer`` and
``prefixserve.model.arch.config`` do not import torch; the torch-based names (``load_model``,
``ModelRunner``, ...) import their modules on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixserve.model.arch.config import (
        ModelConfig,
        default_model_path,
        kv_cache_bytes_per_token,
    )
    from prefixserve.model.runner import ExecuteOutput, ModelRunner, SeqBatchInput
    from prefixserve.model.text.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
    from prefixserve.model.weights.loader import load_model

_EXPORTS = {
    "ModelConfig": "arch.config",
    "default_model_path": "arch.config",
    "kv_cache_bytes_per_token": "arch.config",
    "load_model": "weights.loader",
    "ExecuteOutput": "runner",
    "ModelRunner": "runner",
    "SeqBatchInput": "runner",
    "IncrementalDetokenizer": "text.tokenizer",
    "Tokenizer": "text.tokenizer",
    "load_tokenizer": "text.tokenizer",
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
