"""``POST /v1/responses``: the text-only subset of OpenAI's Responses API.

Supported: ``input`` as a string or as messages (``role`` and ``content``, a string or
``input_text`` / ``output_text`` parts), ``instructions`` (a system message before the input),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream`` and ``previous_response_id``.
Each answer is kept in memory (the conversation that led to it plus its text) for
``previous_response_id``, at most ``--max-stored-responses`` of them, oldest dropped first;
``store: false`` keeps nothing. A stored response belongs to the API key that created it (its
tenant, the SHA-256 of the key): another key gets the same 400 as an unknown id, so nothing
tells it that the id exists. The admin key has no rights over stored responses: it is no API
key (``/v1/responses`` answers it 401 whatever id it names), no route lists, reads or deletes
them, and they leave by age only; a key given both as ``--api-key`` and ``--admin-key`` is a
tenant like any other, with its own responses. A streamed answer sends ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per piece, then the ``.done`` events and ``response.completed``
(or ``response.incomplete`` when it hit ``max_output_tokens``). Tools, reasoning items and
other output types are not part of this subset (a 400 for unknown fields).

Annotations here are evaluated (no ``from __future__ import annotations``), as in ``app.py``.
"""

import hashlib
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from prefixserve.server.config import ServerConfig
from prefixserve.server.errors import ApiError, error_body, quote
from prefixserve.server.openai.protocol import ChatCompletionRequest, Text
from prefixserve.server.openai.serving import OpenAIServing, _Prompts, _Run
from prefixserve.server.openapi import ResponseDocs
from prefixserve.server.streams import (
    ClientDisconnectedError,
    EventStreamResponse,
    MultiStream,
    run_unless_disconnected,
)

_IGNORED = ("metadata", "user", "parallel_tool_calls", "truncation", "service_tier",
            "prompt_cache_key", "safety_identifier")


#: The 200 of ``/v1/responses``: a response object, or with ``stream`` its events.
_RESPONSE_DOC: dict[str, Any] = {
    "description": "A response object as JSON; with `stream`, server-sent `response.*` events.",
    "content": {"application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {
                    "type": "object", "required": ["data"],
                    "properties": {"event": {"type": "string", "description": "The event "
                                             "type (`response.created`, ...)."},
                                   "data": {"type": "string", "description": "The event as "
                                            "JSON, with the same `type`."}}}}}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class InputPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: list[Any] | None = None


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[InputPart]
    id: str | None = None
    status: str | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (text only)."""

    model: Text | None = None
    input: Text | list[InputMessage] = Field(min_length=1)
    instructions: Text | None = None
    previous_response_id: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


def _text(content: str | list[InputPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def owner_of(api_key: str | None) -> str | None:
    """The tenant a stored response belongs to: the SHA-256 of the caller's API key (None on a
    server without API keys, where every caller is the one tenant)."""
    return None if api_key is None else hashlib.sha256(api_key.encode("utf-8")).hexdigest()


class ResponseStore:
    """The conversations of the last ``limit`` responses, by response id (an LRU by age), each
    with the tenant that stored it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[str, tuple[str | None, list[dict[str, str]]]] = OrderedDict()

    def get(self, response_id: str, owner: str | None) -> list[dict[str, str]]:
        """The conversation of ``response_id``; another tenant's id answers as an unknown one."""
        item = self._items.get(response_id)
        if item is None or item[0] != owner:
            raise ApiError(400, f"previous_response_id: no stored response "
                           f"{quote(response_id)} (at most {self.limit} are kept)",
                           param="previous_response_id", code="previous_response_not_found")
        return list(item[1])

    def put(self, response_id: str, owner: str | None, messages: list[dict[str, str]]) -> None:
        if self.limit == 0:
            return
        self._items[response_id] = (owner, messages)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)


def _messages(body: ResponsesRequest, store: ResponseStore,
              owner: str | None) -> list[dict[str, str]]:
    """The conversation: the previous response's (if any, the caller's own), then the
    instructions (as a system message, first), then the input."""
    previous = body.previous_response_id
    if previous == "":
        raise ApiError(400, "previous_response_id: an empty id (leave the field out to start "
                       "a new conversation)", param="previous_response_id",
                       code="invalid_value")
    history = store.get(previous, owner) if previous is not None else []
    history = [m for m in history if m["role"] != "system"]
    new = ([{"role": "user", "content": body.input}] if isinstance(body.input, str) else
           [{"role": m.role, "content": _text(m.content)} for m in body.input])
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return system + history + new


