"""The engine loop: schedule, run the model and sample, process the outputs.

``step`` is those three parts: ``Scheduler.schedule`` picks the tokens to compute, ``_execute``
runs the model over them and samples, and ``OutputProcessor.process``
(``engine/output_processor.py``) appends the tokens, detokenises, finishes sequences through
the scheduler and builds the delta outputs.

``LLMEngine`` is single-threaded: every call must come from one thread (``AsyncLLM`` runs it in
a background thread of its own).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from prefixserve.core import (
    MAX_PRIORITY,
    CacheRequest,
    PinBudgetError,
    PrefixCachingMetrics,
    Retention,
)
from prefixserve.core.kv_events import KVEventBatch, KVEventPublisher, KVSnapshot
from prefixserve.core.tiers import TierStats
from prefixserve.engine.cache_board import BoardView, CacheBoard
from prefixserve.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig, parse_memory
from prefixserve.engine.errors import QueueFullError, RequestError
from prefixserve.engine.host_allocator import keep_freed_memory
from prefixserve.engine.kv_cache_setup import log_kv_capacity, make_engine_kv_cache
from prefixserve.engine.lora_registry import LoRACacheCounts, LoRAInfo, LoRARegistry
from prefixserve.engine.multimodal import ImageInputs, PlacedImages
from prefixserve.engine.ngram_proposer import NgramProposer
from prefixserve.engine.output_processor import (
    ExecutedStep,
    OutputProcessor,
    PromptLogprobsChunk,
    RequestState,
    SampledToken,
    SequenceState,
)
from prefixserve.engine.request import Request
from prefixserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from prefixserve.engine.step_hooks import CleanupHook, SpeculationHook, StepHook, TierHook
from prefixserve.engine.structured_output import GrammarError, StructuredOutputs
from prefixserve.engine.tier_manager import (
    KVTierManager,
    make_tier_manager,
    model_identity,
    namespace_of,
    tier_hash_root,
)
from prefixserve.model.arch.config import resolve_model_path
from prefixserve.model.arch.lora import install_lora
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.sampler import (
    Sampler,
    compute_prompt_logprobs,
    make_generator,
    verify_drafts,
)
from prefixserve.model.text.tokenizer import Tokenizer, load_tokenizer
from prefixserve.model.vision.image import DecodedImage
from prefixserve.model.vision.loader import load_vision_model
from prefixserve.model.weights.dtypes import resolve_dtype, resolve_kv_cache_dtype
from prefixserve.model.weights.gguf_file import GGUFFile
from prefixserve.model.weights.loader import load_model
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams

logger = logging.getLogger("prefixserve.engine")


@dataclass
class QueueReservation:
    """Room in the waiting queue held for one API request's sequences
    (``LLMEngine.reserve_queue_room``): ``remaining`` is what its prompts have not taken."""

    remaining: int


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
    num_pinned_blocks: int = 0
    retained_hits: dict[int, int] | None = None
    evictions_by_priority: dict[int, int] | None = None
    expired_retentions: int = 0
    lora_cache: dict[str, LoRACacheCounts] = field(default_factory=dict)
    """Prefix-cache counts per loaded LoRA adapter name (the base model under ``""``)."""
    kv_tiers: tuple[TierStats, ...] = ()
    spec_draft_tokens: int = 0
    """Draft tokens computed by n-gram speculation (``--num-speculative-tokens``)."""
    spec_accepted_tokens: int = 0
    """Draft tokens the model agreed with: each one a token gained without a step of its own."""
    encoder_runs: int = 0
    """Images run through the vision encoder (a model that takes images)."""
    encoder_cache_hits: int = 0
    """Times a step found an image's embeddings in the encoder cache."""


#: The prefill that computes a prefix before it is pinned: one greedy token, with its blocks
#: kept at the top priority for a minute so that they are still cached when the pin takes them.
PIN_WARMUP_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
PIN_WARMUP_RETENTION = Retention.whole_prompt(MAX_PRIORITY, 60.0)


