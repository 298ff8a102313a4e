"""Structured outputs: compiling constraints into grammars and masking tokens step by step.

The engine asks three things of a grammar backend, and nothing else (so another engine could
replace llguidance behind the same interface):

- ``compile(spec)``: check a :class:`StructuredOutputsParams` once, before the request is
  queued (a bad schema or regex raises :class:`GrammarError`, which names what is wrong);
- ``matcher(compiled)``: a fresh per-sequence matcher;
- the matcher: ``fill_bitmask(row)`` (which tokens may come next, one bit per token id),
  ``consume(token_id)``, ``rollback(count)`` and ``is_stopped()``.

:class:`GrammarState` is one sequence's state. Its invariant: the matcher has consumed exactly
the sequence's output tokens from the grammar's first token on (``consumed`` counts them). It
is kept in step with the tokens (:meth:`GrammarState.sync`) before each mask, so a sequence
that was preempted and recomputed, or whose matcher was dropped, resumes from its tokens.

The backend is llguidance (chosen over xgrammar, whose wheel requires a torch range newer than
the pinned one and triton, and over outlines-core, which builds a whole-vocabulary automaton
per schema before the first token): its tokenizer is built once per engine from the model's
``tokenizers`` JSON (about 0.3 s for a 49k vocabulary), a JSON schema compiles in about a
millisecond, and a mask over the vocabulary costs well under a millisecond per token
(``benchmarks/bench_grammar.py`` measures it).

JSON is generated compactly (``", "`` and ``": "`` separators, no free whitespace), so a model
cannot loop forever on whitespace inside a document.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch
from llguidance.numpy import fill_next_token_bitmask

from prefixserve.model.text.tokenizer import Tokenizer
from prefixserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: Compiled grammars kept per engine (by the constraint's key), oldest dropped first.
MAX_CACHED_GRAMMARS = 256


#: JSON with fixed separators and no free whitespace (a schema's ``x-guidance`` may override).
_COMPACT_JSON: JsonCompileOptions = {"whitespace_flexible": False,
                                   "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says why."""


