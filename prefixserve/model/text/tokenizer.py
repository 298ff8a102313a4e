"""Tokenizers for GGUF files and HF model directories, and incremental detokenisation.

This module must not import torch (directly or through the package): the offline estimator
tokenises prompt logs in processes that have no torch.

A GGUF file carries a byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``), its
merges, token types and a pre-tokenizer name (``tokenizer.ggml.pre``); this module rebuilds the
``tokenizers.Tokenizer`` that the original HF ``tokenizer.json`` described. An HF directory is
loaded from its ``tokenizer.json`` and ``tokenizer_config.json`` directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from prefixserve.model.arch.config import resolve_model_path
from prefixserve.model.text.chat_template import render_chat_template
from prefixserve.model.weights.gguf_file import GGUFFile

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split patterns of the pre-tokenizers that GGUF files name in ``tokenizer.ggml.pre``.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizers that put every digit on its own, then apply GPT-2's byte-level split.
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva")
_GPT2_PRES = ("default", "gpt-2", "gpt2")
_LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3")
_QWEN2_PRES = ("qwen2", "deepseek-r1-qwen")


#: Characters from which :meth:`Tokenizer.encode` takes the batch call that releases the GIL.
LONG_TEXT = 1 << 16

class Tokenizer:
    """Text <-> token ids, plus the model's chat template.

    ``eos_token_ids`` holds every id that ends generation (for chat models the end-of-turn
    token), ``bos_token_id`` may be None. ``encode(text, add_special_tokens=True)`` adds what the
    model's own tokenizer adds (for SmolLM2: nothing).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        if not self.eos_token_ids:
            return None
        return self.backend.id_to_token(self.eos_token_ids[0])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in ``text`` map to their single ids.

        A long text goes through the backend's batch call without offsets, which releases the
        GIL while it works (``encode`` holds it: a 5 MiB text kept every other thread of the
        process waiting 4.4 s, against 0.04 s this way), so a server encoding it in a worker
        thread stays responsive."""
        if len(text) < LONG_TEXT:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        encoding = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return encoding[0].ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallel in the Rust backend)."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte sequences become U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Vocabulary strings (byte-level spelling) of ``ids``; None for an unknown id."""
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> list[int] | str:
        """Render ``messages`` with the model's chat template, as HF ``apply_chat_template``.

        Returns the text, or with ``tokenize=True`` its ids encoded without adding special
        tokens (the template writes them). Extra keyword arguments (``tools``, ...) become
        template variables. Raises ValueError when the model has no chat template, and
        ``ChatTemplateError`` when the template calls ``raise_exception``.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens={"bos_token": self.bos_token, "eos_token": self.eos_token},
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text pieces, one :meth:`add` call per step.

    Invariants: a piece never ends inside a UTF-8 character (text that still ends with U+FFFD
    is held back until later ids complete it); the concatenation of every piece returned by
    :meth:`add` and finally :meth:`flush` equals ``tokenizer.decode(all_output_ids)`` for
    byte-level BPE tokenizers. Up to five prompt ids serve as left context, so tokenizers whose
    decoder strips a leading space (SentencePiece) keep the space that the prompt implies on
    the first piece, as streaming servers do.
    """

    _CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-self._CONTEXT_TOKENS :])
        context_text = self._decode(context)
        if context_text.endswith("\ufffd"):
            # The prompt ends inside a character: outputs would complete it and the pieces
            # would no longer add up to the decoded outputs, so start without context.
            context, context_text = [], ""
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _emit(self, text: str) -> str:
        piece = text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return piece

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids`` and return the newly finished text ("" when none is)."""
        self._ids.extend(new_ids)
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Return whatever is held back (an unfinished character as U+FFFD) at end of stream."""
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text):
            return ""
        return self._emit(text)


def load_tokenizer(model: str | None = None, gguf: GGUFFile | None = None) -> Tokenizer:
    """Load the tokenizer of ``model``: a ``.gguf`` path, an HF directory, or None (default).

    An HF directory needs ``tokenizer.json`` (and usually ``tokenizer_config.json``); it may
    hold a tokenizer only, without the model's ``config.json``. ``gguf`` is the model's GGUF
    file already opened (the engine opens it once for the tokenizer and the weights: parsing a
    262,144-piece vocabulary takes a quarter of a second).
    """
    if model is not None and os.path.isfile(os.path.join(model, "tokenizer.json")):
        return _tokenizer_from_hf_dir(model)
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        return _tokenizer_from_gguf((gguf or GGUFFile(path)).metadata)
    return _tokenizer_from_hf_dir(path)


def _tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _spm_tokenizer_from_gguf(meta)
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2' and "
            "SentencePiece BPE 'llama'); use the model's HF directory instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    pre = meta.get("tokenizer.ggml.pre", "default")
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_PRES)
    )
    _set_pre_tokenizer(backend, pre)
    backend.decoder = decoders.ByteLevel()
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    # BOS: we follow the file's tokenizer.ggml.add_bos_token flag, which is what HF transformers
    # does for GGUF files, defaulting to False for byte-level BPE. SmolLM2's file says False,
    # which matches SmolLM2's own HF tokenizer (it adds no BOS).
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos and bos is not None:
        bos_token = tokens[bos]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A $B", special_tokens=[(bos_token, bos)]
        )
    eos: tuple[int, ...] = ()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        token_id = meta.get(key)
        if token_id is not None and token_id not in eos:
            eos += (token_id,)
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=eos,
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _spm_tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """A SentencePiece BPE vocabulary (:mod:`prefixserve.model.text.spm_tokenizer`)."""
    from prefixserve.model.text.spm_tokenizer import spm_backend

    eos: tuple[int, ...] = ()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        token_id = meta.get(key)
        if token_id is not None and token_id not in eos:
            eos += (token_id,)
    return Tokenizer(spm_backend(meta), bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                     eos_token_ids=eos, chat_template=meta.get("tokenizer.chat_template"))


def _set_pre_tokenizer(backend: BackendTokenizer, pre: str) -> None:
    """Install the normalizer/pre-tokenizer that GGUF pre-tokenizer name ``pre`` stands for."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRES:
        backend.pre_tokenizer = byte_level
    elif pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if pre in _QWEN2_PRES:
            backend.normalizer = normalizers.NFC()
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _tokenizer_from_hf_dir(path: str) -> Tokenizer:
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise FileNotFoundError(f"{path} has no tokenizer.json")
    backend = BackendTokenizer.from_file(tokenizer_file)
    tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    model_cfg = _read_json(os.path.join(path, "config.json"))
    gen_cfg = _read_json(os.path.join(path, "generation_config.json"))

    def token_id(value: str | dict[str, Any] | None) -> int | None:
        content = _token_content(value)
        return None if content is None else backend.token_to_id(content)

    bos = token_id(tok_cfg.get("bos_token"))
    if bos is None:
        bos = model_cfg.get("bos_token_id")
    eos: list[int] = []
    candidates: list[Any] = [token_id(tok_cfg.get("eos_token"))]
    for cfg in (gen_cfg, model_cfg):
        value = cfg.get("eos_token_id")
        candidates.extend(value if isinstance(value, list) else [value])
    for candidate in candidates:
        if candidate is not None and candidate not in eos:
            eos.append(candidate)
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=tuple(eos), chat_template=template)
