"""One streamed ``/v1/completions`` request, timed, and a scrape of the server's ``/metrics``.

The request asks for server-sent events (``stream: true``) with usage in the last event
(``stream_options.include_usage``). A *token event* is an event whose choice carries text, or
no finish reason yet (an event that only closes the stream with empty text is not one): the
time to first token is the time to the first token event, the inter-token latencies are the
gaps between consecutive token events. Usage (``prompt_tokens``, ``completion_tokens``,
``prompt_tokens_details.cached_tokens``) is taken from whichever event carries it; servers that
send none leave those fields None.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixserve.tools.bench.metrics import Measurement

DONE = "[DONE]"

PROMPT_TYPES = ("token-ids", "text")
"""How prompts are sent: as a list of token ids, or as the text they decode to."""

MAX_ERROR_CHARS = 300


@dataclass(kw_only=True)
class Completion(Measurement):
    """What one request produced: its text and its measurement."""

    text: str = ""


def parse_event(line: str) -> dict[str, Any] | str | None:
    """The payload of one server-sent-event line: a JSON object, ``DONE``, or None for lines
    that carry no data (blank lines, comments, other fields). Raises ``ValueError`` for a data
    line that is neither."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    payload = json.loads(data)
    if not isinstance(payload, dict):
        raise ValueError(f"event data is not a JSON object: {data[:200]}")
    return payload


class _Timing:
    """Token event times of one request, relative to its start."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.itl: list[float] = []
        self.count = 0

    def token(self) -> None:
        now = time.perf_counter() - self.start
        if self.first is None:
            self.first = now
        else:
            assert self.last is not None
            self.itl.append(now - self.last)
        self.last = now
        self.count += 1


def _apply(payload: dict[str, Any], result: Completion, timing: _Timing) -> None:
    """Takes one event's choice text and usage into ``result``."""
    if payload.get("error") is not None:
        error = payload["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise ValueError(f"error event: {message}")
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else None
        text = (delta.get("content") if delta is not None else choice.get("text")) or ""
        output = bool(text) or bool(delta is not None and delta.get("tool_calls"))
        opening = delta is not None and delta.get("role") is not None and not output
        if output or (choice.get("finish_reason") is None and not opening):
            timing.token()
        result.text += text
    usage = payload.get("usage")
    if isinstance(usage, dict):
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            result.cached_tokens = details["cached_tokens"]


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        message = None
    text = " ".join(str(message or response.text).split())
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 3] + "..."
    return f"HTTP {response.status_code}: {text}"