class _Answer:
    """The response object being built (and its events' sequence numbers)."""

    def __init__(self, run: _Run, body: ResponsesRequest) -> None:
        self.run, self.body = run, body
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0
        self.text = ""
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> str:
        import json

        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def message(self, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": [self.part()] if status == "completed" or
                self.text else []}

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def response(self, status: str) -> dict[str, Any]:
        usage = self.run.prompts.usage(self.completion_tokens)
        done = status in ("completed", "incomplete")
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.run.model, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": self.body.instructions, "max_output_tokens":
            self.body.max_output_tokens, "output": [self.message("completed")] if done else [],
            "parallel_tool_calls": False, "previous_response_id": self.body.previous_response_id,
            "temperature": self.body.temperature, "top_p": self.body.top_p,
            "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}},
            "truncation": "disabled", "metadata": self.body.metadata or {},
            "store": self.body.store is not False,
            "usage": {"input_tokens": usage.prompt_tokens,
                      "input_tokens_details": {
                          "cached_tokens": usage.prompt_tokens_details.cached_tokens},
                      "output_tokens": usage.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage.total_tokens} if done else None}

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"


async def _consume(answer: _Answer, stream: MultiStream) -> AsyncGenerator[str, None]:
    """The text pieces of the single sequence of ``stream``."""
    try:
        async for _, output in stream:
            answer.run.prompts.note(0, output)
            for completion in output.outputs:
                answer.completion_tokens += len(completion.token_ids)
                answer.finish_reason = completion.finish_reason or answer.finish_reason
                if completion.text:
                    answer.text += completion.text
                    yield completion.text
    finally:
        await stream.aclose()


async def _events(answer: _Answer, stream: MultiStream,
                  done: Any) -> AsyncGenerator[str, None]:
    ids = {"item_id": answer.message_id, "output_index": 0}
    yield answer.event("response.created", response=answer.response("in_progress"))
    yield answer.event("response.in_progress", response=answer.response("in_progress"))
    yield answer.event("response.output_item.added", output_index=0,
                       item=answer.message("in_progress"))
    yield answer.event("response.content_part.added", **ids, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": []})
    try:
        async for piece in _consume(answer, stream):
            yield answer.event("response.output_text.delta", **ids, content_index=0,
                               delta=piece, logprobs=[])
    except Exception as exc:  # the status line is sent: report it as an event
        yield answer.event("error", **error_body(500, str(exc))["error"])
        return
    done(answer)
    yield answer.event("response.output_text.done", **ids, content_index=0,
                       text=answer.text, logprobs=[])
    yield answer.event("response.content_part.done", **ids, content_index=0,
                       part=answer.part())
    yield answer.event("response.output_item.done", output_index=0,
                       item=answer.message("completed"))
    yield answer.event(f"response.{answer.status}", response=answer.response(answer.status))


def add_responses_route(app: FastAPI, serving: OpenAIServing, config: ServerConfig,
                        api_key: Any, docs: ResponseDocs) -> None:
    """Declares ``POST /v1/responses`` behind ``api_key`` (``KeyParameters.api``)."""
    store = ResponseStore(config.max_stored_responses)
    if TYPE_CHECKING:
        ApiKey = str | None
    else:
        ApiKey = api_key

    @app.post("/v1/responses", tags=["OpenAI"], responses={200: _RESPONSE_DOC, **docs})
    async def responses(body: ResponsesRequest, request: Request, response: Response,
                        key: ApiKey) -> Any:
        """A model response to text or messages (the text-only subset of the Responses
        API)."""
        model = serving.resolve_model(body.model)
        owner = owner_of(key)
        messages = _messages(body, store, owner)
        chat = ChatCompletionRequest.model_validate(
            {"messages": messages, "max_completion_tokens": body.max_output_tokens,
             "temperature": body.temperature, "top_p": body.top_p})
        ids = await serving.checked_ids(lambda: serving.chat_prompt(chat),
                                        body.max_output_tokens, "input")
        params = serving.sampling_params(chat, max_tokens=body.max_output_tokens,
                                         logprobs=None, prompt_logprobs=None)
        run = serving._run("resp", model, _Prompts([ids]), params, chat, key, "input")
        answer = _Answer(run, body)

        def keep(done: _Answer) -> None:
            if body.store is not False:
                store.put(done.id, owner,
                          [*messages, {"role": "assistant", "content": done.text}])

        given = sorted(name for name in _IGNORED if name in body.model_fields_set)
        if given:
            response.headers["x-ignored-fields"] = ",".join(given)
        stream = await serving._start(run)
        if body.stream:
            events = EventStreamResponse(_events(answer, stream, keep), stream)
            for name, value in response.headers.items():
                if name.startswith("x-"):
                    events.headers[name] = value
            return events

        async def collect() -> dict[str, Any]:
            async for _ in _consume(answer, stream):
                pass
            keep(answer)
            return answer.response(answer.status)

        try:
            return await run_unless_disconnected(request, collect())
        except ClientDisconnectedError:
            await stream.aclose()
            return Response(status_code=499)
