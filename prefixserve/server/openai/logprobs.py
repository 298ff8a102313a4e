"""Logprobs in the OpenAI shapes: the legacy completions form and the chat form.

The engine gives, per token, ``{token_id: Logprob}`` with the chosen token first and the most
likely alternatives after it (``TokenLogprobs.as_dict``), or None for the first prompt token.
Token texts are single tokens decoded with special tokens kept (so ``bytes`` is the UTF-8 of that
text: a token holding part of a character shows as U+FFFD). Logprobs of ``-inf`` are clamped to
``MIN_LOGPROB`` so that the JSON stays valid.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from prefixserve.model.text.tokenizer import Tokenizer
from prefixserve.outputs import Logprob
from prefixserve.server.openai.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob

MIN_LOGPROB = -9999.0

LogprobEntry = dict[int, Logprob] | None


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda item: item[1].rank)[:k]


def _chosen(entry: dict[int, Logprob], token_id: int) -> Logprob:
    return entry.get(token_id) or next(iter(entry.values()))


class LogprobFormatter:
    """Formats engine logprobs for one tokenizer (single-token texts are cached)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, token_ids: Sequence[int], entries: Sequence[LogprobEntry], k: int,
                   offset: int) -> tuple[CompletionLogprobs, int]:
        """The legacy logprobs of ``token_ids``, whose text starts at character ``offset`` of
        the choice; returns them and the offset after them. ``top_logprobs`` holds the k most
        likely tokens and the chosen one."""
        result = CompletionLogprobs(tokens=[], text_offset=[], token_logprobs=[],
                                    top_logprobs=[])
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = self.token_text(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            chosen = _finite(_chosen(entry, token_id).logprob)
            result.token_logprobs.append(chosen)
            top = {self.token_text(t): _finite(lp.logprob) for t, lp in _top(entry, k)}
            top.setdefault(text, chosen)
            result.top_logprobs.append(top)
        return result, offset

    def chat(self, token_ids: Sequence[int], entries: Sequence[LogprobEntry],
             k: int) -> list[ChatTokenLogprob]:
        """The chat logprobs of ``token_ids``, each with its k most likely alternatives."""
        result = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            if entry is None:
                continue
            text = self.token_text(token_id)
            top = []
            for alternative, logprob in _top(entry, k):
                alternative_text = self.token_text(alternative)
                top.append(TopLogprob(token=alternative_text, logprob=_finite(logprob.logprob),
                                      bytes=list(alternative_text.encode("utf-8"))))
            result.append(ChatTokenLogprob(
                token=text, logprob=_finite(_chosen(entry, token_id).logprob),
                bytes=list(text.encode("utf-8")), top_logprobs=top))
        return result
