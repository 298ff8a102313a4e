"""Anthropic's Messages API over the same engine and the same prefix cache.

``POST /v1/messages`` renders ``system`` and ``messages`` (text content blocks) with the model's
chat template and generates the assistant's reply, whole or as Anthropic's server-sent events
(``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``). ``POST /v1/messages/count_tokens``
counts the prompt's tokens. Keys come in ``x-api-key`` (or ``Authorization: Bearer``); errors
have Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``.

**cache_control.** A text block (of ``system`` or of a message) with ``cache_control:
{"type": "ephemeral", "ttl": "5m" | "1h"}`` is a breakpoint: the prompt's tokens up to the end
of that block get a retention of ``CACHE_CONTROL_PRIORITY`` for the TTL (counted from each use,
so refreshed on every hit). At most four breakpoints. Usage reports
``cache_read_input_tokens`` (prompt tokens served from the prefix cache, implicit hits
included), ``cache_creation_input_tokens`` (tokens of the full blocks up to the last breakpoint
that were not read, so were written now) and ``input_tokens`` (the rest); the three add up to
the prompt's length, which is what ``count_tokens`` returns.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.core import Retention, RetentionRange
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams
from prefixserve.server.anthropic_protocol import (
    MAX_BREAKPOINTS,
    TTL_SECONDS,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    TextBlock,
    TextOut,
    Usage,
)
from prefixserve.server.errors import ApiError, AsciiJSONResponse
from prefixserve.server.serving import OpenAIServing, _Prompts, _Run
from prefixserve.server.streams import (
    ClientDisconnectedError,
    EventStreamResponse,
    MultiStream,
    run_unless_disconnected,
)

CACHE_CONTROL_PRIORITY = 80
"""The retention priority of a ``cache_control`` breakpoint (the default is 35)."""

_SENTINEL = "\ue000\ue001"  # private-use characters: marks a breakpoint while rendering
_PATH = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}


def _blocks(content: str | list[TextBlock] | None) -> list[TextBlock]:
    if content is None:
        return []
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    return content


class AnthropicPrompt:
    """The token ids of a request's conversation and the token count up to each breakpoint."""

    def __init__(self, serving: OpenAIServing, body: CountTokensRequest) -> None:
        self.serving = serving
        self.body = body
        self.system = _blocks(body.system)
        self.turns = [(m.role, _blocks(m.content)) for m in body.messages]
        auto = getattr(body, "cache_control", None)
        if auto is not None and self.turns[-1][1]:  # automatic caching: the last block
            last = self.turns[-1][1][-1]
            self.turns[-1][1][-1] = last.model_copy(update={"cache_control": auto})
        self.text = self._render(None)
        self.ids = serving.tokenizer.encode(self.text, add_special_tokens=False)
        self.breakpoints = self._breakpoints()

    def _messages(self, mark: TextBlock | None) -> list[dict[str, str]]:
        def join(blocks: list[TextBlock]) -> str:
            return "\n".join(b.text + (_SENTINEL if b is mark else "") for b in blocks)

        out = [{"role": "system", "content": join(self.system)}] if self.system else []
        return out + [{"role": role, "content": join(blocks)} for role, blocks in self.turns]

    def _render(self, mark: TextBlock | None) -> str:
        if self.turns[-1][0] != "user":
            raise ApiError(400, "the last message must have the user role (a final assistant "
                           "message, a prefill, is not supported here)")
        try:
            text = self.serving.tokenizer.apply_chat_template(
                self._messages(mark), add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template's own errors, of any kind
            raise ApiError(400, f"the chat template cannot render these messages: {exc}"
                           ) from exc
        assert isinstance(text, str)
        return text

    def _marked(self) -> list[tuple[TextBlock, float]]:
        """The breakpoint blocks and their TTLs in seconds; a 400 for a bad one."""
        marked = []
        for where, blocks in [("system", self.system)] + [
                (f"messages.{i}", b) for i, (_, b) in enumerate(self.turns)]:
            for j, block in enumerate(blocks):
                if block.cache_control is None:
                    continue
                ttl = block.cache_control.ttl or "5m"
                if ttl not in TTL_SECONDS:
                    raise ApiError(400, f"{where}.content.{j}.cache_control.ttl: {ttl!r} is not "
                                   "a supported TTL; use \"5m\" or \"1h\"")
                if not block.text:
                    raise ApiError(400, f"{where}.content.{j}: cache_control cannot be set on "
                                   "an empty text block")
                marked.append((block, TTL_SECONDS[ttl]))
        if len(marked) > MAX_BREAKPOINTS:
            raise ApiError(400, f"a request may have at most {MAX_BREAKPOINTS} blocks with "
                           f"cache_control, this one has {len(marked)}")
        return marked

    def _breakpoints(self) -> list[tuple[int, float]]:
        """(tokens up to the end of the block, TTL) per breakpoint: the longest run of the
        prompt's ids that the text up to the block's end tokenizes to."""
        out = []
        encode = self.serving.tokenizer.encode
        for block, ttl in self._marked():
            marked = self._render(block)
            cut = marked.find(_SENTINEL)
            if cut < 0 or marked.replace(_SENTINEL, "") != self.text:
                raise ApiError(400, "cache_control cannot be placed here: the chat template "
                               "changes the block's text")
            prefix = encode(self.text[:cut], add_special_tokens=False)
            n = 0
            while n < min(len(prefix), len(self.ids)) and prefix[n] == self.ids[n]:
                n += 1
            out.append((n, ttl))
        return out

    def retention(self, max_duration: float) -> Retention | None:
        if not self.breakpoints:
            return None
        if any(ttl > max_duration for _, ttl in self.breakpoints):
            raise ApiError(400, f"a cache_control ttl is longer than the {max_duration:g} s "
                           "this server allows (--max-retention-duration)")
        return Retention(tuple(RetentionRange(0, n, CACHE_CONTROL_PRIORITY, ttl)
                               for n, ttl in self.breakpoints if n > 0))

    def usage(self, cached: int, output_tokens: int, block_size: int) -> Usage:
        last = max((n for n, _ in self.breakpoints), default=0)
        created = max(0, last // block_size * block_size - cached)
        return Usage(input_tokens=len(self.ids) - cached - created, output_tokens=output_tokens,
                     cache_creation_input_tokens=created, cache_read_input_tokens=cached)


def _stop(output: Any) -> tuple[str | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished completion."""
    if output is None:
        return "end_turn", None
    if output.finish_reason == "length":
        return "max_tokens", None
    if isinstance(output.stop_reason, str):
        return "stop_sequence", output.stop_reason
    return "end_turn", None


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"


class AnthropicServing:
    """Serves the Messages API with the checks, salts, metrics and engine access of an
    ``OpenAIServing``."""

    def __init__(self, serving: OpenAIServing, block_size: int) -> None:
        self.serving = serving
        self.block_size = block_size

    def count_tokens(self, body: CountTokensRequest) -> CountTokensResponse:
        self.serving.resolve_model(body.model)
        return CountTokensResponse(input_tokens=len(AnthropicPrompt(self.serving, body).ids))

    def _params(self, body: MessagesRequest) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0, stop=body.stop_sequences, max_tokens=body.max_tokens)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    async def create_message(self, body: MessagesRequest, request: Request,
                             api_key: str | None) -> Response | MessageResponse:
        serving = self.serving
        model = serving.resolve_model(body.model)
        prompt = AnthropicPrompt(serving, body)
        serving.check_prompt(prompt.ids, body.max_tokens, "messages")
        run = _Run(id=f"msg_{uuid.uuid4().hex}", model=model, prompts=_Prompts([prompt.ids]),
                   params=self._params(body), salt=serving.cache_salt(None, api_key),
                   param="messages", include_usage=False,
                   retention=prompt.retention(serving.config.max_retention_duration))
        try:
            stream = await run_unless_disconnected(request, serving._start(run))
            if body.stream:
                return EventStreamResponse(self._events(run, prompt, stream), stream)
            return await run_unless_disconnected(request, self._whole(run, prompt, stream))
        except ClientDisconnectedError:
            return Response(status_code=499)

    async def _whole(self, run: _Run, prompt: AnthropicPrompt,
                     stream: MultiStream) -> MessageResponse:
        text: list[str] = []
        tokens = 0
        last: Any = None
        try:
            async for _, output in stream:
                run.prompts.note(0, output)
                for c in output.outputs:
                    text.append(c.text)
                    tokens += len(c.token_ids)
                    last = c
        finally:
            await stream.aclose()
        stop_reason, stop_sequence = _stop(last)
        return MessageResponse(
            id=run.id, model=run.model, content=[TextOut(text="".join(text))],
            stop_reason=stop_reason, stop_sequence=stop_sequence,
            usage=prompt.usage(run.prompts.cached_tokens[0], tokens, self.block_size))

    async def _events(self, run: _Run, prompt: AnthropicPrompt,
                      stream: MultiStream) -> AsyncGenerator[str, None]:
        tokens = 0
        started = False
        last: Any = None
        try:
            async for _, output in stream:
                if not started:
                    started = True
                    yield self._message_start(run, prompt, output)
                    yield _event("content_block_start", {
                        "index": 0, "content_block": {"type": "text", "text": ""}})
                    yield _event("ping", {})
                for c in output.outputs:
                    tokens += len(c.token_ids)
                    last = c
                    if c.text:
                        yield _event("content_block_delta", {
                            "index": 0, "delta": {"type": "text_delta", "text": c.text}})
        except Exception as exc:  # the status is sent already: report it as an event
            yield _event("error", {"error": {"type": "api_error",
                                             "message": f"generation failed: {exc}"}})
            return
        stop_reason, stop_sequence = _stop(last)
        yield _event("content_block_stop", {"index": 0})
        yield _event("message_delta", {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": tokens}})
        yield _event("message_stop", {})

    def _message_start(self, run: _Run, prompt: AnthropicPrompt, first: RequestOutput) -> str:
        usage = prompt.usage(first.num_cached_tokens, 0, self.block_size)
        return _event("message_start", {"message": {
            "id": run.id, "type": "message", "role": "assistant", "model": run.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage.model_dump()}})


def anthropic_error(status: int, message: str) -> JSONResponse:
    """An error response in Anthropic's shape (a full queue, 503 elsewhere, is a 529)."""
    kind = _ERROR_TYPES.get(status, "api_error")
    return AsciiJSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                             status_code=status)


Handler = Callable[[Request, Exception], Awaitable[Response]]


def install_anthropic_errors(app: FastAPI) -> None:
    """Wraps the app's error handlers so that errors under ``/v1/messages`` get Anthropic's
    shape, and every other route keeps OpenAI's. Call after ``install_error_handlers``."""
    for kind, handler in list(app.exception_handlers.items()):
        app.add_exception_handler(kind, _reshaped(cast(Handler, handler)))


def _reshaped(handler: Handler) -> Handler:
    async def reshape(request: Request, exc: Exception) -> Response:
        response = await handler(request, exc)
        if not request.url.path.startswith(_PATH):
            return response
        body = json.loads(bytes(response.body))
        error = body.get("error", {})
        status = response.status_code
        if status == 503 and error.get("code") == "queue_full":
            status = 529
        reshaped = anthropic_error(status, str(error.get("message", "error")))
        for name, value in response.headers.items():
            if name.lower() in ("retry-after", "www-authenticate", "allow"):
                reshaped.headers[name] = value
        return reshaped

    return reshape
