"""SentencePiece BPE vocabularies of GGUF files (``tokenizer.ggml.model == "llama"``).

A GGUF file stores a SentencePiece BPE model as its pieces (spaces spelled ``▁``), a score and a
type per piece, and no merges. The ``tokenizers.Tokenizer`` built here works as SentencePiece
does: spaces become ``▁`` (with a leading one only when ``tokenizer.ggml.add_space_prefix``
says so), then the adjacent pair whose merged piece ranks best is merged until none is left,
and a character with no piece falls back to its UTF-8 byte pieces (``<0x41>``). The merges are
recovered from the vocabulary: every split of a piece into two pieces is a merge, ranked by the
merged piece. Gemma files rank by position in the file (their scores do not give the merge
order), others by score. Gemma files also spell pieces made of spaces only with real spaces;
they are respelled with ``▁`` so that the merges built from them apply. Control pieces
(``<bos>``, ``<start_of_turn>``) are special tokens, user-defined ones (Gemma's newline runs)
are matched whole in the text. Decoding turns ``▁`` back into spaces and byte pieces into
bytes (invalid UTF-8 becomes U+FFFD).

Imports no torch.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, processors
from tokenizers import Tokenizer as BackendTokenizer

_CONTROL = 3
_USER_DEFINED = 4
_SPACE = "\u2581"


def spm_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """The tokenizer of a GGUF file's SentencePiece BPE vocabulary (see the module docstring),
    with the BOS token added in front when ``tokenizer.ggml.add_bos_token`` is set."""
    arch = meta.get("general.architecture", "")
    tokens = [_respell(t) for t in meta["tokenizer.ggml.tokens"]]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if arch.startswith("gemma"):
        ranks = list(range(len(tokens)))
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        order = sorted(range(len(tokens)), key=lambda i: -scores[i])
        ranks = [0] * len(tokens)
        for rank, index in enumerate(order):
            ranks[index] = rank
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    backend = BackendTokenizer(models.BPE(
        vocab=vocab, merges=_merges(tokens, ranks, vocab), byte_fallback=True, fuse_unk=True,
        unk_token=tokens[unk_id] if unk_id is not None else None))
    steps: list[normalizers.Normalizer] = []
    if meta.get("tokenizer.ggml.add_space_prefix", not arch.startswith("gemma")):
        steps.append(normalizers.Prepend(_SPACE))
    steps.append(normalizers.Replace(" ", _SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types, strict=True)
                                if kind == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", True) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)])
    return backend


def _respell(token: str) -> str:
    """A piece made of spaces only, spelled with ``▁`` as the normalizer spells spaces."""
    return _SPACE * len(token) if token and not token.strip(" ") else token


def _merges(tokens: list[str], ranks: list[int], vocab: dict[str, int]
            ) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best-ranked merged piece first; the splits of
    one piece with the longer left part first."""
    found: list[tuple[int, int, str, str]] = []
    for index, token in enumerate(tokens):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((ranks[index], -cut, left, right))
    found.sort()
    return [(left, right) for _, _, left, right in found]
