"""User-facing sampling parameters of one request.

The names and defaults follow vLLM's ``SamplingParams`` so that code written for vLLM (or for the
OpenAI API, whose fields map onto these) works unchanged. Every field is checked in
``__post_init__``; a bad value raises ``SamplingParamsError`` (a ``ValueError``) whose ``param``
names the field and whose message gives the allowed range, so the HTTP layer can hand it back to
the caller as a 400 error naming the field.

A plain value, importable without torch: every layer may import this module
(docs/architecture.md), and it imports nothing else of prefixserve.
"""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass
from typing import Any

#: Temperatures below this are treated as 0, i.e. greedy decoding (argmax).
GREEDY_TEMPERATURE_EPS = 1e-5

#: Largest number of top logprobs a request may ask for (the OpenAI API limit).
MAX_LOGPROBS = 20

#: Range accepted by ``torch.Generator.manual_seed``.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


class SamplingParamsError(ValueError):
    """A field of :class:`SamplingParams` out of its range: ``param`` names the field, the
    message says what it accepts."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}")
    return value


def _check_float(name: str, value: Any, param: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingParamsError(param or name, f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise SamplingParamsError(param or name, f"{name} must not be NaN")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be a bool, got {value!r}")
    return value


GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, enforced token by token by the engine's grammar backend
    (``prefixserve.engine.structured_output``); exactly one of the constraint fields is set.

    - ``json``: a JSON schema (a dict, or its JSON text): the output is one JSON value that
      validates against it;
    - ``json_object``: any JSON object;
    - ``regex``: the output matches the regular expression as a whole;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a Lark grammar (llguidance's dialect, which also embeds ``%json {...}``).

    ``trigger_token_ids`` makes the constraint lazy: the output is free until the model samples
    one of these tokens, and from that token on (it is the constrained text's first token) the
    grammar applies; used for ``tool_choice: "auto"``. A frozen value: its ``key`` (a string)
    identifies the compiled grammar, so equal constraints compile once.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    trigger_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = [kind for kind in GRAMMAR_KINDS
                 if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs", "structured_outputs needs exactly one of json, json_object, "
                             f"regex, choice, grammar; got {given or 'none'}")
        if self.choice is not None:
            if not isinstance(self.choice, tuple | list) or not self.choice or not all(
                    isinstance(c, str) for c in self.choice):
                raise SamplingParamsError("structured_outputs", "structured_outputs.choice must "
                                          "be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        object.__setattr__(self, "trigger_token_ids", tuple(self.trigger_token_ids))

    @property
    def kind(self) -> str:
        """Which constraint field is set."""
        return next(k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """A string that identifies the constraint (equal keys, equal grammars)."""
        value = getattr(self, self.kind)
        text = _json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
        return f"{self.kind}:{text}"


@dataclass
class SamplingParams:
    """How to pick the output tokens of one request, and when to stop.

    Sampling (applied by :class:`prefixserve.model.sampler.Sampler` in this order):

    - ``repetition_penalty`` (> 0, 1 = off): every token that occurs in the prompt or in the
      output so far has its logit divided by the penalty when positive, multiplied when negative.
    - ``presence_penalty`` / ``frequency_penalty`` (each in [-2, 2], 0 = off): the OpenAI formula
      ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` where ``count`` is
      how often the token occurs in the output so far (the prompt does not count).
    - ``min_tokens`` (>= 0): while fewer tokens have been generated, the EOS token ids (unless
      ``ignore_eos``) and ``stop_token_ids`` cannot be sampled. Stop strings are not blocked at
      the token level; the detokenizer ignores them while fewer than ``min_tokens`` exist.
    - ``temperature`` (>= 0): values below ``GREEDY_TEMPERATURE_EPS`` mean greedy (argmax), and
      then ``top_k``, ``top_p``, ``min_p`` and ``seed`` have no effect.
    - ``top_k`` (>= -1; 0 or -1 = off, normalised to 0): keep the k most likely tokens (ties with
      the k-th are kept too).
    - ``top_p`` (in (0, 1], 1 = off): keep the smallest set of most likely tokens whose
      probability mass reaches ``top_p``.
    - ``min_p`` (in [0, 1], 0 = off): drop tokens whose probability is below ``min_p`` times the
      probability of the most likely token.
    - ``seed`` (int or None): a per-request random generator seeded with it makes the output
      reproducible whatever else is in the batch.

    Stopping and output: ``max_tokens`` (>= 1, or None for "until the context is full"),
    ``stop`` (strings; normalised to a list), ``stop_token_ids`` (normalised to a list),
    ``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``.

    ``n`` (>= 1) is the number of sequences to generate for the prompt. ``logprobs`` (None or
    0..20) asks for the chosen token's logprob plus that many top alternatives per generated
    token; ``prompt_logprobs`` (None or 0..20) the same for every prompt token after the first.

    Token controls, applied after the penalties: ``logit_bias`` (``{token_id: bias}``, each in
    [-100, 100], added to the logits; OpenAI's form), ``allowed_token_ids`` (only these may be
    sampled) and ``structured_outputs`` (a grammar; see :class:`StructuredOutputsParams`). A
    grammar decides where a constrained output ends: ``stop``, ``stop_token_ids``,
    ``min_tokens`` and ``ignore_eos`` do not apply to it (a stop string could cut a JSON
    document in half), and ``allowed_token_ids`` narrows the grammar's choice only where the
    two leave some token.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        """Validate every field and normalise ``stop``, ``stop_token_ids`` and ``top_k``."""
        if _check_int("n", self.n) < 1:
            raise SamplingParamsError("n", f"n must be >= 1, got {self.n}")
        self._check_sampling()
        self._check_penalties()
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self._check_lengths_and_outputs()
        self._check_token_controls()

    def _check_token_controls(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias must be a map of token id to bias, got "
                                 f"{self.logit_bias!r}")
            bias = {}
            for token_id, value in self.logit_bias.items():
                if _check_int("logit_bias key", token_id) < 0:
                    raise SamplingParamsError(
                        "logit_bias", f"logit_bias keys must be token ids >= 0, got {token_id}")
                value = _check_float("logit_bias value", value, "logit_bias")
                if not -100.0 <= value <= 100.0:
                    raise SamplingParamsError(
                        "logit_bias", f"logit_bias values must be in [-100, 100], got {value}")
                bias[token_id] = value
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self._normalise_stop_token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not ids:
                raise SamplingParamsError(
                    "allowed_token_ids", "allowed_token_ids must not be empty")
            self.allowed_token_ids = ids
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError(
                "structured_outputs", "structured_outputs must be a StructuredOutputsParams")

    def _check_sampling(self) -> None:
        self.temperature = _check_float("temperature", self.temperature)
        if not 0.0 <= self.temperature < math.inf:
            raise SamplingParamsError(
                "temperature", f"temperature must be >= 0 and finite, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if _check_int("top_k", self.top_k) < -1:
            raise SamplingParamsError(
                "top_k", f"top_k must be -1, 0 (both mean off) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not MIN_SEED <= _check_int("seed", self.seed) <= MAX_SEED:
            raise SamplingParamsError(
                "seed", f"seed must be None or an integer in [{MIN_SEED}, {MAX_SEED}], got "
                f"{self.seed}"
            )

    def _check_penalties(self) -> None:
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise SamplingParamsError(
                "repetition_penalty",
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

    def _check_lengths_and_outputs(self) -> None:
        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise SamplingParamsError(
                "max_tokens", f"max_tokens must be None or >= 1, got {self.max_tokens}")
        if _check_int("min_tokens", self.min_tokens) < 0:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= _check_int(name, value) <= MAX_LOGPROBS:
                raise SamplingParamsError(
                    name, f"{name} must be None or in [0, {MAX_LOGPROBS}], got {value}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple):
            raise SamplingParamsError(
                "stop", f"stop must be None, a string or a list of strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError(
                    "stop", f"stop must contain only non-empty strings, got {s!r}")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any, name: str = "stop_token_ids") -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, list | tuple):
            raise SamplingParamsError(
                name, f"{name} must be None or a list of integers, got {ids!r}")
        for token_id in ids:
            if _check_int(f"{name} element", token_id) < 0:
                raise SamplingParamsError(name, f"{name} must contain ids >= 0, got {token_id}")
        return list(ids)

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature below ``GREEDY_TEMPERATURE_EPS``)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
