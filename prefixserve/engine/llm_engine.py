"""The engine loop: schedule, run the model, sample, detokenise, stop, free.

``LLMEngine`` is single-threaded: every call must come from one thread (``AsyncLLM`` runs it in
a background thread of its own).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixserve.core import KVCacheManager, MultiModalInput, PrefixCachingMetrics
from prefixserve.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig, parse_memory
from prefixserve.engine.errors import QueueFullError, RequestError
from prefixserve.engine.request import Request, make_request_output
from prefixserve.engine.scheduler import Scheduler, SchedulerOutput
from prefixserve.model.dtypes import resolve_dtype
from prefixserve.model.loader import load_model
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.sampler import Sampler, compute_prompt_logprobs, make_generator
from prefixserve.model.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams

logger = logging.getLogger("prefixserve.engine")


@dataclass
class EngineStats:
    """A snapshot for logs and metrics: gauges now, counters since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int


class LLMEngine:
    """Owns the tokenizer, the model runner, the KV cache manager and the scheduler."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.tokenizer: Tokenizer = load_tokenizer(config.model)
        self.model_config, model = load_model(config.model, self.dtype, config.device)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            memory = parse_memory(config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
            num_blocks = ModelRunner.num_blocks_for_memory(self.model_config, self.dtype,
                                                           config.block_size, memory)
        if num_blocks < 2:
            raise ValueError("kv_cache_memory is too small for two KV blocks")
        self.runner = ModelRunner(self.model_config, model, num_blocks, config.block_size,
                                  self.dtype, config.device)
        capacity = num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, capacity)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, enable_caching=config.prefix_caching,
            hash_algo=config.prefix_caching_hash_algo)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill)
        self.sampler = Sampler(self.model_config.eos_token_ids)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.metrics = PrefixCachingMetrics()
        # The request id a caller sees -> its ``n`` sibling sequences (``Request.group_id`` is
        # that parent id). Not the attention groups of ``prefixserve.model``.
        self.groups: dict[str, list[Request]] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_step_scheduled = False

    # ------------------------------------------------------------------ what the engine is
    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size: token ids are in ``[0, vocab_size)``."""
        return self.model_config.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        """The number of blocks in the KV cache."""
        return self.kv_cache_manager.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per KV cache block."""
        return self.config.block_size

    @property
    def max_waiting_requests(self) -> int | None:
        """The most sequences the waiting queue holds (None: unbounded)."""
        return self.config.max_waiting_requests

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_id: int | str | None = None,
        mm_inputs: Sequence[MultiModalInput] = (),
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
    ) -> str:
        """Queues a prompt (text, or token ids used as given) and returns its request id.

        Raises ``RequestError`` for a request that could never run (empty, longer than the
        context, token ids out of the vocabulary, longer than one step without chunked prefill,
        more sequences than the queue holds) and ``QueueFullError`` when the queue has no room
        for its ``n`` sequences now. Nothing is queued unless it can be scheduled."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        self._check_queue_room(params.n)
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text = None
            token_ids = list(prompt)
        self._check_prompt(token_ids)
        arrival = arrival_time or time.time()
        children = []
        for index in range(params.n):
            seed = None if params.seed is None else (params.seed + index) % 2**64
            request = Request(
                request_id=f"{request_id}#{index}" if params.n > 1 else request_id,
                group_id=request_id,
                token_ids=list(token_ids),
                cache_salt=cache_salt,
                lora_id=lora_id,
                mm_inputs=tuple(mm_inputs),
                wants_prompt_logprobs=params.prompt_logprobs is not None,
                prompt=text,
                prompt_token_ids=token_ids,
                params=params,
                index=index,
                generator=make_generator(seed, self.config.device),
                detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids,
                                                   params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
            )
            request.metrics.arrival_time = arrival
            children.append(request)
        self.groups[request_id] = children
        for request in children:
            self.scheduler.add_request(request)
        return request_id

    def _check_queue_room(self, n: int) -> None:
        """The waiting queue holds at most ``max_waiting_requests`` sequences (each of the ``n``
        sequences of a request waits on its own): a request is queued whole or refused."""
        limit = self.config.max_waiting_requests
        if limit is None:
            return
        if n > limit:
            raise RequestError(
                f"the request asks for {n} sequences, but the waiting queue holds at most "
                f"{limit} (--max-waiting-requests)")
        waiting = len(self.scheduler.waiting)
        if waiting + n > limit:
            raise QueueFullError(f"the waiting queue is full ({waiting} of {limit} sequences "
                                 f"waiting, {n} more asked for)")

    def validate_prompt(self, token_ids: Sequence[int], max_tokens: int | None = None) -> None:
        """Raises ``RequestError`` unless the prompt is non-empty, in the vocabulary, shorter than
        the context and, with ``max_tokens``, leaves room for that many more tokens (the error
        names ``max_tokens`` as its ``param`` then). Reads only what is fixed once the engine is
        built, so any thread may call it."""
        if not token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        limit, length = self.max_model_len, len(token_ids)
        if length >= limit:
            raise RequestError(f"the prompt has {length} tokens, but this model's context is "
                               f"{limit} tokens and at least one must be left to generate",
                               code="context_length_exceeded")
        if max_tokens is not None and length + max_tokens > limit:
            raise RequestError(f"this model's context is {limit} tokens, but the prompt has "
                               f"{length} and max_tokens asks for {max_tokens} more; lower "
                               "max_tokens or shorten the prompt",
                               code="context_length_exceeded", param="max_tokens")

    def _check_prompt(self, token_ids: list[int]) -> None:
        """``validate_prompt``, then whether the scheduler could ever run the prompt."""
        self.validate_prompt(token_ids)
        reason = self.scheduler.check_admissible(len(token_ids))
        if reason is not None:
            raise RequestError(reason)

    def sequences(self, request_id: str) -> list[Request]:
        """The ``n`` sequences of a request, from ``add_request`` until the output that finishes
        it is handed out (a ``KeyError`` after that, or for an unknown id). The list is the
        engine's own: read it, do not modify it."""
        return self.groups[request_id]

    def abort_request(self, request_id: str) -> bool:
        """Stops a request wherever it is and frees its blocks; returns whether it existed."""
        children = self.groups.pop(request_id, None)
        if children is None:
            return False
        for request in children:
            if not request.is_finished:
                request.finish_reason = "abort"
                self._finish(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, also while requests run; returns True.

        Every cached hash is dropped at once: nothing computed before the reset is found again.
        Running requests keep their blocks (which go back to the pool uncached when freed) and
        cache the blocks they fill afterwards as usual."""
        return self.kv_cache_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step and returns an output (new tokens and text since the last
        one) for each request that produced something or finished.

        ``last_step_scheduled`` says whether the step ran anything: False means no work can
        run until something changes (a request arrives or is aborted), so a loop driving the
        engine should wait for new work rather than step again at once."""
        sched = self.scheduler.schedule()
        self.metrics.observe(self.kv_cache_manager.make_prefix_cache_stats())
        self.last_step_scheduled = bool(sched.scheduled)
        if not sched.scheduled:
            return []
        self._run(sched)
        return self._collect(sched)

    def _run(self, sched: SchedulerOutput) -> None:
        seqs = []
        for item in sched.scheduled:
            request = item.request
            start = request.num_computed_tokens
            seqs.append(SeqBatchInput(
                token_ids=list(request.token_ids[start:start + item.num_new_tokens]),
                start_pos=start,
                block_table=self.kv_cache_manager.get_block_ids(request),
                need_prompt_logits=(request.wants_prompt_logprobs
                                    and start < request.num_prompt_tokens),
            ))
        result = self.runner.execute(seqs)
        sampling_rows = []
        for row, item in enumerate(sched.scheduled):
            request = item.request
            if request.wants_prompt_logprobs and result.prompt_logits[row] is not None:
                self._add_prompt_logprobs(request, seqs[row], result.prompt_logits[row])
            request.num_computed_tokens += item.num_new_tokens
            if request.is_prefill_done:
                sampling_rows.append(row)
        if not sampling_rows:
            return
        requests = [sched.scheduled[r].request for r in sampling_rows]
        logits = result.logits if len(sampling_rows) == len(seqs) else \
            result.logits[torch.tensor(sampling_rows)]
        sampled = self.sampler.sample(
            logits,
            [r.params for r in requests],
            [r.generator for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
        )
        now = time.time()
        for request, token, logprobs in zip(requests, sampled.token_ids, sampled.logprobs,
                                             strict=True):
            self._append_token(request, token, now)
            if request.logprobs is not None and logprobs is not None:
                request.logprobs.append(logprobs.as_dict())

    @staticmethod
    def _add_prompt_logprobs(request: Request, seq: SeqBatchInput,
                             logits: torch.Tensor) -> None:
        """Adds the logprobs of the prompt tokens this chunk predicts that are not known yet
        (a chunk recomputed after preemption adds nothing twice). Row j of ``logits`` predicts
        the token at position ``seq.start_pos + j + 1``."""
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]
        start = seq.start_pos
        first = max(len(request.prompt_logprobs), start + 1)
        last = min(start + len(seq.token_ids), request.num_prompt_tokens - 1)
        if first > last:
            return
        rows = logits[first - start - 1 : last - start]
        tokens = list(request.token_ids[first - 1 : last + 1])
        entries = compute_prompt_logprobs(rows, tokens, request.params.prompt_logprobs or 0)
        request.prompt_logprobs.extend(entries[1:])

    def _append_token(self, request: Request, token: int, now: float) -> None:
        if request.is_finished:
            return
        request.token_ids.append(token)
        request.output_token_ids.append(token)
        self.generation_tokens += 1
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.prompt_tokens += request.num_prompt_tokens
        metrics.last_token_time = now
        params = request.params
        num_out = len(request.output_token_ids)
        if params.stop_token_ids and token in params.stop_token_ids and num_out > params.min_tokens:
            request.finish_reason, request.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos \
                and num_out > params.min_tokens:
            request.finish_reason = "stop"
        else:
            assert request.detokenizer is not None
            searched = len(request.text)
            request.text += request.detokenizer.add([token])
            if params.stop and num_out >= params.min_tokens:
                self._check_stop_strings(request, searched)
        if request.finish_reason is None:
            out_of_budget = params.max_tokens is not None and num_out >= params.max_tokens
            if out_of_budget or request.num_tokens >= self.max_model_len:
                request.finish_reason = "length"
        if request.finish_reason is not None:
            if request.finish_reason == "length":
                assert request.detokenizer is not None
                request.text += request.detokenizer.flush()
            self._finish(request)

    @staticmethod
    def _check_stop_strings(request: Request, searched: int) -> None:
        """Finishes the request at the first stop string that ends in the text added after
        ``searched`` characters, truncating the text there (or after it, when asked)."""
        text = request.text
        for stop in request.params.stop:
            position = text.find(stop, max(0, searched - len(stop) + 1))
            if position < 0:
                continue
            keep = position + len(stop) if request.params.include_stop_str_in_output \
                else position
            request.text = text[:keep]
            request.finish_reason, request.stop_reason = "stop", stop
            return

    def _finish(self, request: Request) -> None:
        request.metrics.finished_time = time.time()
        self.scheduler.finish_request(request)

    def _collect(self, sched: SchedulerOutput) -> list[RequestOutput]:
        outputs = []
        seen = set()
        for item in sched.scheduled:
            request = item.request
            parent_id = request.group_id
            if parent_id in seen or parent_id not in self.groups:
                continue
            seen.add(parent_id)
            outputs.append(self._parent_output(parent_id))
        return outputs

    def _parent_output(self, parent_id: str) -> RequestOutput:
        """The delta output of a request: what each of its sequences added since the last
        output; a sequence whose finish was already handed out is left out."""
        children = self.groups[parent_id]
        output = make_request_output(
            parent_id, children, [c.completion(True) for c in children if not c.finish_sent])
        if output.finished:
            del self.groups[parent_id]
        return output

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        manager = self.kv_cache_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=manager.usage,
            num_free_blocks=manager.num_free_blocks,
            num_blocks=manager.num_blocks,
            prefix_cache_hit_rate=self.metrics.hit_rate,
            prefix_cache_queries=self.metrics.queries,
            prefix_cache_hits=self.metrics.hits,
            prefix_cache_query_tokens=self.metrics.query_tokens,
            prefix_cache_hit_tokens=self.metrics.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
        )