def _regex_literal(text: str) -> str:
    """``text`` as a regular expression that matches exactly it."""
    special = set("\\.^$|?*+()[]{}/")
    return "".join("\\" + c if c in special else c for c in text)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form or Lark text) of a constraint."""
    kind = spec.kind
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON schema must be an object or a boolean")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT_JSON)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=_COMPACT_JSON)
    if kind == "regex":
        assert spec.regex is not None
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        assert spec.choice is not None
        return llguidance.LLMatcher.grammar_from_regex(
            "|".join(_regex_literal(c) for c in spec.choice))
    assert spec.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


class Matcher:
    """One sequence's position in a grammar (an ``llguidance.LLMatcher``)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes into ``bitmask[row]`` (int32, ``ceil(V / 32)`` words) one bit per token id:
        1 where the token may come next."""
        fill_next_token_bitmask(self._matcher, bitmask, row)

    def consume(self, token_id: int) -> bool:
        """Advances past ``token_id``; False (and the matcher broken) if it was not allowed."""
        return bool(self._matcher.consume_token(token_id))

    def consume_all(self, token_ids: Sequence[int]) -> bool:
        return bool(self._matcher.consume_tokens(list(token_ids)))

    def rollback(self, count: int) -> bool:
        return bool(self._matcher.rollback(count))

    def is_stopped(self) -> bool:
        """True once the grammar is complete and nothing more may follow."""
        return bool(self._matcher.is_stopped())

    def is_error(self) -> bool:
        return bool(self._matcher.is_error())


class LLGuidanceBackend:
    """Compiles constraints for one tokenizer; keeps the last compiled grammars."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: dict[str, str] = {}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _llt(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer, built on first use (it costs a fraction of a second)."""
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                eos_token=self._eos or None)
        return self._lltokenizer

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The checked grammar of ``spec`` (cached by its key); :class:`GrammarError` if it
        does not compile."""
        key = spec.key
        cached = self._compiled.get(key)
        if cached is not None:
            return cached
        try:
            grammar = grammar_text(spec)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._llt())
        if is_error:
            raise GrammarError(_first_line(messages[0] if messages else "invalid grammar"))
        if len(self._compiled) >= MAX_CACHED_GRAMMARS:
            self._compiled.pop(next(iter(self._compiled)))
        self._compiled[key] = grammar
        return grammar

    def matcher(self, grammar: str) -> Matcher:
        """A fresh matcher at the start of ``grammar`` (from :meth:`compile`)."""
        matcher = llguidance.LLMatcher(self._llt(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return Matcher(matcher)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"


class GrammarState:
    """A sequence's grammar: its compiled text, its matcher (made when first needed), and how
    many output tokens, from ``start`` on, the matcher has consumed.

    ``start`` is the index in the outputs of the grammar's first token: 0, or for a lazy
    constraint the position of the first trigger token (None until one is sampled)."""

    __slots__ = ("_backend", "_grammar", "_matcher", "consumed", "preemptions", "rebuilds",
                 "start", "triggers")

    def __init__(self, backend: LLGuidanceBackend, grammar: str,
                 triggers: Sequence[int] = ()) -> None:
        self._backend = backend
        self._grammar = grammar
        self._matcher: Matcher | None = None
        self.consumed = 0
        self.preemptions = 0
        self.rebuilds = 0
        self.triggers = frozenset(triggers)
        self.start: int | None = None if triggers else 0

    def _find_start(self, outputs: Sequence[int]) -> int | None:
        if self.start is None:
            self.start = next((i for i, t in enumerate(outputs) if t in self.triggers), None)
        return self.start

    def sync(self, outputs: Sequence[int], preemptions: int = 0) -> Matcher | None:
        """The matcher, after consuming exactly ``outputs[start:]`` (rolling back, or starting
        over, when the outputs are shorter than what it consumed); None while a lazy
        constraint waits for its trigger. A sequence preempted since the last call
        (``preemptions`` grew) gets its matcher rebuilt from its tokens."""
        if preemptions != self.preemptions:
            self.preemptions = preemptions
            if self._matcher is not None:
                self.drop()
                self.rebuilds += 1
        start = self._find_start(outputs)
        if start is None:
            return None
        target = len(outputs) - start
        if self._matcher is None or self._matcher.is_error() or (target < self.consumed and \
                not self._matcher.rollback(self.consumed - target)):
            self._matcher = self._backend.matcher(self._grammar)
            self.consumed = 0
        if target > self.consumed:
            self._matcher.consume_all(outputs[start + self.consumed:])
            self.consumed = target
        return self._matcher

    def drop(self) -> None:
        """Forgets the matcher (a preempted sequence); :meth:`sync` rebuilds it from tokens."""
        self._matcher = None
        self.consumed = 0


def bitmask_rows(count: int, vocab_size: int) -> np.ndarray:
    """An all-allowed int32 bitmask of ``count`` rows for ``vocab_size`` tokens."""
    return np.full((count, (vocab_size + 31) // 32), -1, dtype=np.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` bool tensor of a bitmask (bit ``i % 32`` of word ``i // 32``)."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size].astype(bool))


class StructuredOutputs:
    """The engine's structured outputs: compiles constraints when a request is added, keeps
    each constrained sequence's :class:`GrammarState`, builds the masks of a step and advances
    the matchers by the sampled tokens."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self.backend = LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
        self._states: dict[str, GrammarState] = {}

    def compile(self, spec: StructuredOutputsParams) -> str:
        return self.backend.compile(spec)

    def add(self, sequence_id: str, grammar: str, spec: StructuredOutputsParams) -> None:
        self._states[sequence_id] = GrammarState(self.backend, grammar, spec.trigger_token_ids)

    def remove(self, sequence_id: str) -> None:
        self._states.pop(sequence_id, None)

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def state(self, sequence_id: str) -> GrammarState | None:
        return self._states.get(sequence_id)

    def masks(self, rows: Sequence[tuple[str, Sequence[int], int]]) -> dict[int, torch.Tensor]:
        """The allowed-token masks of a step: for each ``(sequence id, outputs so far,
        preemptions)`` of the rows to sample, row index -> ``[V]`` bool tensor, for
        constrained rows only (the others cost nothing)."""
        active: list[tuple[int, Matcher]] = []
        for row, (sequence_id, outputs, preemptions) in enumerate(rows):
            state = self._states.get(sequence_id)
            if state is None:
                continue
            matcher = state.sync(outputs, preemptions)
            if matcher is not None:
                active.append((row, matcher))
        if not active:
            return {}
        bitmask = bitmask_rows(len(active), self.backend.vocab_size)
        for index, (_, matcher) in enumerate(active):
            matcher.fill_bitmask(bitmask, index)
        allowed = unpack_bitmask(bitmask, self.backend.vocab_size)
        return {row: allowed[index] for index, (row, _) in enumerate(active)}
