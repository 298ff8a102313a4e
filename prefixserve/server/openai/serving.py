"""The OpenAI endpoints: requests in, engine requests run, responses or event streams out.

Contract of both endpoints:

- Everything that can be checked before generating is checked first and answered with a 4xx:
  the model name (404), fields not implemented, the per-request limits (prompts, ``n``,
  sequences), the sampling parameters, the prompt (empty, token ids outside the vocabulary,
  longer than the context, or too long for ``max_tokens`` more), the chat template (400s).
- Fields accepted for compatibility but ignored are named in the ``x-ignored-fields`` response
  header (and logged once each at debug level).
- Each prompt becomes one engine request of ``n`` sequences; choice ``i * n + j`` is sequence
  ``j`` of prompt ``i``. A streamed response starts only once every engine request has produced
  its first output, so a full queue (503 with ``Retry-After``) or a shut-down engine (503) is
  still answered with a status code; an error after that is sent as a ``data: {"error": ...}``
  event before ``data: [DONE]``.
- A client that disconnects, during a streamed or a plain response, aborts its engine requests,
  which frees their KV blocks.
- ``usage`` counts each prompt once, and ``usage.prompt_tokens_details.cached_tokens`` is the
  number of prompt tokens served from the prefix cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import jinja2
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from prefixserve.core import Retention
from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.engine.errors import EngineDeadError, QueueFullError, RequestError
from prefixserve.engine.llm_engine import QueueReservation
from prefixserve.engine.multimodal import PlacedImages
from prefixserve.model.text.tokenizer import Tokenizer
from prefixserve.outputs import CompletionOutput, FinishReason, RequestOutput
from prefixserve.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from prefixserve.server.config import ServerConfig
from prefixserve.server.errors import ApiError, quote
from prefixserve.server.media import ImageCollector, MediaPolicy
from prefixserve.server.metrics import ServerMetrics
from prefixserve.server.openai.agent_protocol import ResponseToolCall
from prefixserve.server.openai.logprobs import LogprobEntry, LogprobFormatter
from prefixserve.server.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ContentPart,
    GenerationRequest,
    PromptTokensDetails,
    TextContentPart,
    Usage,
)
from prefixserve.server.openai.retention import to_retention
from prefixserve.server.openai.structured import structured_outputs
from prefixserve.server.openai.tool_calls import ToolCalling, ToolCallStream, check_tool_messages
from prefixserve.server.streams import (
    ClientDisconnectedError,
    EventStreamResponse,
    MultiStream,
    error_event,
    run_unless_disconnected,
    sse_event,
)

logger = logging.getLogger("prefixserve.server")

#: Seconds a client is asked to wait (``Retry-After``) when the waiting queue is full.
RETRY_AFTER_SECONDS = 1
#: ``max_tokens`` of a completion that gives none (OpenAI's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Variables of the chat template that ``chat_template_kwargs`` may not set.
_RESERVED_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "tokenize",
                                      "bos_token", "eos_token"})
ResponseT = TypeVar("ResponseT", bound=BaseModel)
#: A chat choice also finishes with ``tool_calls`` when its text was tool calls.
ChatFinishReason = FinishReason | Literal["tool_calls"]


def _fresh(completions: Sequence[CompletionOutput], base: int,
           finished: set[int]) -> Iterator[tuple[int, CompletionOutput]]:
    """The completions of an output (a delta of every sequence of a request) that carry
    something not sent yet: text, tokens, or their finish (sent once; ``finished`` collects
    the choice indexes ``base + completion.index`` already finished)."""
    for completion in completions:
        index = base + completion.index
        if index in finished:
            continue
        if completion.finish_reason is not None:
            finished.add(index)
        elif not (completion.text or completion.token_ids):
            continue
        yield index, completion


@dataclass
class _Sequence:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    def add(self, output: CompletionOutput) -> None:
        self.text.append(output.text)
        self.token_ids.extend(output.token_ids)
        self.logprobs.extend(output.logprobs or [])
        self.finish_reason = output.finish_reason or self.finish_reason
        self.stop_reason = output.stop_reason if output.stop_reason is not None \
            else self.stop_reason


@dataclass
class _Prompts:
    """The token ids of a request's prompts, and what happened to them."""

    ids: list[list[int]]
    cached_tokens: list[int] = field(default_factory=list)
    cached_by_tier: dict[int, dict[str, int]] = field(default_factory=dict)
    prompt_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cached_tokens = [0] * len(self.ids)
        self.prompt_logprobs = [None] * len(self.ids)

    def note(self, index: int, output: RequestOutput) -> None:
        self.cached_tokens[index] = output.num_cached_tokens
        if output.num_cached_tokens_by_tier is not None:
            self.cached_by_tier[index] = output.num_cached_tokens_by_tier
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[index] = output.prompt_logprobs

    def usage(self, completion_tokens: int) -> Usage:
        prompt_tokens = sum(len(ids) for ids in self.ids)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=sum(self.cached_tokens),
                         cached_tokens_by_tier=self._by_tier()))

    def _by_tier(self) -> dict[str, int] | None:
        """The prompts' cached tokens summed per tier (None without tiers)."""
        if not self.cached_by_tier:
            return None
        total: dict[str, int] = {}
        for split in self.cached_by_tier.values():
            for tier, tokens in split.items():
                total[tier] = total.get(tier, 0) + tokens
        return total

    def logprob_entries(self, index: int) -> list[LogprobEntry]:
        """A new list of the logprob entries of prompt ``index``'s tokens: those the engine
        reported (with ``prompt_logprobs``), else None for each token."""
        entries = self.prompt_logprobs[index]
        return list(entries) if entries is not None else [None] * len(self.ids[index])


