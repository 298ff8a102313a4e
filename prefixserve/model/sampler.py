"""Turn one step's logits into next tokens, following each request's :class:`SamplingParams`.

Per row, the logits go through, in this order:

1. penalties: repetition (over prompt + output tokens), then frequency and presence (over output
   tokens only), see :func:`apply_penalties`;
2. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` are masked to ``-inf`` while
   the request has fewer than ``min_tokens`` output tokens;
2b. token controls (:func:`apply_token_controls`), on the rows that have one only:
   ``logit_bias`` is added, then every token outside ``allowed_token_ids`` and outside the
   row's grammar mask (``token_masks``, from the engine's structured outputs) is set to
   ``-inf``; where the two sets share no token, the grammar's mask alone applies;
3. greedy rows take the argmax here;
4. the other rows are divided by their temperature, filtered by top-k, then top-p, then min-p
   (:func:`filter_logits`), turned into probabilities, and sampled by an exponential race:
   ``argmax(probs / E)`` with ``E = -log(U) ~ Exponential(1)``, ``U`` uniform and i.i.d. per
   token, which picks token ``i`` with probability ``probs[i]``.

Randomness: a row with a ``torch.Generator`` (made from the request's seed with
:func:`make_generator`) draws its own ``V`` uniforms from that generator, and every step of
the pipeline above works row by row, so a seeded request yields the same tokens whatever else is
in the batch. Rows without a generator share one draw from torch's default generator of the
logits' device. Greedy rows draw nothing.

Logprobs are computed from the log-softmax of the **raw** logits the model produced, before
penalties, ``min_tokens`` masking, temperature and filtering (vLLM's default "raw logprobs"
mode): they describe the model's distribution, not the one the token was drawn from.

A batch whose rows are all greedy, without penalties and without an active ``min_tokens``, is
decided by one ``argmax`` over the batch. Everything else is vectorised over the rows that need
the step, with per-row parameters as tensors; only the seeded draws loop over rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from prefixserve.outputs import Logprob
from prefixserve.sampling_params import SamplingParams

#: How many of the most likely tokens top-p examines before it falls back to a full sort.
_TOP_P_CANDIDATES = 1024

#: Rows of prompt logits turned into log-softmax at a time (bounds the temporary memory).
_PROMPT_LOGPROBS_CHUNK = 256


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs at one position: the chosen (or given) token and the top alternatives.

    ``rank`` is 1 + the number of tokens with a strictly higher logprob. ``top`` holds up to the
    requested number of ``(token_id, logprob)`` pairs, most likely first.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)

    def as_dict(self) -> dict[int, Logprob]:
        """Return ``{token_id: Logprob}``: the chosen token first, then ``top`` in rank order.

        The chosen token appears once even when it is also among the top entries.
        """
        result = {self.token_id: Logprob(self.logprob, self.rank)}
        first_index_of_value: dict[float, int] = {}
        for index, (token_id, logprob) in enumerate(self.top):
            rank = 1 + first_index_of_value.setdefault(logprob, index)
            result.setdefault(token_id, Logprob(logprob, rank))
        return result


@dataclass
class SamplerOutput:
    """What one sampling step produced, one entry per row of the batch."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """Return a generator on ``device`` seeded with ``seed``, or None when ``seed`` is None.

    Make one per request when it is admitted and pass it to every :meth:`Sampler.sample` call of
    that request. For ``n > 1`` each sequence needs a generator of its own with a distinct seed
    (e.g. ``seed + i``), else all ``n`` sequences come out identical.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def argmax_rows(logits: Tensor) -> list[int]:
    """The index of the largest value of each row of ``logits`` ``[n, V]``: the first one on
    ties, the first NaN if a row has any (``torch.argmax``'s rules). A float32 CPU tensor goes
    through numpy, whose argmax is vectorised: torch's CPU argmax is a scalar loop, ten times
    slower on a vocabulary-sized row, and splits a few rows over threads, which costs more
    than it saves (much more when the other cores are busy)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=1).tolist()
    return logits.argmax(dim=1).tolist()


def verifiable(params: SamplingParams, num_output: int) -> bool:
    """Whether a row's distribution depends on the tokens before it only through the model's
    logits: greedy or a plain draw (temperature, top-k, top-p, min-p), with no penalty, no
    active ``min_tokens`` mask, no token control and no logprobs. Its drafts can be checked
    by :func:`verify_drafts`."""
    return (num_output >= params.min_tokens and params.logprobs is None
            and not has_penalties(params) and not has_token_controls(params))


def plain_greedy(params: SamplingParams, num_output: int) -> bool:
    """Whether a row is a bare argmax: greedy and ``verifiable``."""
    return params.greedy and verifiable(params, num_output)


def draw_probabilities(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """The probabilities sampled rows draw from: each row of ``logits`` divided by its
    temperature, filtered by top-k, top-p and min-p (:func:`filter_logits`), softmaxed."""
    scaled = logits / _column((p.temperature for p in params), logits)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p) or any(m > 0.0 for m in min_p):
        scaled = filter_logits(scaled, top_k, top_p, min_p)
    return scaled.softmax(dim=1)


def verify_drafts(logits: Tensor, drafts: Sequence[int], params: SamplingParams,
                  generator: torch.Generator | None) -> list[int]:
    """The tokens a sequence gains from a step that computed its next token and ``drafts``
    (``verifiable`` params): row j of ``logits`` ``[len(drafts) + 1, V]`` is the distribution
    after draft j (row 0 after the sequence's own last token).

    Greedy: the drafts are kept while each equals the argmax before it, then the argmax after
    the last kept one. Sampled (speculative sampling with a draft that is a single token, so its
    proposal puts all its mass there): draft j is kept with probability ``p_j(draft)``; the
    first one rejected is replaced by a draw from ``p_j`` without that token, renormalised; when
    all are kept, a draw from the last row follows. Each returned token then has exactly the
    distribution the sampler would have drawn it from, given the tokens before it (``p_j``:
    ``draw_probabilities``, what :meth:`Sampler.sample` draws from). Uniforms and draws
    come from ``generator`` (None: torch's default), so a seeded request stays reproducible.
    """
    if params.greedy:
        chosen = argmax_rows(logits.float())
        kept = 0
        while kept < len(drafts) and drafts[kept] == chosen[kept]:
            kept += 1
        return [*drafts[:kept], chosen[kept]]
    probs = draw_probabilities(logits.float(), [params] * logits.shape[0])
    uniforms = torch.rand(len(drafts), generator=generator, device=probs.device).tolist()
    for j, draft in enumerate(drafts):
        if uniforms[j] < float(probs[j, draft]):
            continue
        rest = probs[j].clone()
        rest[draft] = 0.0
        token = int(torch.multinomial(rest, 1, generator=generator))
        return [*drafts[:j], token]
    last = int(torch.multinomial(probs[len(drafts)], 1, generator=generator))
    return [*drafts, last]


def has_token_controls(params: SamplingParams) -> bool:
    """True when ``logit_bias`` or ``allowed_token_ids`` is set."""
    return params.logit_bias is not None or params.allowed_token_ids is not None


def apply_token_controls(logits: Tensor, params: Sequence[SamplingParams],
                         token_masks: Mapping[int, Tensor]) -> Tensor:
    """``logits`` ``[n, V]`` with each row's ``logit_bias`` added and the tokens outside its
    ``allowed_token_ids`` and its grammar mask (``token_masks[row]``, a ``[V]`` bool tensor of
    allowed tokens) set to -inf. Rows with no control are not touched (nor copied when no row
    has one); where allowed ids and grammar share no token, the grammar alone applies, and an
    empty mask is ignored (a row always keeps some token). Grammar-only rows are masked in one
    vectorised operation."""
    controlled = sorted(i for i, p in enumerate(params) if has_token_controls(p))
    if not controlled and not token_masks:
        return logits
    result = logits.clone()
    plain = [row for row in sorted(token_masks) if row not in set(controlled)]
    if plain:
        keep = torch.stack([token_masks[row] for row in plain]).to(logits.device)
        keep |= ~keep.any(dim=1, keepdim=True)  # an empty mask keeps everything
        index = torch.tensor(plain, dtype=torch.int64, device=logits.device)
        result[index] = result[index].masked_fill(~keep, float("-inf"))
    for row in controlled:
        _control_row(result[row], params[row], token_masks.get(row))
    return result


def _control_row(line: Tensor, p: SamplingParams, keep: Tensor | None) -> None:
    """One row of :func:`apply_token_controls` with ``logit_bias`` or ``allowed_token_ids``,
    in place."""
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=line.device)
        line.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=line.dtype,
                                             device=line.device))
    if keep is not None:
        keep = keep.to(line.device)
    if p.allowed_token_ids is not None:
        allowed = torch.zeros(line.shape[0], dtype=torch.bool, device=line.device)
        allowed[torch.tensor(p.allowed_token_ids, dtype=torch.int64)] = True
        both = allowed if keep is None else allowed & keep
        keep = both if bool(both.any()) else keep
    if keep is not None and bool(keep.any()):
        line.masked_fill_(~keep, float("-inf"))


def has_penalties(params: SamplingParams) -> bool:
    """True when any of the repetition, presence or frequency penalty is active."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _column(values: Iterable[float], like: Tensor) -> Tensor:
    return torch.tensor(list(values), dtype=like.dtype, device=like.device).unsqueeze(1)


def _row_index(rows: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(list(rows), dtype=torch.int64, device=device).unsqueeze(1)


def apply_penalties(
    logits: Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> Tensor:
    """Return a penalised copy of ``logits`` ``[n, V]``; row ``i`` follows ``params[i]``.

    - Repetition penalty ``r``: for every token in the row's prompt or output, a logit ``x`` becomes
      ``x / r`` if ``x > 0`` else ``x * r`` (HF / vLLM).
    - Then frequency ``f`` and presence ``p`` (OpenAI): ``x -= f * c + p * (c > 0)`` where ``c``
      is the token's count in the output (not the prompt).

    Only the logits of tokens that occur are touched, so the cost grows with the number of
    distinct tokens, not with ``V``. Token ids must be in ``[0, V)``. ``logits`` is not modified.
    """
    result = logits.clone()
    device = logits.device
    repeat_rows = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 and (prompt_token_ids[i] or output_token_ids[i])
    ]
    if repeat_rows:
        seen = [list(set(prompt_token_ids[i]).union(output_token_ids[i])) for i in repeat_rows]
        width = max(len(ids) for ids in seen)
        # Padding repeats a row's first id: it is written twice with the same value.
        index = torch.tensor(
            [ids + [ids[0]] * (width - len(ids)) for ids in seen], dtype=torch.int64
        ).to(device)
        rows = _row_index(repeat_rows, device)
        values = result[rows, index]
        penalty = _column((params[i].repetition_penalty for i in repeat_rows), values)
        result[rows, index] = torch.where(values > 0, values / penalty, values * penalty)
    additive_rows = [
        i
        for i, p in enumerate(params)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and output_token_ids[i]
    ]
    if additive_rows:
        counts = [Counter(output_token_ids[i]) for i in additive_rows]
        width = max(len(c) for c in counts)
        ids: list[list[int]] = []
        deltas: list[list[float]] = []
        for row, row_counts in zip(additive_rows, counts, strict=True):
            frequency = params[row].frequency_penalty
            presence = params[row].presence_penalty
            padding = width - len(row_counts)
            # Padding adds 0 to token 0.
            ids.append([*row_counts.keys(), *[0] * padding])
            deltas.append(
                [-(frequency * c + presence) for c in row_counts.values()] + [0.0] * padding
            )
        index = torch.tensor(ids, dtype=torch.int64).to(device)
        delta = torch.tensor(deltas, dtype=result.dtype).to(device)
        result.index_put_((_row_index(additive_rows, device), index), delta, accumulate=True)
    return result


def _top_p_cut(sorted_probs: Tensor, limit: Tensor) -> Tensor:
    """``[n, 1]``: the probability of the first token (in the given descending order) at which the
    cumulative mass reaches ``limit``, or -1 (keep everything) where it never does."""
    width = sorted_probs.shape[1]
    position = (sorted_probs.cumsum(dim=1) < limit).sum(dim=1, keepdim=True)
    cut = sorted_probs.gather(1, position.clamp(max=width - 1))
    return torch.where(position < width, cut, torch.full_like(cut, -1.0))


def _top_p_threshold(probs: Tensor, limit: Tensor) -> Tensor:
    """``[n, 1]`` probability threshold of top-p with mass ``limit`` (``inf`` = off) per row.

    Usually the nucleus lies within the ``_TOP_P_CANDIDATES`` most likely tokens, found with
    ``topk``; only rows whose mass there stays below their limit pay for a full sort.
    """
    vocab_size = probs.shape[1]
    if vocab_size <= _TOP_P_CANDIDATES:
        return _top_p_cut(probs.sort(dim=1, descending=True).values, limit)
    candidates = probs.topk(_TOP_P_CANDIDATES, dim=1).values
    threshold = _top_p_cut(candidates, limit)
    # -1 on an active row: the candidates' mass stays below the limit, so the cut lies beyond.
    rows = ((threshold < 0) & (limit <= 1.0)).squeeze(1).nonzero().squeeze(1)
    if rows.numel() > 0:
        full = probs[rows].sort(dim=1, descending=True).values
        threshold[rows] = _top_p_cut(full, limit[rows])
    return threshold


def filter_logits(
    logits: Tensor,
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> Tensor:
    """Return a copy of ``logits`` ``[n, V]`` with the tokens each row's filters drop set to -inf.

    Filters run in this order, each on what the previous one kept:

    - top-k (``top_k[i] <= 0`` = off): drop tokens whose logit is below the k-th largest, so ties
      with the k-th token stay;
    - top-p (``top_p[i] == 1`` = off): in order of decreasing probability, the cut token is the
      first at which the cumulative mass reaches ``top_p[i]``; keep every token at least as likely
      as the cut token (the smallest such set, plus any ties with the cut token);
    - min-p (``min_p[i] == 0`` = off): drop tokens whose probability is below ``min_p[i]`` times
      the row's largest probability.

    At least one token (the most likely) always survives. ``logits`` is not modified.
    """
    vocab_size = logits.shape[1]
    neg_inf = float("-inf")
    result = logits
    k_values = [min(k, vocab_size) if k > 0 else 0 for k in top_k]
    max_k = max(k_values, default=0)
    if max_k > 0:
        top_values = result.topk(max_k, dim=1).values
        positions = torch.tensor([max(k, 1) - 1 for k in k_values], device=logits.device)
        threshold = top_values.gather(1, positions.unsqueeze(1))
        active = torch.tensor([k > 0 for k in k_values], device=logits.device).unsqueeze(1)
        threshold = threshold.masked_fill(~active, neg_inf)
        result = result.masked_fill(result < threshold, neg_inf)
    if any(p < 1.0 for p in top_p):
        probs = result.softmax(dim=1)
        limit = _column((p if p < 1.0 else float("inf") for p in top_p), probs)
        result = result.masked_fill(probs < _top_p_threshold(probs, limit), neg_inf)
    if any(p > 0.0 for p in min_p):
        probs = result.softmax(dim=1)
        threshold = probs.amax(dim=1, keepdim=True) * _column(min_p, probs)
        result = result.masked_fill(probs < threshold, neg_inf)
    return result if result is not logits else logits.clone()


def compute_token_logprobs(
    logits: Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Logprobs of ``token_ids[i]`` under the log-softmax of row ``i`` of ``logits`` ``[n, V]``.

    Row ``i`` also gets its ``num_top[i]`` most likely ``(token_id, logprob)`` pairs.
    """
    if len(token_ids) == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=1)
    chosen = torch.tensor(list(token_ids), dtype=torch.int64, device=logits.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    # An int32 sum of the comparison is several times faster than the default int64 one.
    ranks = (torch.sum(logprobs > chosen_logprobs, dim=1, dtype=torch.int32) + 1).tolist()
    chosen_list = chosen_logprobs.squeeze(1).tolist()
    max_top = min(max(num_top), logprobs.shape[1])
    if max_top > 0:
        top = logprobs.topk(max_top, dim=1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_values = [[] for _ in token_ids]
    return [
        TokenLogprobs(
            token_id=token_id,
            logprob=chosen_list[i],
            rank=ranks[i],
            top=list(zip(top_ids[i][: num_top[i]], top_values[i][: num_top[i]], strict=True)),
        )
        for i, token_id in enumerate(token_ids)
    ]


@torch.inference_mode()
def compute_prompt_logprobs(
    prompt_logits: Tensor, prompt_token_ids: Sequence[int], k: int
) -> list[dict[int, Logprob] | None]:
    """Prompt logprobs in the ``{token_id: Logprob}`` form of :meth:`TokenLogprobs.as_dict`.

    ``prompt_logits[t]`` is the model's output at prompt position ``t``, i.e. its prediction of
    token ``t + 1``; it has ``T`` or ``T - 1`` rows for a prompt of ``T`` tokens (a last row, the
    prediction of the first generated token, is ignored). Entry 0 is None (nothing predicts the
    first token); entry ``t`` holds token ``t``'s logprob and rank under the raw log-softmax of
    row ``t - 1``, and the ``k`` most likely tokens there. Rows are processed in chunks, so long
    prompts do not need a second ``[T, V]`` tensor.
    """
    num_tokens = len(prompt_token_ids)
    if num_tokens == 0:
        return []
    if prompt_logits.dim() != 2 or prompt_logits.shape[0] not in (num_tokens, num_tokens - 1):
        raise ValueError(
            f"prompt_logits must have shape [T or T - 1, V] for T = {num_tokens} prompt tokens, "
            f"got {tuple(prompt_logits.shape)}"
        )
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    result: list[dict[int, Logprob] | None] = [None]
    for start in range(0, num_tokens - 1, _PROMPT_LOGPROBS_CHUNK):
        stop = min(start + _PROMPT_LOGPROBS_CHUNK, num_tokens - 1)
        targets = prompt_token_ids[start + 1 : stop + 1]
        chunk = compute_token_logprobs(prompt_logits[start:stop], targets, [k] * len(targets))
        result.extend(entry.as_dict() for entry in chunk)
    return result


class Sampler:
    """Picks the next token of every row of a batch; stateless apart from the EOS ids."""

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        """``eos_token_ids``: the model's end-of-sequence ids, blocked while ``min_tokens`` is
        not reached (unless the request sets ``ignore_eos``)."""
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        for token_id in self.eos_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"eos_token_ids must be integers >= 0, got {token_id!r}")

    def _blocked_ids(self, params: SamplingParams, num_output: int, vocab_size: int) -> list[int]:
        """Token ids that ``min_tokens`` forbids for this row now (empty once it is reached)."""
        if num_output >= params.min_tokens:
            return []
        ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            ids.update(self.eos_token_ids)
        return sorted(token_id for token_id in ids if token_id < vocab_size)

    def sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        token_masks: Mapping[int, Tensor] | None = None,
    ) -> SamplerOutput:
        """Choose one token per row of ``logits`` ``[B, V]`` (converted to float32 if needed).

        ``params``, ``generators``, ``prompt_token_ids`` and ``output_token_ids`` each have one
        entry per row: the row's sampling parameters, its generator (None: use torch's default
        generator of the logits' device; a generator must live on that device), its prompt and
        the tokens it has generated so far (before this step). ``token_masks`` maps the rows
        under a grammar to their ``[V]`` bool masks of allowed tokens. ``logits`` is not
        modified.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [B, V], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        lengths = {len(params), len(generators), len(prompt_token_ids), len(output_token_ids)}
        if lengths != {batch}:
            raise ValueError(
                f"params, generators, prompt_token_ids and output_token_ids must each have "
                f"{batch} entries (one per logits row), got {len(params)}, {len(generators)}, "
                f"{len(prompt_token_ids)}, {len(output_token_ids)}"
            )
        token_masks = token_masks or {}
        if not token_masks and all(plain_greedy(p, len(out)) for p, out in zip(
                params, output_token_ids, strict=True)):
            # The common case, one argmax over the batch and nothing else (no penalty, no
            # min_tokens mask, no logprobs): the general path would give the same tokens.
            return SamplerOutput(argmax_rows(logits.float()), [None] * batch)
        with torch.inference_mode():
            return self._sample(logits.float(), params, generators, prompt_token_ids,
                                output_token_ids, token_masks)

    def _sample(
        self,
        raw: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        token_masks: Mapping[int, Tensor],
    ) -> SamplerOutput:
        """``sample`` of float32 logits ``raw``, the arguments checked."""
        vocab_size = raw.shape[1]
        penalised_rows = [i for i, p in enumerate(params) if has_penalties(p)]
        blocked = [
            self._blocked_ids(p, len(out), vocab_size)
            for p, out in zip(params, output_token_ids, strict=True)
        ]
        controlled = bool(token_masks) or any(has_token_controls(p) for p in params)
        if (all(p.greedy for p in params) and not penalised_rows and not any(blocked)
                and not controlled):
            token_ids = argmax_rows(raw)
        else:
            processed = self._penalise_and_block(
                raw, params, prompt_token_ids, output_token_ids, penalised_rows, blocked
            )
            if controlled:
                processed = apply_token_controls(processed, params, token_masks)
            token_ids = self._choose(processed, params, generators)
        return SamplerOutput(token_ids=token_ids, logprobs=self._logprobs(raw, params, token_ids))

    @staticmethod
    def _penalise_and_block(
        logits: Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        penalised_rows: list[int],
        blocked: list[list[int]],
    ) -> Tensor:
        """Return ``logits`` with penalties applied and ``min_tokens`` masks set (a copy when
        anything changes; the input itself is never written)."""
        result = logits
        if penalised_rows:
            if len(penalised_rows) == len(params):
                result = apply_penalties(logits, params, prompt_token_ids, output_token_ids)
            else:
                result = logits.clone()
                result[penalised_rows] = apply_penalties(
                    logits[penalised_rows],
                    [params[i] for i in penalised_rows],
                    [prompt_token_ids[i] for i in penalised_rows],
                    [output_token_ids[i] for i in penalised_rows],
                )
        if any(blocked):
            if result is logits:
                result = logits.clone()
            for row, ids in enumerate(blocked):
                if ids:
                    result[row, ids] = float("-inf")
        return result

    @staticmethod
    def _choose(
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """Argmax for greedy rows, a temperature/top-k/top-p/min-p draw for the others."""
        token_ids = [0] * len(params)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if greedy_rows:
            chosen = argmax_rows(logits if not random_rows else logits[greedy_rows])
            for row, token_id in zip(greedy_rows, chosen, strict=True):
                token_ids[row] = token_id
        if random_rows:
            chosen_list = Sampler._draw(
                logits if not greedy_rows else logits[random_rows],
                [params[i] for i in random_rows],
                [generators[i] for i in random_rows],
            )
            for row, token_id in zip(random_rows, chosen_list, strict=True):
                token_ids[row] = token_id
        return token_ids

    @staticmethod
    def _draw(
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """Sample one token per row (no greedy rows here) by an exponential race."""
        probs = draw_probabilities(logits, params)
        uniform = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            uniform.uniform_()
        elif unseeded:
            uniform[unseeded] = torch.empty_like(uniform[unseeded]).uniform_()
        for row, generator in enumerate(generators):
            if generator is None:
                continue
            if generator.device.type != logits.device.type:
                raise ValueError(
                    f"generator of row {row} is on {generator.device}, logits on {logits.device}"
                )
            uniform[row].uniform_(generator=generator)
        # -log(U) with U ~ Uniform[0, 1) is Exponential(1) (and much cheaper than exponential_
        # on CPU). The clamp keeps it off 0, where 0/0 would be NaN, which argmax would pick.
        race = uniform.log_().neg_().clamp_(min=torch.finfo(uniform.dtype).tiny)
        return argmax_rows(probs.div_(race))

    @staticmethod
    def _logprobs(
        raw_logits: Tensor, params: Sequence[SamplingParams], token_ids: list[int]
    ) -> list[TokenLogprobs | None]:
        """Raw-logit logprobs for the rows whose params ask for them, None for the others."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[TokenLogprobs | None] = [None] * len(params)
        if not rows:
            return result
        selected = raw_logits if len(rows) == len(params) else raw_logits[rows]
        entries = compute_token_logprobs(
            selected, [token_ids[i] for i in rows], [params[i].logprobs or 0 for i in rows]
        )
        for row, entry in zip(rows, entries, strict=True):
            result[row] = entry
        return result
