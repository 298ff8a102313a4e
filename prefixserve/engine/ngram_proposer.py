"""Draft tokens by prompt lookup (n-gram speculation): what followed the last n tokens the
previous time they occurred in the sequence.

A sequence that repeats itself (code edited in place, a document quoted back, a list, a model
caught in a loop) can often be continued by copying: if its last ``n`` tokens occurred earlier
in the prompt or the output, the tokens that followed them then are a guess for what follows
now. The engine computes the guess (the draft) together with the sequence's next token in one
step and keeps the drafted tokens the model agrees with (see ``LLMEngine`` and docs/kernels.md):
a step then yields up to ``1 + num_tokens`` tokens for about the cost of one when
the step is bound by reading the weights; a greedy request gets the tokens it would get
without drafts, a sampled one tokens of the same distribution (``sampler.verify_drafts``).

Rules of :meth:`NgramProposer.propose`, for a sequence of tokens ``t[0..L)``:

* the longest ``n`` from ``max_n`` down to ``min_n`` wins whose tail ``t[L-n..L)`` occurred
  before, ending at some ``e < L - 1``; of its occurrences the most recent one is used;
* the draft is ``t[e+1 .. e+1+num_tokens)`` (fewer when the sequence ends first), or empty when
  no tail occurred before.

The lookup keeps, per sequence, a map from each n-gram (by its hash) to the end of its latest
occurrence, extended by the tokens added since the previous call: a call costs O(new tokens *
n sizes), not the length of the context, and the maps hold about 100 bytes per token and n
size (~2.8 MB for 8,192 tokens and n of 2 to 4). Two n-grams of one hash would only propose
a wrong draft, which the model rejects.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NgramProposer"]


class _Index:
    """The n-grams of one sequence that end before its last token: ``ends[n][hash(gram)]`` is
    the position of the last token of the latest occurrence of ``gram`` (a tuple of ``n``
    tokens); positions below ``indexed`` have been added."""

    __slots__ = ("ends", "indexed")

    def __init__(self, sizes: range) -> None:
        self.ends: dict[int, dict[int, int]] = {n: {} for n in sizes}
        self.indexed = 0

    def extend(self, tokens: Sequence[int], end: int) -> None:
        """Adds the n-grams ending at positions ``indexed .. end - 1``."""
        for n, ends in self.ends.items():
            for e in range(max(self.indexed, n - 1), end):
                ends[hash(tuple(tokens[e - n + 1:e + 1]))] = e
        self.indexed = max(self.indexed, end)


class NgramProposer:
    """Proposes up to ``num_tokens`` draft tokens per sequence by prompt lookup with n-grams of
    ``min_n`` to ``max_n`` tokens (module docstring). Sequences are known by an id; ``forget``
    drops one's index (the engine calls it when a request finishes, and the index is rebuilt
    if a sequence's tokens ever shrink)."""

    def __init__(self, num_tokens: int, min_n: int = 2, max_n: int = 4) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be at least 1, got {num_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.num_tokens = num_tokens
        self.sizes = range(min_n, max_n + 1)
        self._indexes: dict[str, _Index] = {}

    def propose(self, seq_id: str, tokens: Sequence[int], limit: int | None = None
                ) -> list[int]:
        """The draft for the sequence ``tokens`` (all its tokens so far, prompt first), at most
        ``limit`` tokens when given (what the sequence may still produce after its next
        token)."""
        count = self.num_tokens if limit is None else min(self.num_tokens, limit)
        length = len(tokens)
        if count <= 0 or length < self.sizes.start + 1:
            return []
        index = self._indexes.get(seq_id)
        if index is None or index.indexed > length - 1:
            index = self._indexes[seq_id] = _Index(self.sizes)
        index.extend(tokens, length - 1)
        for n in reversed(self.sizes):
            if n > length - 1:
                continue
            end = index.ends[n].get(hash(tuple(tokens[length - n:])))
            if end is not None:
                return list(tokens[end + 1:end + 1 + count])
        return []

    def forget(self, seq_id: str) -> None:
        self._indexes.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._indexes)
