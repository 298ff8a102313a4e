"""prefixserve: an LLM inference engine built around automatic prefix caching.

Importing this package stays cheap and torch-free: ``prefixserve.core`` can be used without
PyTorch installed. ``LLM`` and ``SamplingParams`` are loaded on first access.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from prefixserve.engine.llm import LLM
    from prefixserve.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from prefixserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from prefixserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