class LLMEngine:
    """Owns the tokenizer, the model runner, the KV cache manager, the scheduler and the output
    processor. From ``add_request`` on, a request's ``n`` ``Request``s are in the scheduler until
    each finishes (or is aborted), and its ``RequestState`` is in the output processor until its
    finished output is handed out (or it is aborted)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.device == "cpu":
            keep_freed_memory()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        path = resolve_model_path(config.model)
        gguf = GGUFFile(path) if path.endswith(".gguf") else None  # parsed once for both
        self.tokenizer: Tokenizer = load_tokenizer(config.model, gguf)
        self.model_config, model = load_model(config.model, self.dtype, config.device,
                                                config.weights, gguf, config.weight_layout)
        self.images = ImageInputs(load_vision_model(config.model, self.dtype, config.device),
                                  config.limit_mm_per_prompt, config.encoder_cache_size,
                                  config.device)
        num_blocks = self._num_blocks(config)
        self.runner = ModelRunner(self.model_config, model, num_blocks, config.block_size,
                                  self.dtype, config.device, config.deterministic,
                                  config.enforce_eager, self.kv_cache_dtype)
        namespace = self._tier_namespace(config)
        self.kv_cache_manager, capacity = make_engine_kv_cache(
            self.model_config, num_blocks, config,
            hash_root=None if namespace is None else tier_hash_root(config, namespace))
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, capacity)
        log_kv_capacity(self.model_config, num_blocks, config)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   config.prefill_threshold, config.shared_prefix_wait_tokens)
        self.reserved_sequences = 0
        """Room in the waiting queue held by ``reserve_queue_room`` and not taken yet."""
        self.tiers: KVTierManager | None = None
        self.hooks: list[StepHook] = []
        """What runs around each step's schedule, model and outputs (``step_hooks.py``)."""
        if namespace is not None:
            self.tiers = make_tier_manager(config, namespace, self.kv_cache_manager,
                                           self.runner.kv_cache, self.scheduler.add_request)
            self.hooks.append(TierHook(self.tiers))
        self.sampler = Sampler(self.model_config.eos_token_ids)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                            self.model_config.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.model_config.eos_token_ids,
                                                self.max_model_len)
        self.metrics = PrefixCachingMetrics()
        self.cache_board = CacheBoard(config.block_size, config.request_log_size,
                                      pool=self.kv_cache_manager.block_pool)
        self.last_step_scheduled = False
        self.loras: LoRARegistry | None = None
        if config.enable_lora:
            self._enable_lora()
        self.proposer: NgramProposer | None = None
        if config.num_speculative_tokens:
            self._enable_speculation()
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.hooks.append(CleanupHook(self.scheduler, self.structured))

    def warm_up(self) -> None:
        """Runs the model once on a block taken from the pool and given back
        (``ModelRunner.warm_up``), so that the first request does not pay for the first steps'
        set-up. Called by the server's engine before it serves; no request, token or cached
        block is counted."""
        pool = self.kv_cache_manager.block_pool
        needed = -(-self.runner.warm_up_positions() // self.config.block_size)
        if pool.get_num_free_blocks() < needed:
            return
        blocks = pool.get_new_blocks(needed)
        try:
            self.runner.warm_up([block.block_id for block in blocks])
        finally:
            pool.free_blocks(blocks)

    def _num_blocks(self, config: EngineConfig) -> int:
        """The KV pool's blocks: ``num_blocks``, or what ``kv_cache_memory`` holds (a
        ValueError under two)."""
        if config.num_blocks is not None:
            return config.num_blocks
        memory = parse_memory(config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
        num_blocks = ModelRunner.num_blocks_for_memory(self.model_config, self.kv_cache_dtype,
                                                       config.block_size, memory)
        if num_blocks < 2:
            raise ValueError("kv_cache_memory is too small for two KV blocks")
        return num_blocks

    def _enable_speculation(self) -> None:
        """The n-gram proposer (any model: a verification step's rows read only the blocks of
        the request's window, which the release after each step keeps; docs/kernels.md)."""
        config = self.config
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.hooks.append(SpeculationHook(self.proposer, self.scheduler, self.structured,
                                          self.max_model_len))

    def _enable_lora(self) -> None:
        """Adapter slots in the model, the registry as the scheduler's gate, and the adapters
        of ``lora_modules`` loaded (a ``LoRAError`` for one that cannot be used)."""
        config = self.config
        lora = install_lora(self.runner.model, self.model_config, config.max_loras,
                            config.max_lora_rank, row_invariant=self.runner.deterministic)
        self.runner.lora = lora
        self.loras = LoRARegistry(lora, self.model_config)
        self.scheduler.gate = self.loras
        for name, path in (config.lora_modules or {}).items():
            self.loras.add(name, path)

    def _tier_namespace(self, config: EngineConfig) -> bytes | None:
        """The cache tiers' key namespace (the model identity), or None without tiers."""
        if not config.has_tiers:
            return None
        identity = model_identity(resolve_model_path(config.model), self.dtype, config.weights,
                                  config.block_size, self.runner.kv_cache.shape,
                                  config.hash_algo, self.kv_cache_dtype)
        return namespace_of(identity)

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

    @property
    def image_token(self) -> str | None:
        """The text of the image placeholder token a chat prompt holds where an image goes
        (``place_images`` expands it); None for a model that takes no images."""
        token_id = self.images.image_token_id
        return None if token_id is None else self.tokenizer.convert_ids_to_tokens([token_id])[0]

    def place_images(self, token_ids: Sequence[int], images: Sequence[DecodedImage]
                     ) -> tuple[list[int], PlacedImages]:
        """The prompt ``token_ids`` with each image placeholder expanded to its image's tokens,
        and the images placed, for ``add_request`` (``ImageInputs.place``: a ``RequestError``
        for a text-only model, more than ``limit_mm_per_prompt`` images, or placeholders that
        do not match the images). Reads only what is fixed once the engine is built, so any
        thread may call it."""
        return self.images.place(token_ids, images)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the sequences that produced a token, since the engine started."""
        return self.output_processor.prompt_tokens

    @property
    def generation_tokens(self) -> int:
        """Tokens generated since the engine started."""
        return self.output_processor.generation_tokens

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_id: int | str | None = None,
        images: PlacedImages | None = None,
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
        retention: Retention | None = None,
        lora: str | None = None,
        reservation: QueueReservation | None = None,
    ) -> str:
        """Queues a prompt (text, or token ids used as given) and returns its request id.

        Raises ``RequestError`` for a request that could never run (empty, longer than the
        context, token ids out of the vocabulary, longer than one step without chunked prefill,
        more sequences than the queue holds, image placeholder tokens that are not ``images``'
        runs) and ``QueueFullError`` when the queue has no room for its ``n`` sequences now.
        Nothing is queued unless it can be scheduled. With a ``reservation``
        (``reserve_queue_room``) that still holds ``n`` sequences, the room is taken from it
        instead. ``images`` are the prompt's images as ``place_images`` placed them."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.output_processor.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text = None
            token_ids = list(prompt)
        self._check_prompt(token_ids)  # before the queue: a request that can never run is
        reserved = reservation is not None and reservation.remaining >= params.n
        if not reserved:  # a RequestError, never a retryable QueueFullError
            self._check_queue_room(params.n)
        self.images.check(token_ids, images)
        self.check_token_controls(params)
        grammar, params = self._compile_grammar(params)
        if lora is not None:
            lora_id = self._lora_id(lora, lora_id)
        shared = {"cache_salt": cache_salt, "lora_id": lora_id, "retention": retention,
                  "mm_inputs": images.inputs if images is not None else (),
                  "images": images.images if images is not None else ()}
        arrival = arrival_time or time.time()
        children = [self._sequence(request_id, index, token_ids, params, arrival, shared)
                    for index in range(params.n)]
        self.output_processor.add_request(request_id, text, children)
        self._queue(children, grammar, params)
        if reserved:
            assert reservation is not None
            reservation.remaining -= params.n
            self.reserved_sequences -= params.n
        return request_id

    def _sequence(self, request_id: str, index: int, token_ids: list[int],
                  params: SamplingParams, arrival: float, shared: dict[str, Any]) -> Request:
        """Sequence ``index`` of the ``params.n`` of request ``request_id``: the prompt and
        the ``shared`` fields (salt, adapter, images, retention), and its own id, token list,
        seed and generator."""
        seed = None if params.seed is None else (params.seed + index) % 2**64
        request = Request(
            request_id=f"{request_id}#{index}" if params.n > 1 else request_id,
            group_id=request_id, token_ids=list(token_ids), prompt_token_ids=token_ids,
            wants_prompt_logprobs=params.prompt_logprobs is not None, params=params,
            index=index, generator=make_generator(seed, self.config.device), **shared)
        request.metrics.arrival_time = arrival
        return request

    def reserve_queue_room(self, n: int) -> QueueReservation:
        """Holds room in the waiting queue for ``n`` sequences that several ``add_request``
        calls will queue (the prompts of one API request), so that they are queued whole or
        refused whole: raises as ``add_request`` does when the ``n`` do not fit now, and while
        held the room is not given to other requests. ``release_queue_room`` returns what the
        calls did not take."""
        self._check_queue_room(n)
        self.reserved_sequences += n
        return QueueReservation(n)

    def release_queue_room(self, reservation: QueueReservation) -> None:
        """Returns the room ``reservation`` still holds (its prompts are queued, or refused)."""
        self.reserved_sequences -= reservation.remaining
        reservation.remaining = 0

    def _queue(self, children: list[Request], grammar: str | None,
               params: SamplingParams) -> None:
        """Hands a request's sequences to the tiers (which look them up first) or the
        scheduler, with their grammar."""
        for request in children:
            if grammar is not None and params.structured_outputs is not None:
                self.structured.add(request.request_id, grammar, params.structured_outputs)
            if self.tiers is not None:
                self.tiers.admit(request)
            else:
                self.scheduler.add_request(request)

    def check_token_controls(self, params: SamplingParams) -> None:
        """Raises ``RequestError`` (naming the field) for a ``logit_bias`` or
        ``allowed_token_ids`` id outside the vocabulary."""
        vocab = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise RequestError(f"{name}: token id {bad} is outside the vocabulary "
                                   f"[0, {vocab})", code="invalid_value", param=name)

    def _compile_grammar(self, params: SamplingParams) -> tuple[str | None, SamplingParams]:
        """The compiled grammar of a constrained request (a ``RequestError`` naming
        ``structured_outputs`` if it does not compile) and its parameters without the stop
        conditions a grammar replaces (see ``SamplingParams``)."""
        spec = params.structured_outputs
        if spec is None:
            return None, params
        try:
            grammar = self.structured.compile(spec)
        except GrammarError as exc:
            raise RequestError(f"the {spec.kind} constraint does not compile: {exc}",
                               code="invalid_grammar", param="structured_outputs") from None
        return grammar, dataclasses.replace(params, stop=[], stop_token_ids=[], min_tokens=0,
                                            ignore_eos=False)
    def _lora_id(self, name: str, lora_id: int | str | None) -> str:
        """The cache key (content id) of the adapter served as ``name``; a ``RequestError``
        (code ``model_not_found``) for an unknown name."""
        if lora_id is not None:
            raise RequestError("give lora (an adapter name) or lora_id, not both",
                               code="invalid_value", param="lora")
        adapter = self.loras.get(name) if self.loras is not None else None
        if adapter is None:
            known = ", ".join(sorted(self.loras.adapters)) if self.loras else ""
            raise RequestError(f"no LoRA adapter named {name!r} is loaded"
                               + (f"; loaded: {known}" if known else ""),
                               code="model_not_found", param="model")
        return adapter.lora_id

    # ------------------------------------------------------------------ adapters
    def add_lora(self, name: str, path: str) -> LoRAInfo:
        """Loads the adapter at ``path`` (PEFT directory or GGUF LoRA file) under ``name``;
        ``LoRAError`` (a ``ValueError``) when it cannot be used, ``RuntimeError`` without
        ``enable_lora``."""
        return self._registry().add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unloads adapter ``name``: ``KeyError`` if unknown, ``LoRAInUseError`` while a request
        under it runs or waits."""
        registry = self._registry()
        in_use = {r.lora_id for r in (*self.scheduler.running, *self.scheduler.waiting)
                  if isinstance(r.lora_id, str)}
        registry.remove(name, in_use)

    def list_loras(self) -> list[LoRAInfo]:
        """The loaded adapters, in the order they were loaded."""
        return self.loras.infos() if self.loras is not None else []

    def lora_cache_counts(self) -> dict[str, LoRACacheCounts]:
        """Prefix-cache counts per loaded adapter name (see ``engine/lora_registry.py``); the
        base model's under the key ``""``."""
        if self.loras is None:
            return {}
        out: dict[str, LoRACacheCounts] = {}
        for lora_id, counts in self.loras.counts.items():
            name = "" if lora_id is None else self.loras.name_of(lora_id)
            if name is not None:
                out[name] = counts
        return out

    def _registry(self) -> LoRARegistry:
        if self.loras is None:
            raise RuntimeError("LoRA adapters need enable_lora=True (--enable-lora)")
        return self.loras

    def _check_queue_room(self, n: int) -> None:
        """The waiting queue holds at most ``max_waiting_requests`` sequences (each of the ``n``
        sequences of a request waits on its own, and reserved room counts as taken): a request
        is queued whole or refused."""
        limit = self.config.max_waiting_requests
        if limit is None:
            return
        if n > limit:
            raise RequestError(
                f"the request asks for {n} sequences, but the waiting queue holds at most "
                f"{limit} (--max-waiting-requests)")
        waiting = len(self.scheduler.waiting) + self.reserved_sequences
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

    def request_state(self, request_id: str) -> RequestState:
        """The output state of a request (its ``n`` sequences, ``output(delta=False)`` for
        everything so far), from ``add_request`` until the output that finishes it is handed
        out (a ``KeyError`` after that, or for an unknown id). It is the engine's own: read it,
        do not modify it; it stays readable after the engine forgets it."""
        return self.output_processor.requests[request_id]

    def sequences(self, request_id: str) -> list[SequenceState]:
        """The ``n`` sequences of a request (each one's output so far, and its scheduler
        ``request``), while ``request_state`` knows it."""
        return self.request_state(request_id).sequences

    def abort_request(self, request_id: str) -> bool:
        """Stops a request wherever it is and frees its blocks; returns whether it existed."""
        sequences = self.output_processor.requests.get(request_id)
        for sequence in sequences.sequences if sequences is not None else ():
            self.structured.remove(sequence.request.request_id)
            if self.proposer is not None:
                self.proposer.forget(sequence.request.request_id)
        return self.output_processor.abort_request(request_id, self._release)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or (
            self.tiers is not None and self.tiers.has_pending)

    def close(self) -> None:
        """Finishes the cache tiers' writes (and write-backs) and stops their threads. Call it
        from the engine's thread, once nothing runs any more."""
        if self.tiers is not None:
            self.tiers.close()

    def _release(self, request: Request) -> None:
        """Notes a finished or aborted sequence on the cache board, then frees it."""
        chain = self.kv_cache_manager.req_to_block_hashes.get(request.request_id)
        self.cache_board.finished(request, chain, time.time())
        self.scheduler.finish_request(request)

    def cache_view(self, top: int = 20) -> BoardView:
        """The cache board's snapshot: blocks by state, namespaces, the ``top`` hottest
        prefixes (``engine/cache_board.py``)."""
        manager = self.kv_cache_manager
        running = [(r, manager.req_to_block_hashes.get(r.request_id) or ())
                   for r in self.scheduler.running]
        return self.cache_board.view(manager.block_pool, running, manager.num_pinned_blocks, top)

    def request_log(self) -> list[dict[str, Any]]:
        """The recent sequences as mooncake trace records (``CacheBoard.request_log``)."""
        return self.cache_board.request_log()

    def reset_prefix_cache(self, keep_pins: bool = False) -> bool:
        """Empties the prefix cache, also while requests run; returns True.

        Every cached hash is dropped at once: nothing computed before the reset is found again.
        Running requests keep their blocks (which go back to the pool uncached when freed) and
        cache the blocks they fill afterwards as usual. Pins are released too, unless
        ``keep_pins`` (then their blocks stay cached and pinned)."""
        return self.kv_cache_manager.reset_prefix_cache(keep_pins=keep_pins)

    # ------------------------------------------------------------------ pins
    def pin_cached_prefix(self, pin_id: str, token_ids: Sequence[int],
                          cache_salt: str | None = None) -> int:
        """Pins the full blocks of ``token_ids``, which must be cached now (``LLM.pin_prefix``
        and ``AsyncLLM.pin_prefix`` compute them first); returns the blocks pinned. Raises
        ``PinBudgetError`` over the budget, ``RequestError`` when a block is not cached or the
        prefix fills no block."""
        probe = CacheRequest(f"pin:{pin_id}", list(token_ids), cache_salt=cache_salt)
        manager = self.kv_cache_manager
        try:
            hashes = list(manager.block_hashes(probe))
        finally:
            manager.free_block_hashes(probe)
        if not hashes:
            raise RequestError(f"the prefix has {len(token_ids)} tokens, less than one block "
                               f"of {self.block_size}: nothing to pin")
        try:
            return len(manager.pin(pin_id, hashes))
        except KeyError as exc:
            raise RequestError("the prefix was evicted before it could be pinned; "
                               "retry") from exc
        except PinBudgetError as exc:
            raise RequestError(str(exc), code="pin_budget_exceeded") from exc
        except ValueError as exc:  # the id is in use
            raise RequestError(str(exc), code="pin_id_in_use") from exc

    def check_pin(self, token_ids: Sequence[int]) -> None:
        """Raises ``RequestError`` unless ``token_ids`` is a prompt the engine takes and a
        prefix of its length fits the pin budget: what ``LLM.pin_prefix`` and
        ``AsyncLLM.pin_prefix`` check before the warm-up (``PIN_WARMUP_PARAMS``,
        ``PIN_WARMUP_RETENTION``) computes the prefix and ``pin_cached_prefix`` pins it."""
        self.validate_prompt(token_ids, 1)
        self.check_pin_budget(len(token_ids))

    def check_pin_budget(self, num_tokens: int) -> None:
        """Raises ``RequestError`` (code ``pin_budget_exceeded``) when a prefix of
        ``num_tokens`` could not be pinned even if none of its blocks were pinned yet (checked
        before computing it)."""
        manager = self.kv_cache_manager
        need = num_tokens // self.block_size
        if manager.num_pinned_blocks + need > manager.max_pinned_blocks:
            raise RequestError(
                f"the prefix fills {need} blocks and {manager.num_pinned_blocks} are pinned, but "
                f"the pin budget is {manager.max_pinned_blocks} of {manager.num_blocks} blocks "
                f"(--max-pinned-fraction, less room for one request of the whole context)",
                code="pin_budget_exceeded")

    def unpin(self, pin_id: str) -> bool:
        """Releases a pin; returns whether it existed."""
        return self.kv_cache_manager.unpin(pin_id)

    def pins(self) -> dict[str, int]:
        """Every pin's id and the blocks it holds."""
        return {pin_id: len(blocks) for pin_id, blocks in self.kv_cache_manager.pins.items()}

    # ------------------------------------------------------------------ KV events
    def enable_kv_events(self, replica_id: str, history: int = 256) -> str:
        """Publishes the prefix cache's changes (``prefixserve.core.kv_events``, docs/replicas.md)
        under ``replica_id``; returns the stream's epoch. Once on, a second call
        changes nothing and returns the same epoch."""
        current = self.kv_cache_manager.block_pool.event_sink
        if current is not None:
            return current.epoch
        publisher = KVEventPublisher(replica_id, self.config.block_size, history)
        self.kv_cache_manager.block_pool.event_sink = publisher
        return publisher.epoch

    def kv_events(self, after_seq: int) -> tuple[str, int, list[KVEventBatch] | None]:
        """``(epoch, last seq, batches after after_seq)``; None for the batches when some are
        no longer kept (take ``kv_snapshot``). Flushes what is pending first."""
        publisher = self._kv_publisher()
        publisher.flush()
        return publisher.epoch, publisher.seq, publisher.batches_after(after_seq)

    def kv_snapshot(self) -> KVSnapshot:
        """Every cached hash value, as of the last batch (flushed now)."""
        publisher = self._kv_publisher()
        publisher.flush()
        return publisher.snapshot(self.kv_cache_manager.block_pool.cached_block_hash_to_block)

    def _kv_publisher(self) -> KVEventPublisher:
        publisher = self.kv_cache_manager.block_pool.event_sink
        if publisher is None:
            raise RuntimeError("KV events are off: call enable_kv_events first")
        return publisher

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step and returns an output (new tokens and text since the last
        one) for each request that ran in it.

        ``last_step_scheduled`` says whether the step ran anything: False means no work can
        run until something changes (a request arrives or is aborted), so a loop driving the
        engine should wait for new work rather than step again at once. (With cache tiers, a
        step that only waits for loads in flight waits a little itself and reports True.)"""
        for hook in self.hooks:
            hook.before_schedule()
        scheduled = self.scheduler.schedule()
        self.metrics.observe(self.kv_cache_manager.make_prefix_cache_stats())
        if not scheduled.scheduled:
            self.last_step_scheduled = any([hook.when_idle() for hook in self.hooks])
            return []
        self.last_step_scheduled = True
        for hook in self.hooks:
            hook.before_execute()
        executed = self._execute(scheduled)
        for hook in self.hooks:
            hook.after_execute(executed.requests)
        outputs = self.output_processor.process(executed, finish=self._release)
        for hook in self.hooks:
            hook.after_step(executed.requests)
        return outputs

    def _execute(self, scheduled: SchedulerOutput) -> ExecutedStep:
        """Runs the model over the scheduled tokens, moves each request's
        ``num_computed_tokens`` past them, and samples the next token of every request whose
        tokens are all computed now; prompt logprobs come from the chunk's logits when asked."""
        embeds = self._image_embeds(scheduled)
        batch = [self._batch_input(item, rows) for item, rows in zip(scheduled.scheduled, embeds,
                                                                      strict=True)]
        result = self.runner.execute(batch)
        step = ExecutedStep([item.request for item in scheduled.scheduled])
        ready = []
        verified: list[SampledToken] = []
        for row, item in enumerate(scheduled.scheduled):
            request, prompt_logits = item.request, result.prompt_logits[row]
            request.num_computed_tokens += item.num_new_tokens
            if item.draft_token_ids:
                assert prompt_logits is not None
                verified += self._verify(request, item.draft_token_ids, prompt_logits)
                continue
            if request.wants_prompt_logprobs and prompt_logits is not None:
                known = self.output_processor.known_prompt_positions(request)
                step.prompt_logprobs.append(
                    self._prompt_logprobs(request, batch[row], prompt_logits, known))
            if request.is_prefill_done:
                ready.append(row)
        if ready:
            step.sampled = self._sample(result.logits, ready, step.requests)
        step.sampled += verified
        if step.sampled:
            step.time = time.time()
        return step

    def _verify(self, request: Request, drafts: list[int], logits: torch.Tensor
                ) -> list[SampledToken]:
        """The tokens a request gains from a step that computed its next token and its
        ``drafts`` (``verify_drafts``: row j of ``logits`` is the distribution after draft j).
        The kept drafts' K/V are in the cache already: ``num_computed_tokens`` moves past them;
        the slots of the rejected ones are written again by later steps."""
        tokens = verify_drafts(logits, drafts, request.params, request.generator)
        accepted = len(tokens) - 1
        request.num_computed_tokens += accepted
        self.spec_draft_tokens += len(drafts)
        self.spec_accepted_tokens += accepted
        return [SampledToken(request, token) for token in tokens]

    def _image_embeds(self, scheduled: SchedulerOutput
                      ) -> list[tuple[tuple[int, torch.Tensor], ...]]:
        """Each scheduled request's image rows among its new tokens (``ImageInputs``)."""
        items = scheduled.scheduled
        if not any(item.request.images for item in items):
            return [()] * len(items)
        return self.images.step_embeds([
            (item.request.mm_inputs, item.request.images, item.request.num_computed_tokens,
             item.num_new_tokens) for item in items])

    def _batch_input(self, item: ScheduledRequest,
                     embeds: tuple[tuple[int, torch.Tensor], ...] = ()) -> SeqBatchInput:
        """The model runner's input for one scheduled request: its next ``num_new_tokens``
        (``embeds``: their image rows)."""
        request = item.request
        start = request.num_computed_tokens
        return SeqBatchInput(
            token_ids=request.token_ids[start:start + item.num_new_tokens] + item.draft_token_ids,
            start_pos=start,
            block_table=request.block_ids,  # kept by the scheduler, not rebuilt per step
            need_prompt_logits=bool(item.draft_token_ids) or (
                request.wants_prompt_logprobs and start < request.num_prompt_tokens),
            verify=bool(item.draft_token_ids),
            seq_id=request.request_id,
            extra_block_tables=request.extra_block_ids,
            lora_slot=self.loras.slot(request.lora_id) if self.loras is not None else None,
            embeds=embeds,
        )

    def _sample(self, logits: torch.Tensor, rows: list[int],
                requests: list[Request]) -> list[SampledToken]:
        """One token for each of ``rows``; row i of ``logits`` belongs to ``requests[i]``."""
        chosen = [requests[row] for row in rows]
        if len(rows) != len(requests):
            logits = logits[torch.tensor(rows)]
        masks = self.structured.masks(
            [(r.request_id, r.output_token_ids, r.num_preemptions) for r in chosen]
        ) if len(self.structured) else None
        sampled = self.sampler.sample(
            logits,
            [r.params for r in chosen],
            [r.generator for r in chosen],
            [r.prompt_token_ids for r in chosen],
            [r.output_token_ids for r in chosen],
            token_masks=masks,
        )
        return [SampledToken(request, token, None if logprobs is None else logprobs.as_dict())
                for request, token, logprobs in zip(chosen, sampled.token_ids, sampled.logprobs,
                                                    strict=True)]

    @staticmethod
    def _prompt_logprobs(request: Request, seq: SeqBatchInput, logits: torch.Tensor,
                         known: int) -> PromptLogprobsChunk:
        """The logprobs of the prompt tokens this chunk predicts that are not ``known`` yet
        (positions below ``known`` were given by an earlier chunk: a chunk recomputed after
        preemption adds nothing twice, and computes nothing twice). Row j of ``logits``
        predicts the token at position ``seq.start_pos + j + 1``; a row past the prompt (the
        chunk's last, when it ends the prompt) predicts an output token and is left out."""
        start = seq.start_pos
        first = max(known, start + 1)
        last = min(start + len(seq.token_ids), request.num_prompt_tokens - 1)
        if first > last:
            return PromptLogprobsChunk(request, first, [])
        entries = compute_prompt_logprobs(logits[first - start - 1 : last - start],
                                          request.token_ids[first - 1 : last + 1],
                                          request.params.prompt_logprobs or 0)
        return PromptLogprobsChunk(request, first, entries[1:])

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
            num_pinned_blocks=manager.num_pinned_blocks,
            retained_hits=dict(self.metrics.retained_hits),
            evictions_by_priority=dict(manager.block_pool.evictions_by_priority),
            expired_retentions=manager.block_pool.expired_retentions,
            lora_cache={name: replace(counts)
                        for name, counts in self.lora_cache_counts().items()},
            kv_tiers=self.tiers.stats() if self.tiers is not None else (),
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            encoder_runs=self.images.encoder_runs,
            encoder_cache_hits=self.images.encoder_cache_hits,
        )