@dataclass
class _Run:
    """One request's engine work, and what every response or event of it repeats.

    ``id`` is the response id (engine requests are named after it), ``param`` the request field
    the prompts came from (named by a 400 on them), ``include_usage`` whether a stream ends with
    a usage event. ``created`` is the time the run was made, in seconds."""

    id: str
    model: str
    prompts: _Prompts
    params: SamplingParams
    salt: str | None
    param: str
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    grammar_param: str = "structured_outputs"
    tools: ToolCalling | None = None
    retention: Retention | None = None
    lora: str | None = None
    images: PlacedImages | None = None
    """The images of a one-prompt run (a chat with images), placed in its ids."""

    def event(self, kind: type[CompletionResponse] | type[ChatCompletionChunk],
              choices: list[Any], usage: Usage | None = None) -> str:
        """A ``data:`` event holding a ``kind`` of this run with ``choices`` and ``usage``."""
        return sse_event(kind(id=self.id, created=self.created, model=self.model,
                              choices=choices, usage=usage))


@dataclass
class _CompletionChoices:
    """Assembles the choices of one ``/v1/completions`` request, whole (one call per choice)
    or streamed (one call per delta of a choice), the same way for both.

    The first call for a choice puts the echoed prompt before its output (``echo_texts``, one
    per prompt, None without ``echo``; with logprobs also the prompt's tokens and entries). With
    ``top_logprobs`` (the request's ``logprobs``) each call reports the logprobs of its tokens,
    their ``text_offset`` going on from where the choice's previous call ended."""

    prompts: _Prompts
    echo_texts: list[str] | None
    top_logprobs: int | None
    formatter: LogprobFormatter
    _offsets: dict[int, int] = field(default_factory=dict)  # choice -> characters sent
    _started: set[int] = field(default_factory=set)  # choices whose first part is built

    def whole(self, index: int, prompt: int, seq: _Sequence) -> CompletionChoice:
        """Choice ``index`` (of prompt ``prompt``) from everything its sequence produced."""
        return self.choice(index, prompt, "".join(seq.text), seq.token_ids, seq.logprobs,
                           seq.finish_reason, seq.stop_reason)

    def delta(self, index: int, prompt: int, output: CompletionOutput) -> CompletionChoice:
        """The next part of choice ``index`` (of prompt ``prompt``): one output delta."""
        return self.choice(index, prompt, output.text, output.token_ids, output.logprobs or [],
                           output.finish_reason, output.stop_reason)

    def choice(self, index: int, prompt: int, text: str, token_ids: Sequence[int],
               entries: Sequence[LogprobEntry], finish_reason: FinishReason | None,
               stop_reason: int | str | None) -> CompletionChoice:
        """Choice ``index`` (or its next part) from output of prompt ``prompt``."""
        token_ids, entries = list(token_ids), list(entries)
        if index not in self._started and self.echo_texts is not None:
            text = self.echo_texts[prompt] + text
            token_ids = self.prompts.ids[prompt] + token_ids
            entries = self.prompts.logprob_entries(prompt) + entries
        self._started.add(index)
        logprobs = None
        if self.top_logprobs is not None:
            logprobs, self._offsets[index] = self.formatter.completion(
                token_ids, entries, self.top_logprobs, self._offsets.get(index, 0))
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=finish_reason, stop_reason=stop_reason)


