"""Every error the engine raises to its callers (``LLMEngine``, ``AsyncLLM``, ``LLM``).

The server answers each with a status code of its own: ``RequestError`` with a 400 (its
``code`` and ``param`` are those of the OpenAI error body), ``QueueFullError`` with a 503 and
``Retry-After``, ``EngineDeadError`` with a 503.
"""

from __future__ import annotations

__all__ = ["EngineDeadError", "QueueFullError", "RequestError"]


class RequestError(ValueError):
    """A request the engine cannot run as given (too long, bad ids...): the caller's fault.

    ``code`` is the error's OpenAI code (``invalid_prompt``, ``context_length_exceeded``);
    ``param`` names the request field at fault when it is not the prompt (``max_tokens``), and
    is None when it is the prompt, which the caller names as it received it."""

    def __init__(self, message: str, *, code: str = "invalid_prompt",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``; try again later."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped."""