class CompletionClient:
    """Sends completions to ``base_url`` (ending in ``/v1``) with one shared HTTP client.

    Every request asks for ``max_tokens`` tokens at temperature 0; with ``ignore_eos`` it also
    sends vLLM's ``ignore_eos`` so that exactly that many come; ``cache_salt`` and ``model`` are
    sent when set; ``extra_body`` is merged into every request body last. Use as an async
    context manager."""

    def __init__(self, base_url: str, *, prompt_type: str = "token-ids", model: str | None = None,
                 ignore_eos: bool = True, cache_salt: str | None = None,
                 extra_body: dict[str, Any] | None = None, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        if prompt_type not in PROMPT_TYPES:
            raise ValueError(f"prompt type must be one of {PROMPT_TYPES}, got {prompt_type!r}")
        self.url = base_url.rstrip("/") + "/completions"
        self.prompt_type = prompt_type
        self.model = model
        self.ignore_eos = ignore_eos
        self.cache_salt = cache_salt
        self.extra_body = dict(extra_body or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout),
                                       limits=httpx.Limits(max_connections=None,
                                                           max_keepalive_connections=None))

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._http.aclose()

    def body(self, ids: Sequence[int], text: str, max_tokens: int,
             prompt_type: str | None = None) -> dict[str, Any]:
        """The JSON body of a streamed request for this prompt."""
        kind = prompt_type or self.prompt_type
        body: dict[str, Any] = {
            "prompt": list(ids) if kind == "token-ids" else text,
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        body.update(self.extra_body)
        return body

    async def complete(self, ids: Sequence[int], text: str, max_tokens: int,
                       chat: dict[str, Any] | None = None) -> Completion:
        """Sends one request and times it; failures come back in ``Completion.error``.
        ``chat`` (the conversation's messages and tools) is for :class:`ChatClient`."""
        return await self._send(self.body(ids, text, max_tokens))

    async def choose_prompt_type(self, ids: Sequence[int], text: str) -> str:
        """Token ids if the server completes this prompt sent as token ids, else text if it
        completes it sent as text (a request with ``max_tokens`` 1 each); sets and returns
        the type. Raises ``RuntimeError`` when the server answers neither (or cannot be
        reached)."""
        errors = []
        for kind in PROMPT_TYPES:
            result = await self._send(self.body(ids, text, 1, kind))
            if result.error is None:
                self.prompt_type = kind
                return kind
            errors.append(f"as {kind}: {result.error}")
            if not result.error.startswith("HTTP "):
                break
        raise RuntimeError(f"the server at {self.url} failed a first request "
                           f"({'; '.join(errors)})")

    async def _send(self, body: dict[str, Any]) -> Completion:
        result = Completion()
        timing = _Timing()
        try:
            async with self._http.stream("POST", self.url, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    result.error = _error_message(response)
                    return result
                async for line in response.aiter_lines():
                    payload = parse_event(line)
                    if payload == DONE:
                        break
                    if isinstance(payload, dict):
                        _apply(payload, result, timing)
        except (httpx.HTTPError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        if timing.first is None:
            result.error = "the stream ended without a token"
            return result
        result.e2e = time.perf_counter() - timing.start
        result.ttft = timing.first
        result.itl = timing.itl
        result.token_events = timing.count
        return result


class ChatClient(CompletionClient):
    """Sends each turn to ``/v1/chat/completions`` as the conversation's messages (and tool
    manifest), with the same sampling, streaming and usage options; the prompt's token ids
    are not sent (the server renders the messages with its chat template). The role chunk that
    opens a chat stream is not a token event."""

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.prompt_type = "text"

    async def complete(self, ids: Sequence[int], text: str, max_tokens: int,
                       chat: dict[str, Any] | None = None) -> Completion:
        body = self.body(ids, text, max_tokens, "text")
        del body["prompt"]
        body.update(chat or {"messages": [{"role": "user", "content": text}]})
        return await self._send(body)

    async def choose_prompt_type(self, ids: Sequence[int], text: str) -> str:
        result = await self.complete(ids, text, 1)
        if result.error is not None:
            raise RuntimeError(f"the server at {self.url} failed a first request "
                               f"({result.error})")
        return "text"


def metrics_url(base_url: str) -> str:
    """``/metrics`` beside the API: ``http://h:p/v1`` gives ``http://h:p/metrics``."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    return root + "/metrics"


SERVER_LABELS = frozenset({"model_name", "engine"})
"""Labels that only say which model or engine a sample comes from (prefixserve and vLLM put
``model_name`` on every sample): a sample with no other label is read by its bare name."""


def parse_prometheus(text: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition that carry no label besides
    ``SERVER_LABELS``, by name (summed over those labels); lines that do not parse are skipped."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        try:
            families = list(text_string_to_metric_families(line + "\n"))
        except ValueError:
            continue
        for sample in (s for family in families for s in family.samples):
            if SERVER_LABELS.issuperset(sample.labels):
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


async def scrape(url: str, timeout: float = 10.0) -> dict[str, float] | None:
    """The samples of ``url`` (see ``parse_prometheus``), or None when it cannot be read (no
    such endpoint)."""
    try:
        async with httpx.AsyncClient(timeout=timeout) as http:
            response = await http.get(url)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_prometheus(response.text)
