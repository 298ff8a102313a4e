"""Explicit prompt caching over HTTP: the ``retention`` request field and the admin pin routes.

``retention`` (on ``/v1/completions`` and ``/v1/chat/completions``) is either a whole-prompt
``{"priority": 80, "duration": 300}`` or TensorRT-LLM-style token ranges
``{"ranges": [{"start": 0, "end": 2048, "priority": 90, "duration": 600}]}``. A duration is in
seconds, counted from each release of the blocks (a hit refreshes it), and at most
``--max-retention-duration``; HTTP requests cannot ask for retention without expiry (pins are
for that, and need an admin key).

Admin routes (an admin key once the server has any key): ``POST /v1/pins`` pins a prefix
(``prompt`` text, ``messages`` rendered by the chat template without a generation prompt, or
``prompt_token_ids``) under an ``id``; ``GET /v1/pins`` lists the pins with their blocks and
tokens; ``DELETE /v1/pins/{id}`` releases one. Pins survive ``/reset_prefix_cache`` only with
``{"keep_pins": true}``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from prefixserve.core import Retention, RetentionRange
from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.engine.errors import QueueFullError, RequestError
from prefixserve.server.errors import ApiError, quote
from prefixserve.server.openai.retention_protocol import PinInfo, PinList, PinRequest, RetentionSpec


def to_retention(spec: RetentionSpec | None, max_duration: float) -> Retention | None:
    """The engine's ``Retention`` of a request's ``retention`` field; a 400 naming what is
    wrong."""
    if spec is None:
        return None
    if spec.ranges is not None:
        if spec.priority is not None or spec.duration is not None:
            raise _bad("give either priority and duration or ranges, not both")
        ranges = [(r.start, r.end, r.priority, r.duration) for r in spec.ranges]
    elif spec.priority is None or spec.duration is None:
        raise _bad("retention needs priority and duration (or ranges)")
    else:
        ranges = [(0, None, spec.priority, spec.duration)]
    too_long = [d for *_, d in ranges if d > max_duration]
    if too_long:
        raise _bad(f"a retention duration of {too_long[0]:g} s is longer than the "
                   f"{max_duration:g} s allowed (--max-retention-duration)")
    try:
        return Retention(tuple(RetentionRange(*r) for r in ranges))
    except ValueError as exc:
        raise _bad(str(exc)) from exc


def _bad(message: str) -> ApiError:
    return ApiError(400, message, param="retention", code="invalid_retention")


@dataclass
class PinService:
    """Runs the pin routes over an ``AsyncLLM``; remembers each pin's token count."""

    engine: AsyncLLM
    tokens: dict[str, int]

    def prompt_ids(self, body: PinRequest) -> list[int]:
        given = [x for x in (body.prompt, body.messages, body.prompt_token_ids) if x is not None]
        if len(given) != 1:
            raise ApiError(400, "give exactly one of prompt, messages, prompt_token_ids",
                           param="prompt", code="invalid_value")
        tokenizer = self.engine.tokenizer
        if body.prompt is not None:
            return tokenizer.encode(body.prompt)
        if body.messages is not None:
            try:
                ids = tokenizer.apply_chat_template(body.messages, add_generation_prompt=False)
            except Exception as exc:  # the template's own errors, any kind
                raise ApiError(400, f"the chat template cannot render these messages: {exc}",
                               param="messages", code="invalid_messages") from exc
            assert isinstance(ids, list)
            return ids
        assert body.prompt_token_ids is not None
        return list(body.prompt_token_ids)

    async def pin(self, body: PinRequest, salt: str | None) -> PinInfo:
        ids = self.prompt_ids(body)
        pin_id = body.id or f"pin-{uuid.uuid4().hex[:12]}"
        try:
            blocks = await self.engine.pin_prefix(pin_id, ids, cache_salt=salt)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param or "prompt", code=exc.code) from exc
        except QueueFullError as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry later",
                           code="queue_full") from exc
        self.tokens[pin_id] = len(ids)
        return PinInfo(id=pin_id, num_blocks=blocks, num_tokens=len(ids))

    async def list(self) -> PinList:
        pins = await self.engine.pins()
        for gone in set(self.tokens) - set(pins):
            del self.tokens[gone]
        data = [PinInfo(id=p, num_blocks=n, num_tokens=self.tokens.get(p, 0))
                for p, n in sorted(pins.items())]
        return PinList(data=data, num_pinned_blocks=self.engine.stats().num_pinned_blocks)

    async def unpin(self, pin_id: str) -> None:
        if not await self.engine.unpin(pin_id):
            raise ApiError(404, f"no pin named {quote(pin_id)}", code="pin_not_found")
        self.tokens.pop(pin_id, None)

