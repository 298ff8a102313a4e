"""Anthropic's Messages API over the same engine and the same prefix cache.

``POST /v1/messages`` renders ``system`` and ``messages`` (text content blocks, and ``image``
blocks for a model that takes images: each one its image token, ``server/media.py``) with the
model's chat template and generates the assistant's reply, whole or as Anthropic's server-sent
events (``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``). ``POST /v1/messages/count_tokens``
counts the prompt's tokens. Keys come in ``x-api-key`` (or ``Authorization: Bearer``); errors
have Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``.

**cache_control.** A block (a tool, a text block of ``system`` or of a message, a
``tool_result`` or a ``tool_use``) with ``cache_control: {"type": "ephemeral", "ttl": "5m" |
"1h"}`` is a breakpoint: the prompt's tokens up to the end of that block (of a ``tool_use``:
of its assistant turn) get a retention of ``CACHE_CONTROL_PRIORITY`` for the TTL (counted
from each use, so refreshed on every hit). At most four breakpoints. Usage reports
``cache_read_input_tokens`` (prompt tokens served from the prefix cache, implicit hits
included), ``cache_creation_input_tokens`` (tokens of the full blocks up to the last breakpoint
that were not read, so were written now) and ``input_tokens`` (the rest); the three add up to
the prompt's length, which is what ``count_tokens`` returns.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.core import Retention, RetentionRange
from prefixserve.core.retention import CACHE_CONTROL_PRIORITY
from prefixserve.engine.multimodal import PlacedImages
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams
from prefixserve.server.anthropic.protocol import (
    MAX_BREAKPOINTS,
    TTL_SECONDS,
    Base64ImageSource,
    CountTokensRequest,
    CountTokensResponse,
    ImageBlock,
    MessageResponse,
    MessagesRequest,
    TextBlock,
    TextOut,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
)
from prefixserve.server.anthropic.tools import (
    SENTINEL,
    common_length,
    conversation,
    tool_calling,
    tool_cut,
    tool_use_blocks,
    with_tools_ending_at,
)
from prefixserve.server.errors import ApiError, AsciiJSONResponse, quote
from prefixserve.server.openai.serving import OpenAIServing, _Prompts, _Run
from prefixserve.server.openai.tool_calls import ToolCalling, ToolCallStream
from prefixserve.server.streams import (
    ClientDisconnectedError,
    EventStreamResponse,
    MultiStream,
    run_unless_disconnected,
)

#: Where errors take Anthropic's shape.
ANTHROPIC_PATH = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}


def _blocks(content: str | list[Any] | None) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    return list(content)


class AnthropicPrompt:
    """The token ids of a request's conversation (tools included) and the token count up to
    each breakpoint."""

    def __init__(self, serving: OpenAIServing, body: CountTokensRequest) -> None:
        self.serving = serving
        self.body = body
        self.system = _blocks(body.system)
        self.collector = serving.image_collector()
        self.turns = [(m.role, self._image_tokens(i, m.role, _blocks(m.content)))
                      for i, m in enumerate(body.messages)]
        self.tools = list(body.tools or [])
        auto = getattr(body, "cache_control", None)
        if auto is not None and self.turns[-1][1]:  # automatic caching: the last block
            last = self.turns[-1][1][-1]
            self.turns[-1][1][-1] = last.model_copy(update={"cache_control": auto})
        self.calling = tool_calling(body, serving.tokenizer.chat_template,
                                    serving.config.max_json_schema_depth)
        self.text = self._render(None)
        self.ids = serving.tokenizer.encode(self.text, add_special_tokens=False)
        self.breakpoints = self._breakpoints()
        self.ids, self.images = serving.place_images(self.ids, self.collector)
        if self.images is not None:
            self.breakpoints = [(_expanded(n, self.images), ttl) for n, ttl in self.breakpoints]

    def _image_tokens(self, index: int, role: str, blocks: list[Any]) -> list[Any]:
        """A user turn's blocks with each image block as a text block of the image token
        (its image decoded by the collector; its ``cache_control`` kept)."""
        if role != "user":
            return blocks
        out = []
        for j, block in enumerate(blocks):
            if isinstance(block, ImageBlock):
                where, source = f"messages.{index}.content.{j}", block.source
                token = (self.collector.base64(where, source.media_type, source.data)
                         if isinstance(source, Base64ImageSource)
                         else self.collector.url(where, source.url))
                block = TextBlock(type="text", text=token, cache_control=block.cache_control)
            out.append(block)
        return out

    def _render(self, mark: object, calling: ToolCalling | None = None) -> str:
        if self.turns[-1][0] != "user":
            raise ApiError(400, "the last message must have the user role (a final assistant "
                           "message, a prefill, is not supported here)")
        return self._template(self.turns, mark, calling or self.calling, True)

    def _template(self, turns: Sequence[tuple[str, list[Any]]], mark: object,
                  calling: ToolCalling | None, generation_prompt: bool) -> str:
        """``turns`` rendered by the chat template, with ``SENTINEL`` after ``mark``."""
        rendered = conversation(self.system, turns, mark)
        messages = [turn.item() for turn in rendered]
        variables: dict[str, Any] = {}
        if calling is not None:
            messages, variables = calling.messages(messages, rendered)
        try:
            text = self.serving.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False, **variables)
        except Exception as exc:  # the template's own errors, of any kind
            raise ApiError(400, f"the chat template cannot render these messages: {exc}"
                           ) from exc
        assert isinstance(text, str)
        return text

    def _marked(self) -> list[tuple[str, Any, float]]:
        """Where each breakpoint is, its block and its TTL in seconds, in prompt order (tools,
        system, messages); a 400 for a bad one."""
        places: list[tuple[str, Any]] = [(f"tools.{i}", t) for i, t in enumerate(self.tools)]
        places += [(f"system.{j}", b) for j, b in enumerate(self.system)]
        for i, (_, blocks) in enumerate(self.turns):
            for j, b in enumerate(blocks):
                places.append((f"messages.{i}.content.{j}", b))
                if isinstance(b, ToolResultBlock) and isinstance(b.content, list):
                    places += [(f"messages.{i}.content.{j}.content.{k}", inner)
                               for k, inner in enumerate(b.content)]
        marked = []
        for where, block in places:
            if block.cache_control is None:
                continue
            ttl = block.cache_control.ttl or "5m"
            if ttl not in TTL_SECONDS:
                raise ApiError(400, f"{where}.cache_control.ttl: {quote(ttl)} is not a supported "
                               "TTL; use \"5m\" or \"1h\"")
            if isinstance(block, TextBlock) and not block.text:
                raise ApiError(400, f"{where}: cache_control cannot be set on an empty text "
                               "block")
            marked.append((where, block, TTL_SECONDS[ttl]))
        if len(marked) > MAX_BREAKPOINTS:
            counts = {part: sum(w.startswith(part) for w, _, _ in marked)
                      for part in ("tools", "system", "messages")}
            where = ", ".join(f"{part} {n}" for part, n in counts.items() if n)
            raise ApiError(400, f"a request may have at most {MAX_BREAKPOINTS} blocks with "
                           f"cache_control, this one has {len(marked)} ({where})")
        return marked

    def _cut(self, block: Any) -> int:
        """The length of the text up to the end of ``block``."""
        if isinstance(block, Tool):
            assert self.calling is not None
            index = self.tools.index(block)
            cut = tool_cut(self.text, self._render(None, with_tools_ending_at(self.calling,
                                                                               index)))
            if cut <= 0:
                raise ApiError(400, "cache_control cannot be placed on this tool: the chat "
                               "template does not render the tools before the conversation")
            return cut
        if isinstance(block, ToolUseBlock):
            return self._turn_cut(block)
        marked = self._render(block)
        cut = marked.find(SENTINEL)
        if cut < 0 or marked.replace(SENTINEL, "") != self.text:
            raise ApiError(400, "cache_control cannot be placed here: the chat template "
                           "changes the block's text")
        return cut

    def _turn_cut(self, block: ToolUseBlock) -> int:
        """The length of the text up to the end of the assistant turn that holds ``block``.
        The template renders a call from its name and input, so no sentinel can mark where the
        call ends: the turns up to that one are rendered alone, and the cut is where that
        rendering stops agreeing with the prompt (the turn's end, or earlier where a template
        renders a conversation's last message its own way)."""
        index = next(i for i, (_, blocks) in enumerate(self.turns)
                     if any(b is block for b in blocks))
        text = self._template(self.turns[: index + 1], None, self.calling, False)
        return common_length(text, self.text)

    def _breakpoints(self) -> list[tuple[int, float]]:
        """(tokens up to the end of the block, TTL) per breakpoint: the longest run of the
        prompt's ids that the text up to the block's end tokenizes to."""
        out = []
        encode = self.serving.tokenizer.encode
        for _, block, ttl in self._marked():
            prefix = encode(self.text[:self._cut(block)], add_special_tokens=False)
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


def _expanded(n: int, placed: PlacedImages) -> int:
    """Where position ``n`` of the prompt with one token per image lies once each image's
    token is expanded to its run."""
    extra = 0
    for run in placed.inputs:
        if run.offset - extra >= n:
            break
        extra += run.length - 1
    return n + extra


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

    async def count_tokens(self, body: CountTokensRequest) -> CountTokensResponse:
        self.serving.resolve_model(body.model)
        prompt = await asyncio.to_thread(AnthropicPrompt, self.serving, body)
        return CountTokensResponse(input_tokens=len(prompt.ids))

    def _checked_prompt(self, body: MessagesRequest) -> AnthropicPrompt:
        """The request's prompt, checked as ``check_prompt`` does (rendering, encoding and
        checking a large conversation takes seconds: the route runs this in a worker
        thread)."""
        prompt = AnthropicPrompt(self.serving, body)
        self.serving.check_prompt(prompt.ids, body.max_tokens, "messages")
        return prompt

    def _params(self, body: MessagesRequest, prompt: AnthropicPrompt) -> SamplingParams:
        calling = prompt.calling
        constraint = calling.constraint(self.serving.tokenizer) if calling is not None else None
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0, stop=body.stop_sequences, max_tokens=body.max_tokens,
                structured_outputs=constraint)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    async def create_message(self, body: MessagesRequest, request: Request,
                             api_key: str | None) -> Response | MessageResponse:
        serving = self.serving
        model = serving.resolve_model(body.model)
        prompt = await asyncio.to_thread(self._checked_prompt, body)  # off the event loop
        run = _Run(id=f"msg_{uuid.uuid4().hex}", model=model, prompts=_Prompts([prompt.ids]),
                   params=self._params(body, prompt), salt=serving.cache_salt(None, api_key),
                   param="messages", include_usage=False, grammar_param="tools",
                   tools=prompt.calling,
                   retention=prompt.retention(serving.config.max_retention_duration),
                   images=prompt.images)
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
        content: list[TextOut | ToolUseOut] = [TextOut(text="".join(text))]
        if run.tools is not None:
            reply, calls = run.tools.parse(content[0].text)  # type: ignore[union-attr]
            uses = tool_use_blocks(calls) if calls else None
            if uses:
                content = [TextOut(text=reply)] if reply else []
                content += uses
                stop_reason = "tool_use" if stop_reason != "max_tokens" else stop_reason
                stop_sequence = None
        return MessageResponse(
            id=run.id, model=run.model, content=content,
            stop_reason=stop_reason, stop_sequence=stop_sequence,
            usage=prompt.usage(run.prompts.cached_tokens[0], tokens, self.block_size))

    async def _events(self, run: _Run, prompt: AnthropicPrompt,
                      stream: MultiStream) -> AsyncGenerator[str, None]:
        tokens = 0
        last: Any = None
        blocks = _BlockEvents(run.tools.stream() if run.tools is not None else None)
        try:
            async for _, output in stream:
                if last is None:
                    yield self._message_start(run, prompt, output)
                    yield _event("ping", {})
                for c in output.outputs:
                    tokens += len(c.token_ids)
                    last = c
                    for event in blocks.text(c.text):
                        yield event
        except Exception as exc:  # the status is sent already: report it as an event
            yield _event("error", {"error": {"type": "api_error",
                                             "message": f"generation failed: {exc}"}})
            return
        stop_reason, stop_sequence = _stop(last)
        for event in blocks.finish():
            yield event
        if blocks.calls and stop_reason != "max_tokens":
            stop_reason, stop_sequence = "tool_use", None
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


