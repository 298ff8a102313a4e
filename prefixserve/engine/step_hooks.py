"""What runs around the three parts of an engine step (schedule, run the model, process the
outputs): the cache tiers, n-gram speculation, and the clean-up of finished requests.

``LLMEngine.step`` calls every hook at five points, in the order they were added:

* ``before_schedule()``: tier loads enter the pool, drafts are proposed for the decodes;
* ``when_idle()``: nothing was scheduled; True if the hook waited for work it will bring
  (tier fetches in flight), so the step counts as one that ran;
* ``before_execute()`` and ``after_execute(requests)``: around the model (the tiers read the
  blocks the step is about to overwrite and write the blocks it filled, before finished
  requests free them);
* ``after_step(requests)``: after the outputs were processed (finished requests freed):
  window layers free what slid out, finished requests leave the grammar and n-gram indexes.
"""

from __future__ import annotations

from prefixserve.engine.ngram_proposer import NgramProposer
from prefixserve.engine.request import Request
from prefixserve.engine.scheduler import Scheduler
from prefixserve.engine.structured_output import StructuredOutputs
from prefixserve.engine.tier_manager import KVTierManager
from prefixserve.model.sampler import verifiable


class StepHook:
    """A hook of ``LLMEngine.step``: each method does nothing unless a hook overrides it."""

    def before_schedule(self) -> None:
        """Before the scheduler runs."""

    def when_idle(self) -> bool:
        """When nothing was scheduled: whether this hook waited for work it will bring."""
        return False

    def before_execute(self) -> None:
        """Before the model runs the scheduled tokens."""

    def after_execute(self, requests: list[Request]) -> None:
        """After the model ran ``requests``, before their outputs are processed."""

    def after_step(self, requests: list[Request]) -> None:
        """After the outputs of ``requests`` were processed (finished ones freed)."""


class TierHook(StepHook):
    """The cache tiers' part of a step: loads enter the pool, evicted and computed blocks
    go down."""

    def __init__(self, tiers: KVTierManager) -> None:
        self.tiers = tiers

    def before_schedule(self) -> None:
        self.tiers.apply_loads()

    def when_idle(self) -> bool:
        if not self.tiers.has_pending:
            return False
        self.tiers.wait_for_loads()  # the loads will bring work by themselves
        return True

    def before_execute(self) -> None:
        self.tiers.before_execute()

    def after_execute(self, requests: list[Request]) -> None:
        self.tiers.after_execute(requests)


class SpeculationHook(StepHook):
    """n-gram drafts for the decoding requests before each schedule; a finished request's
    n-gram index dropped after."""

    def __init__(self, proposer: NgramProposer, scheduler: Scheduler,
                 structured: StructuredOutputs, max_model_len: int) -> None:
        self.proposer = proposer
        self.scheduler = scheduler
        self.structured = structured
        self.max_model_len = max_model_len

    def before_schedule(self) -> None:
        """Drafts for the running requests that decode a plain sequence (greedy or a plain
        draw: no penalty, token control, grammar or logprobs, so that the model's logits alone
        give the distribution of each position and ``verify_drafts`` can check a draft), as
        many as each may still produce after its next token."""
        for request in self.scheduler.running:
            if request.draft_token_ids:  # last step's, verified or dropped
                request.draft_token_ids = []
            num_out = len(request.output_token_ids)
            params = request.params
            if (request.num_computed_tokens != request.num_tokens - 1 or not num_out
                    or not verifiable(params, num_out) or params.prompt_logprobs is not None
                    or request.request_id in self.structured):
                continue
            room = self.max_model_len - request.num_tokens
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - num_out)
            request.draft_token_ids = self.proposer.propose(request.request_id,
                                                            request.token_ids, room - 1)

    def after_step(self, requests: list[Request]) -> None:
        for request in requests:
            if request.is_finished:
                self.proposer.forget(request.request_id)


class CleanupHook(StepHook):
    """After each step: window layers free the blocks that slid out of every window, and
    finished requests leave the grammar states."""

    def __init__(self, scheduler: Scheduler, structured: StructuredOutputs) -> None:
        self.scheduler = scheduler
        self.structured = structured

    def after_step(self, requests: list[Request]) -> None:
        self.scheduler.release_out_of_window(requests)
        if not len(self.structured):
            return
        for request in requests:
            if request.is_finished and request.request_id in self.structured:
                self.structured.remove(request.request_id)
