"""Drives the real ``Scheduler`` over a real manager with a simulated model (one output token per
request whose prefill is done), for the scheduler's rule tests."""

from __future__ import annotations

from prefixserve.core import KVCacheManager
from prefixserve.engine.request import Request
from prefixserve.engine.scheduler import Scheduler
from prefixserve.sampling_params import SamplingParams


def make(num_blocks: int, block_size: int, budget: int, max_num_seqs: int = 8,
         chunked: bool = True, caching: bool = True, threshold: int = 0, wait: int = 0
         ) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs, budget,
                     chunked, threshold, wait)


def add(scheduler: Scheduler, rid: str, prompt: list[int]) -> Request:
    request = Request(request_id=rid, token_ids=list(prompt), prompt_token_ids=list(prompt),
                      params=SamplingParams(max_tokens=100))
    scheduler.add_request(request)
    return request


def step_counting_preemptions(scheduler: Scheduler) -> tuple[list[tuple[str, int]], int]:
    """One step and the simulated model: ``([(request id, tokens scheduled)], preempted)``."""
    out = scheduler.schedule()
    for item in out.scheduled:
        request = item.request
        request.num_computed_tokens += item.num_new_tokens
        if request.is_prefill_done:
            request.append_output_token(1)
    return [(i.request.request_id, i.num_new_tokens) for i in out.scheduled], out.num_preempted


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """One step and the simulated model; returns ``[(request id, tokens scheduled)]``."""
    return step_counting_preemptions(scheduler)[0]