class _BlockEvents:
    """The content-block events of a streamed reply: a text block opened at the first text to
    send (text that may start a tool call is held back by ``splitter``), then one ``tool_use``
    block per call once the reply has ended (its ``input`` in one ``input_json_delta``)."""

    def __init__(self, splitter: ToolCallStream | None) -> None:
        self.splitter = splitter
        self.index = 0
        self.open = False
        self.raw = self.sent = ""
        self.calls: list[ToolUseOut] = []

    def text(self, text: str) -> list[str]:
        self.raw += text
        if self.splitter is not None:
            text = self.splitter.feed(text)
        return self._text(text)

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        self.sent += text
        events = []
        if not self.open:
            self.open = True
            events.append(_event("content_block_start", {
                "index": self.index, "content_block": {"type": "text", "text": ""}}))
        events.append(_event("content_block_delta", {
            "index": self.index, "delta": {"type": "text_delta", "text": text}}))
        return events

    def finish(self) -> list[str]:
        events: list[str] = []
        calls: list[ToolUseOut] | None = None
        if self.splitter is not None:
            held, _ = self.splitter.finish()
            calls = tool_use_blocks(self.splitter.calls) if self.splitter.calls else None
            if calls is None:  # no calls, or not ones with object inputs: all text
                held = self.raw[len(self.sent):]
            events += self._text(held.strip() if calls else held)
        if self.open or not calls:
            if not self.open:
                events.append(_event("content_block_start", {
                    "index": self.index, "content_block": {"type": "text", "text": ""}}))
            events.append(_event("content_block_stop", {"index": self.index}))
            self.index += 1
        for call in calls or []:
            events.append(_event("content_block_start", {"index": self.index, "content_block": {
                "type": "tool_use", "id": call.id, "name": call.name, "input": {}}}))
            events.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(call.input)}}))
            events.append(_event("content_block_stop", {"index": self.index}))
            self.index += 1
        self.calls = calls or []
        return events


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
        if not request.url.path.startswith(ANTHROPIC_PATH):
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
