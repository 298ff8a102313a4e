"""The engine: requests, the scheduler, the engine loop, and the ``LLM`` / ``AsyncLLM`` APIs."""

from prefixserve.engine.config import EngineConfig
from prefixserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "EngineConfig", "RequestMetrics", "RequestOutput"]
