"""The scheduler's request: the prefix cache's ``CacheRequest`` plus what sampling needs.

What a request has produced for its caller (text, logprobs, why it finished, how much of it was
already handed out) is output state, kept by ``engine/output_processor.py``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixserve.core import CacheRequest
from prefixserve.outputs import RequestMetrics
from prefixserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # a generator is all of torch a request holds: the scheduler loads no torch
    import torch

    from prefixserve.model.vision.image import DecodedImage


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request(CacheRequest):
    """One sequence being generated (``index`` of the ``n`` of request ``group_id``).

    ``token_ids`` (from ``CacheRequest``, a list here) is the prompt followed by the outputs so
    far; ``output_token_ids`` repeats the outputs for the sampler (``append_output_token`` grows
    both), and ``prompt_token_ids`` keeps the
    prompt (shared by the ``n`` sequences of a request, never modified), so no step has to slice
    it out of ``token_ids`` again. ``num_cached_tokens`` is the number of prompt tokens served
    from the prefix cache when the request was first scheduled (-1 before). ``block_ids`` are the
    ids of the blocks it holds, in position order (``KVCacheManager.get_block_ids``), kept by the
    scheduler as the blocks are allocated: while the request runs it is one list that only
    grows at its end, and it is a new list each time the request is admitted or resumed, so a
    step reads it without rebuilding it. ``status`` is
    ``FINISHED`` once ``Scheduler.finish_request`` has released the request, which the output
    processor asks for as soon as the sequence has a finish reason.

    With cache tiers (``engine/tier_manager.py``): ``tier_origin`` lists ``(first block, end
    block, tier)`` runs loaded from a tier for this request, ``num_cached_tokens_by_tier`` splits
    ``num_cached_tokens`` into ``pool`` and each tier (None without tiers, or before the first
    scheduling), and ``tier_blocks_seen`` counts the leading full blocks already offered to the
    tiers.
    """

    token_ids: list[int]
    group_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    generator: torch.Generator | None = None
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    extra_block_ids: tuple[list[int], ...] = ()
    """With a hybrid KV cache: the block ids of KV cache groups 1, 2, ... (``block_ids`` are
    group 0's)."""
    tier_origin: list[tuple[int, int, str]] = field(default_factory=list)
    num_cached_tokens_by_tier: dict[str, int] | None = None
    tier_blocks_seen: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    """With n-gram speculation: the tokens proposed to follow this decoding request's next one
    (``engine/ngram_proposer.py``); not part of ``token_ids`` until the model agrees."""
    images: tuple[DecodedImage, ...] = ()
    """The prompt's images, ``images[i]`` at ``mm_inputs[i]`` (``engine/multimodal.py``): kept
    until the request ends, since a preempted request may need their embeddings again."""

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_tokens

    def append_output_token(self, token_id: int) -> None:
        """Appends a generated token to ``token_ids`` and ``output_token_ids``."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