def _bad_request(exc: RequestError, param: str, grammar_param: str = "structured_outputs",
                 ) -> ApiError:
    """The 400 of an engine's ``RequestError``: its code, and ``param`` (the request field that
    holds the prompt) unless the error names another field (a grammar's error names
    ``grammar_param``, the field the constraint came from). An unknown adapter (unloaded
    meanwhile) is a 404, as an unknown model."""
    named = grammar_param if exc.param == "structured_outputs" else exc.param
    status = 404 if exc.code == "model_not_found" else 400
    return ApiError(status, str(exc), param=named or param, code=exc.code)


def _prompt_items(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Any]:
    """The prompts of a completion request: ``prompt`` itself when it is one (a string or
    token ids), else its items."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def cache_salt(config: ServerConfig, salt: str | None, api_key: str | None) -> str | None:
    """The request's salt, prefixed with the SHA-256 of the caller's key under
    ``salt_by_api_key`` (its tenant)."""
    if not (config.salt_by_api_key and api_key):
        return salt
    tenant = hashlib.sha256(api_key.encode("utf-8")).hexdigest()
    return tenant if salt is None else f"{tenant}:{salt}"


def _content_text(content: str | list[ContentPart] | None, index: int,
                  images: ImageCollector | None) -> str | None:
    """A message's content as the template reads it: its parts joined by newlines, each
    image part as the image token (``images`` decodes it; None: a 400, images are not taken
    where the prompt is rendered)."""
    if isinstance(content, str | None):
        return content
    pieces = []
    for j, part in enumerate(content):
        where = f"messages.{index}.content.{j}"
        if isinstance(part, TextContentPart):
            pieces.append(part.text)
        elif images is None:
            raise ApiError(400, f"{where}: image_url parts are taken by /v1/chat/completions "
                           "only", param="messages", code="image_not_supported")
        else:
            pieces.append(images.url(where, part.image_url.url))
    return "\n".join(pieces)


def chat_prompt(tokenizer: Tokenizer, body: ChatCompletionRequest,
                tools: ToolCalling | None = None, images: ImageCollector | None = None
                ) -> list[int]:
    """The conversation rendered with the model's chat template (with the tools as their
    format says), as token ids; a 400 when the template refuses it. Each image part becomes
    one image token, its image decoded into ``images`` (None: image parts are a 400).
    Rendering and encoding a large conversation takes seconds: the routes run this in a
    worker thread."""
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(body.messages):
        content = _content_text(message.content, index, images)
        item = {"role": "system" if message.role == "developer" else message.role,
                "content": content or ""}
        if message.name is not None:
            item["name"] = message.name
        messages.append(item)
    add_generation_prompt = body.add_generation_prompt is not False
    extra = dict(body.chat_template_kwargs or {})
    tool_variables: dict[str, Any] = {}
    if tools is not None:
        messages, tool_variables = tools.messages(messages, body.messages)
    reserved = sorted(_RESERVED_TEMPLATE_NAMES & extra.keys())
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}",
                       param="chat_template_kwargs", code="invalid_value")
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True,
            **{**extra, **tool_variables})
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise ApiError(400, f"the chat template cannot render these messages: {exc}",
                       param="messages", code="invalid_messages") from exc
    assert isinstance(ids, list)
    return ids


class OpenAIServing:
    """Serves ``/v1/completions`` and ``/v1/chat/completions`` from an ``AsyncLLM``."""

    def __init__(self, engine: AsyncLLM, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.max_waiting: int | None = engine.max_waiting_requests
        self.logprobs = LogprobFormatter(engine.tokenizer)
        self._logged_ignored: set[str] = set()
        self.media = MediaPolicy(config.max_image_pixels, config.allowed_media_domains,
                                 config.max_request_body_size, engine.max_images_per_prompt)
        self.image_token = engine.image_token

    # ------------------------------------------------------------------ checks and inputs
    def resolve_model(self, name: str | None) -> str:
        """The served model name to report (a served name of the base model or a LoRA
        adapter's); a 404 for a name that is not served."""
        if name is None:
            return self.config.served_model_names[0]
        if name not in self.config.served_model_names and not self._is_lora(name):
            served = ", ".join(self.config.served_model_names)
            raise ApiError(404, f"the model {quote(name)} does not exist here; use one of: "
                           f"{served}",
                           param="model", code="model_not_found")
        return name

    def _is_lora(self, name: str) -> bool:
        return any(info.name == name for info in self.engine.lora_adapters)

    def check_fields(self, body: GenerationRequest, response: Response) -> None:
        """A 400 for a field that is not implemented and would change the result; names the
        fields accepted but ignored in the ``x-ignored-fields`` header."""
        unsupported = body.unsupported_field()
        if unsupported is not None:
            raise ApiError(400, f"{unsupported} is not supported by this server; leave it out",
                           param=unsupported, code="unsupported_parameter")
        ignored = body.ignored_fields()
        if ignored:
            response.headers["x-ignored-fields"] = ",".join(ignored)
            for name in set(ignored) - self._logged_ignored:
                self._logged_ignored.add(name)
                logger.debug("accepting and ignoring the request field %r", name)

    def check_limits(self, num_prompts: int, n: int | None) -> None:
        """A 400 for a request over the per-request limits, or one that asks for more sequences
        than the waiting queue may ever hold."""
        config, n = self.config, n or 1
        if num_prompts > config.max_prompts_per_request:
            raise ApiError(400, f"the request has {num_prompts} prompts; at most "
                           f"{config.max_prompts_per_request} are allowed "
                           "(--max-prompts-per-request)", param="prompt",
                           code="too_many_prompts")
        if n > config.max_n:
            raise ApiError(400, f"n is {n}; at most {config.max_n} is allowed (--max-n)",
                           param="n", code="invalid_value")
        total = num_prompts * n
        limit = min(config.max_sequences_per_request, self.max_waiting or total)
        if total > limit:
            raise ApiError(400, f"the request asks for {total} sequences ({num_prompts} "
                           f"prompt(s) x n={n}); at most {limit} are allowed per request "
                           "(--max-sequences-per-request, --max-waiting-requests)",
                           param="n" if n > 1 else "prompt", code="too_many_sequences")

    def cache_salt(self, salt: str | None, api_key: str | None) -> str | None:
        """:func:`cache_salt` under this server's config."""
        return cache_salt(self.config, salt, api_key)

    def check_prompt(self, ids: Sequence[int], max_tokens: int | None, param: str) -> None:
        """A 400 naming ``param`` (or ``max_tokens``) unless the prompt is non-empty, in the
        vocabulary, shorter than the context and leaves room for ``max_tokens`` more (the
        engine's ``validate_prompt``). It reads every id: a route calls it in the worker
        thread that made the ids (:meth:`checked_ids`), off the event loop."""
        try:
            self.engine.validate_prompt(ids, max_tokens)
        except RequestError as exc:
            raise _bad_request(exc, param) from exc

    async def checked_ids(self, make: Callable[[], list[int]], max_tokens: int | None,
                          param: str) -> list[int]:
        """``make()``'s token ids, checked by :meth:`check_prompt`, both in a worker thread:
        encoding or rendering a large input takes seconds, and checking a million ids a
        tenth of one, which on the event loop would stall every other client."""
        def run() -> list[int]:
            ids = make()
            self.check_prompt(ids, max_tokens, param)
            return ids

        return await asyncio.to_thread(run)

    def sampling_params(self, body: GenerationRequest, *, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's sampling parameters (an unset field takes SamplingParams' default;
        a ``top_k`` of the vocabulary size or more means all tokens); a value SamplingParams
        refuses is a 400 naming the field. ``constraint`` is the output's grammar."""

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        top_k = pick(body.top_k, 0)
        if top_k >= self.vocab_size:
            top_k = 0
        try:
            return SamplingParams(
                n=pick(body.n, 1), temperature=pick(body.temperature, 1.0),
                top_p=pick(body.top_p, 1.0), top_k=top_k,
                min_p=pick(body.min_p, 0.0), seed=body.seed,
                repetition_penalty=pick(body.repetition_penalty, 1.0),
                presence_penalty=pick(body.presence_penalty, 0.0),
                frequency_penalty=pick(body.frequency_penalty, 0.0),
                stop=body.stop, stop_token_ids=body.stop_token_ids, max_tokens=max_tokens,
                min_tokens=pick(body.min_tokens, 0), ignore_eos=pick(body.ignore_eos, False),
                skip_special_tokens=pick(body.skip_special_tokens, True),
                include_stop_str_in_output=pick(body.include_stop_str_in_output, False),
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                logit_bias=self._logit_bias(body), allowed_token_ids=body.allowed_token_ids,
                structured_outputs=constraint)
        except SamplingParamsError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from exc

    def _logit_bias(self, body: GenerationRequest) -> dict[int, float] | None:
        """``logit_bias`` with integer keys; a 400 naming it for a key that is not a token id
        of this vocabulary."""
        if not body.logit_bias:
            return None
        bias = {}
        for key, value in body.logit_bias.items():
            token_id = int(key) if key.isascii() and key.isdigit() else -1
            if not 0 <= token_id < self.vocab_size:
                raise ApiError(400, f"logit_bias: {quote(key)} is not a token id in [0, "
                               f"{self.vocab_size})", param="logit_bias", code="invalid_value")
            bias[token_id] = value
        bad = [t for t in body.allowed_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"allowed_token_ids: {bad[0]} is not a token id in [0, "
                           f"{self.vocab_size})", param="allowed_token_ids",
                           code="invalid_value")
        return bias

    # ------------------------------------------------------------------ running requests
    async def _source(self, ids: list[int], params: SamplingParams, request_id: str,
                      salt: str | None, retention: Retention | None = None,
                      lora: str | None = None, reservation: QueueReservation | None = None,
                      images: PlacedImages | None = None,
                      ) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of one engine request, observed for the metrics; closing it aborts the
        request."""
        tracker = self.metrics.track(params.n)
        try:
            generated = self.engine.generate(ids, params, request_id, cache_salt=salt,
                                             retention=retention, lora=lora,
                                             reservation=reservation, images=images)
            async with aclosing(generated) as outputs:
                async for output in outputs:
                    tracker.observe(output)
                    yield output
        finally:
            tracker.close()

    async def _start(self, run: _Run) -> MultiStream:
        """Queues one engine request per prompt of ``run`` and waits for their first outputs;
        a 400 (naming ``run.param``) or 503 when the engine refuses them. The queue room of
        several prompts is reserved first, for all their sequences at once: they are queued
        whole or refused whole, never some queued (and run) and then aborted."""
        ids_list = run.prompts.ids
        reservation = None
        try:
            if len(ids_list) > 1 and self.max_waiting is not None:
                reservation = await self.engine.reserve_queue_room(len(ids_list) * run.params.n)
            stream = MultiStream([
                self._source(ids, run.params, run.id if len(ids_list) == 1 else f"{run.id}-{i}",
                             run.salt, run.retention, run.lora, reservation,
                             run.images if len(ids_list) == 1 else None)
                for i, ids in enumerate(ids_list)
            ])
            try:
                await stream.start()
            finally:
                if reservation is not None:
                    self.engine.release_queue_room(reservation)
        except RequestError as exc:
            raise _bad_request(exc, run.param, run.grammar_param) from exc
        except QueueFullError as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry later",
                           code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from exc
        except EngineDeadError as exc:
            raise ApiError(503, "the engine is not running", code="engine_unavailable") from exc
        return stream

    async def _collect(self, stream: MultiStream, prompts: _Prompts,
                       n: int) -> list[list[_Sequence]]:
        """Runs a started stream to its end; closes it whatever happens."""
        sequences = [[_Sequence() for _ in range(n)] for _ in prompts.ids]
        try:
            async for index, output in stream:
                prompts.note(index, output)
                for completion in output.outputs:
                    sequences[index][completion.index].add(completion)
        finally:
            await stream.aclose()
        return sequences

    def _run(self, kind: str, model: str, prompts: _Prompts, params: SamplingParams,
             body: GenerationRequest, api_key: str | None, param: str,
             grammar_param: str = "structured_outputs") -> _Run:
        """The run of a request: its id is ``kind`` and a fresh hex uuid, its salt the
        request's (see :meth:`cache_salt`)."""
        return _Run(id=f"{kind}-{uuid.uuid4().hex}", model=model, prompts=prompts,
                    params=params, salt=self.cache_salt(body.cache_salt, api_key), param=param,
                    include_usage=bool(body.stream_options and body.stream_options.include_usage),
                    grammar_param=grammar_param,
                    retention=to_retention(body.retention, self.config.max_retention_duration),
                    lora=model if model not in self.config.served_model_names else None)

    @staticmethod
    async def _respond(request: Request, stream_events: bool,
                       start: Callable[[], Awaitable[MultiStream]],
                       events: Callable[[MultiStream], AsyncGenerator[str, None]],
                       collect: Callable[[], Awaitable[ResponseT]],
                       response: Response) -> ResponseT | Response:
        """Starts the engine requests and answers with an event stream or a whole response
        (with the headers set on ``response``); a client gone before that gets an empty 499."""
        try:
            if stream_events:
                stream = await run_unless_disconnected(request, start())
                events_response = EventStreamResponse(_terminated(events(stream)), stream)
                for name, value in response.headers.items():
                    if name.startswith("x-"):
                        events_response.headers[name] = value
                return events_response
            return await run_unless_disconnected(request, collect())
        except ClientDisconnectedError:
            return Response(status_code=499)

    # ------------------------------------------------------------------ /v1/completions
    async def create_completion(self, body: CompletionRequest, request: Request,
                                api_key: str | None, response: Response,
                                ) -> CompletionResponse | Response:
        """Serves ``POST /v1/completions`` as the module docstring says: ``n`` choices per
        prompt, with ``echo`` the prompt before each choice's text, with ``logprobs`` legacy
        logprobs (``text_offset`` counted from the start of the choice, echo included)."""
        model = self.resolve_model(body.model)
        self.check_fields(body, response)
        items = _prompt_items(body.prompt)
        self.check_limits(len(items), body.n)
        max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        ids_list = await asyncio.to_thread(self._encode_prompts, items, max_tokens)
        k, echo = body.logprobs, bool(body.echo)
        constraint, grammar_param = await asyncio.to_thread(
            structured_outputs, body, self.config.max_json_schema_depth)
        params = self.sampling_params(body, max_tokens=max_tokens, logprobs=k,
                                      prompt_logprobs=k if echo else None,
                                      constraint=constraint)
        echo_texts = self._echo_texts(items, ids_list) if echo else None
        prompts = _Prompts(ids_list)
        choices = _CompletionChoices(prompts, echo_texts, k, self.logprobs)
        run = self._run("cmpl", model, prompts, params, body, api_key, "prompt", grammar_param)
        return await self._respond(
            request, bool(body.stream), lambda: self._start(run),
            lambda stream: self._completion_events(run, choices, stream),
            lambda: self._completion_response(run, choices), response)

    def _encode_prompts(self, items: Sequence[Any], max_tokens: int) -> list[list[int]]:
        """The token ids of each prompt (text encoded, ids as given), each checked by
        :meth:`check_prompt`. Encoding a large text takes seconds: the route runs this in a
        worker thread, off the event loop."""
        ids_list = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]
        for ids in ids_list:
            self.check_prompt(ids, max_tokens, "prompt")
        return ids_list

    def _echo_texts(self, items: Sequence[Any], ids_list: Sequence[list[int]]) -> list[str]:
        """The text to echo of each prompt: as given, or its token ids decoded (special tokens
        included)."""
        return [p if isinstance(p, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
                for p, ids in zip(items, ids_list, strict=True)]

    async def _completion_response(self, run: _Run,
                                   choices: _CompletionChoices) -> CompletionResponse:
        """Starts ``run``, runs it to its end and answers with every choice whole."""
        n = run.params.n
        sequences = await self._collect(await self._start(run), run.prompts, n)
        whole = [choices.whole(i * n + j, i, seq)
                 for i, row in enumerate(sequences) for j, seq in enumerate(row)]
        completion_tokens = sum(len(s.token_ids) for row in sequences for s in row)
        return CompletionResponse(id=run.id, created=run.created, model=run.model,
                                  choices=whole, usage=run.prompts.usage(completion_tokens))

    @staticmethod
    async def _completion_events(run: _Run, choices: _CompletionChoices,
                                 stream: MultiStream) -> AsyncGenerator[str, None]:
        """The events of a started ``run``: one per choice delta with something new, then the
        usage when asked for."""
        finished: set[int] = set()
        completion_tokens = 0
        async for i, output in stream:
            run.prompts.note(i, output)
            for index, c in _fresh(output.outputs, i * run.params.n, finished):
                completion_tokens += len(c.token_ids)
                yield run.event(CompletionResponse, [choices.delta(index, i, c)])
        if run.include_usage:
            yield run.event(CompletionResponse, [], run.prompts.usage(completion_tokens))

    # ------------------------------------------------------------------ /v1/chat/completions
    def tool_calling(self, body: ChatCompletionRequest) -> ToolCalling | None:
        """The request's tools (None without), after checking its tool messages."""
        check_tool_messages(body.messages)
        return ToolCalling.for_request(body.tools, body.tool_choice, body.parallel_tool_calls,
                                       self.tokenizer.chat_template,
                                       self.config.max_json_schema_depth)

    def chat_prompt(self, body: ChatCompletionRequest,
                    tools: ToolCalling | None = None) -> list[int]:
        """:func:`chat_prompt` with this server's tokenizer (image parts are a 400)."""
        return chat_prompt(self.tokenizer, body, tools)

    def image_collector(self) -> ImageCollector:
        """A collector of one prompt's images under this server's media policy."""
        return ImageCollector(self.media, self.image_token)

    def place_images(self, ids: list[int], collector: ImageCollector
                     ) -> tuple[list[int], PlacedImages | None]:
        """``ids`` with the collected images placed (``AsyncLLM.place_images``; a 400 naming
        ``messages`` when they do not fit the prompt); ``ids`` as they are without images."""
        if not collector.images:
            return ids, None
        try:
            return self.engine.place_images(ids, collector.images)
        except RequestError as exc:
            raise _bad_request(exc, "messages") from exc

    async def checked_chat_prompt(self, body: ChatCompletionRequest,
                                  tools: ToolCalling | None, max_tokens: int | None
                                  ) -> tuple[list[int], PlacedImages | None]:
        """The chat's token ids with its images placed, checked as :meth:`check_prompt`
        does, all in a worker thread (decoding images takes time too)."""
        def run() -> tuple[list[int], PlacedImages | None]:
            collector = self.image_collector()
            ids, images = self.place_images(chat_prompt(self.tokenizer, body, tools, collector),
                                            collector)
            self.check_prompt(ids, max_tokens, "messages")
            return ids, images

        return await asyncio.to_thread(run)

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request,
                                     api_key: str | None, response: Response,
                                     ) -> ChatCompletionResponse | Response:
        """Serves ``POST /v1/chat/completions`` as the module docstring says: ``n`` choices
        of the conversation rendered by the chat template, with ``logprobs`` chat logprobs
        (``top_logprobs`` alternatives each)."""
        model = self.resolve_model(body.model)
        self.check_fields(body, response)
        self.check_limits(1, body.n)
        max_tokens = body.max_completion_tokens or body.max_tokens
        tools = self.tool_calling(body)
        ids, images = await self.checked_chat_prompt(body, tools, max_tokens)
        k = (body.top_logprobs or 0) if body.logprobs else None
        constraint, grammar_param = await asyncio.to_thread(
            structured_outputs, body, self.config.max_json_schema_depth)
        tool_constraint = tools.constraint(self.tokenizer) if tools is not None else None
        if tool_constraint is not None:
            if constraint is not None and tools is not None and tools.choice != "auto":
                raise ApiError(400, f"{grammar_param} cannot be combined with a forced "
                               "tool_choice", param=grammar_param, code="invalid_value")
            if constraint is None:
                constraint, grammar_param = tool_constraint, "tools"
        params = self.sampling_params(body, max_tokens=max_tokens, logprobs=k,
                                      prompt_logprobs=None, constraint=constraint)
        run = self._run("chatcmpl", model, _Prompts([ids]), params, body, api_key, "messages",
                        grammar_param)
        run.tools, run.images = tools, images
        return await self._respond(
            request, bool(body.stream), lambda: self._start(run),
            lambda stream: self._chat_events(run, k, stream),
            lambda: self._chat_response(run, k), response)

    def _chat_logprobs(self, token_ids: Sequence[int], entries: Sequence[LogprobEntry],
                       k: int | None) -> ChatLogprobs | None:
        """The chat logprobs of a choice's tokens (or its next part's); None without ``k``."""
        return None if k is None else ChatLogprobs(content=self.logprobs.chat(token_ids,
                                                                              entries, k))

    async def _chat_response(self, run: _Run, k: int | None) -> ChatCompletionResponse:
        """Starts ``run``, runs it to its end and answers with every choice whole."""
        sequences = (await self._collect(await self._start(run), run.prompts, run.params.n))[0]
        choices = []
        for j, seq in enumerate(sequences):
            content: str | None = "".join(seq.text)
            calls: list[ResponseToolCall] = []
            if run.tools is not None and content is not None:
                content, calls = run.tools.parse(content)
            finish = "tool_calls" if calls and seq.finish_reason == "stop" else \
                seq.finish_reason
            choices.append(ChatChoice(
                index=j, message=ChatResponseMessage(content=content, tool_calls=calls),
                logprobs=self._chat_logprobs(seq.token_ids, seq.logprobs, k),
                finish_reason=finish, stop_reason=seq.stop_reason))
        completion_tokens = sum(len(s.token_ids) for s in sequences)
        return ChatCompletionResponse(id=run.id, created=run.created, model=run.model,
                                      choices=choices, usage=run.prompts.usage(completion_tokens))

    async def _chat_events(self, run: _Run, k: int | None,
                           stream: MultiStream) -> AsyncGenerator[str, None]:
        """The events of a started ``run``: the assistant role of each choice, one per choice
        delta with something new, then the usage when asked for."""
        finished: set[int] = set()
        completion_tokens = 0
        splitters = [run.tools.stream() for _ in range(run.params.n)] if run.tools else None
        for j in range(run.params.n):
            yield run.event(ChatCompletionChunk, [ChatChunkChoice(
                index=j, delta=ChatDelta(role="assistant", content=""))])
        async for _, output in stream:
            run.prompts.note(0, output)
            for _, c in _fresh(output.outputs, 0, finished):
                completion_tokens += len(c.token_ids)
                delta = ChatDelta(content=c.text or None)
                finish: ChatFinishReason | None = c.finish_reason
                if splitters is not None:
                    delta, finish = _split_tool_calls(splitters[c.index], c.text,
                                                      c.finish_reason)
                    if k is None and finish is None and delta == ChatDelta():
                        continue  # text held back while it may start a call
                yield run.event(ChatCompletionChunk, [ChatChunkChoice(
                    index=c.index, delta=delta,
                    logprobs=self._chat_logprobs(c.token_ids, c.logprobs or [], k),
                    finish_reason=finish, stop_reason=c.stop_reason)])
        if run.include_usage:
            yield run.event(ChatCompletionChunk, [], run.prompts.usage(completion_tokens))


def _split_tool_calls(splitter: ToolCallStream, text: str, finish_reason: FinishReason | None,
                      ) -> tuple[ChatDelta, ChatFinishReason | None]:
    """The delta of a streamed chat choice with tools: content that cannot start a call now,
    and the tool-call deltas when the choice ends (finishing with ``tool_calls`` then)."""
    content = splitter.feed(text)
    if finish_reason is None:
        return ChatDelta(content=content or None), None
    rest, calls = splitter.finish()
    content += rest
    finish: ChatFinishReason | None = "tool_calls" if calls and finish_reason == "stop" \
        else finish_reason
    return ChatDelta(content=content or None, tool_calls=calls or None), finish


async def _terminated(events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """Relays a response's ``events``, reports an error raised once the status line is sent as
    an error event, and ends the stream with ``data: [DONE]``."""
    async with aclosing(events):
        try:
            async for event in events:
                yield event
        except Exception as exc:  # the status is sent already: report it as an event
            yield error_event(exc)
    yield "data: [DONE]\n\n"
