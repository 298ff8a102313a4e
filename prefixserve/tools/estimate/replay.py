"""``prefixserve estimate``: what prefix caching would buy on a workload, without a model.

A prompt log or a block-hash trace (see ``trace_formats``) is replayed, in file order, through
``prefixserve.core.KVCacheManager`` — the code the engine runs — once for each pool size asked
for, and once through an infinite cache (a set of every full block seen so far: the upper bound,
nothing is ever evicted). Each request is looked up (``get_computed_blocks``), allocated
(``allocate_slots``) and, once it leaves, freed tail first (``free``, ``free_block_hashes``).

Load model: at most ``concurrency`` requests are resident; a request is prefilled when it
arrives, its known output is decoded when it leaves (the blocks it fills are cached then), and
requests leave in arrival order, when a newer one needs the room or the slot. With one resident
request (the default) each request is allocated, decoded and freed before the next arrives.
A request needing more blocks than the pool holds could never run; it is counted as
``too large`` with no hit and leaves the cache untouched.

Figures are taken over the requests after the first ``warmup_fraction`` of them: hit rate by
blocks (blocks hit / full prompt blocks looked up) and by tokens (tokens from the cache / prompt
tokens), prefill tokens saved, the 1/(1-h) bound on prefill speed-up, the share of requests with
any hit. A rolling hit rate over the last ``window`` requests (``PrefixCachingMetrics``, the
engine's own) is sampled along the whole replay.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import re
import resource
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prefixserve.core import (
    CacheRequest,
    KVCacheManager,
    PinBudgetError,
    PrefixCacheStats,
    PrefixCachingMetrics,
    Retention,
)
from prefixserve.tools.estimate import hybrid as estimate_hybrid
from prefixserve.tools.estimate.results import CacheResult, Estimate, ReplaySettings
from prefixserve.tools.trace_formats import (
    ReadOptions,
    TraceRequest,
    Workload,
    read_workload,
)

ROLLING_SAMPLES = 400
"""Points of the rolling hit-rate curve (at most)."""

DEFAULT_FRACTIONS = (0.01, 0.05, 0.2, 0.5)
"""Pool sizes tried when none is given, as fractions of the distinct full blocks."""

SMALL_REPLAY_BLOCKS = 200_000
"""Below this many block lookups a replay takes well under a second: no worker processes."""

PROGRESS_EVERY = 256
"""Requests between two progress reports of a replay."""

ProgressTick = Callable[[int], None]


class _Tally:
    """Adds up per-request stats into a ``CacheResult`` and samples the rolling hit rate."""

    def __init__(self, result: CacheResult, num_requests: int, settings: ReplaySettings) -> None:
        self.result = result
        self.metrics = PrefixCachingMetrics(settings.window)
        self.warmup = settings.warmup_requests
        self.stride = max(1, num_requests // ROLLING_SAMPLES)
        self.last = num_requests - 1

    def observe(self, index: int, stats: PrefixCacheStats) -> None:
        self.metrics.observe(stats)
        result = self.result
        result.replayed_blocks += stats.queries
        if index >= self.warmup:
            result.requests += 1
            result.requests_with_hit += stats.hits > 0
            result.query_blocks += stats.queries
            result.hit_blocks += stats.hits
            result.query_tokens += stats.query_tokens
            result.hit_tokens += stats.hit_tokens
        if (index + 1) % self.stride == 0 or index == self.last:
            result.rolling.append((index + 1, self.metrics.hit_rate))


class _PoolReplay:
    """Replays a workload through a ``KVCacheManager`` of ``capacity`` blocks."""

    def __init__(self, workload: Workload, capacity: int, settings: ReplaySettings) -> None:
        self.workload = workload
        self.block_size = workload.block_size
        self.capacity = capacity
        self.concurrency = settings.concurrency
        self.settings = settings
        self.now = 0.0
        self.manager: KVCacheManager
        if settings.group_windows is not None:
            self.manager = estimate_hybrid.hybrid_manager(capacity, workload.block_size,
                                                          settings, clock=lambda: self.now)
        else:
            self.manager = KVCacheManager(capacity, workload.block_size, clock=lambda: self.now,
                                          max_pinned_fraction=settings.max_pinned_fraction)
        self.resident: deque[tuple[CacheRequest, TraceRequest, list[Any]]] = deque()
        self.result = CacheResult(capacity)
        self.tally = _Tally(self.result, len(workload.requests), settings)
        self.default_retention = (None if settings.ttl is None else
                                  Retention.whole_prompt(settings.ttl_priority, settings.ttl))
        self.pin_targets = most_reused_blocks(workload, settings.pin_top)
        self.pinned: set[Any] = set()
        self.pins_full = False
        self.tier = None if settings.tier_capacity is None else _TierModel(settings.tier_capacity)

    def run(self, tick: ProgressTick | None) -> CacheResult:
        start = time.perf_counter()
        for index, request in enumerate(self.workload.requests):
            self._arrive(index, request)
            if tick is not None and (index + 1) % PROGRESS_EVERY == 0:
                tick(PROGRESS_EVERY)
        while self.resident:
            self._leave()
        if tick is not None:
            tick(len(self.workload.requests) % PROGRESS_EVERY)
        self.result.seconds = time.perf_counter() - start
        return self.result

    def _arrive(self, index: int, trace_request: TraceRequest) -> int:
        """Replays the arrival of request ``index``; the prompt tokens it found cached (0 for
        one too large to hold)."""
        if self.settings.group_windows is not None:
            return estimate_hybrid.hybrid_arrive(self, index, trace_request, self.settings)
        bs = self.block_size
        keys = self.workload.block_keys(trace_request)
        prompt = trace_request.num_prompt_tokens
        total = prompt + trace_request.num_decoded_tokens
        num_prompt_blocks = min(len(keys), prompt // bs)
        if -(-total // bs) > self.capacity - self.manager.num_pinned_blocks:
            self.result.requests_too_large += index >= self.tally.warmup
            self.tally.observe(index, PrefixCacheStats(requests=1, queries=num_prompt_blocks,
                                                       query_tokens=prompt))
            return 0
        while len(self.resident) >= self.concurrency:
            self._leave()
        prompt_keys = keys if num_prompt_blocks == len(keys) else keys[:num_prompt_blocks]
        self.now = float(index) if trace_request.time is None else trace_request.time
        request = CacheRequest(str(index), range(prompt), block_hashes=prompt_keys,
                               retention=trace_request.retention or self.default_retention)
        manager = self.manager
        hits, num_cached = manager.get_computed_blocks(request)
        self.tally.observe(index, manager.make_prefix_cache_stats())
        if self.tier is not None:
            limit = min(num_prompt_blocks, (prompt - 1) // bs)
            found = self.tier.extend(prompt_keys, len(hits), limit)
            if index >= self.tally.warmup:
                self.result.tier_hit_blocks += found
                self.result.tier_hit_tokens += found * bs
            self.tier.store(prompt_keys)
        # The whole request (prompt and output) is allocated now; only the prompt's full blocks
        # are cached now (``request.token_ids`` covers the prompt only), the output's on leaving.
        while manager.allocate_slots(request, total - num_cached, hits) is None:
            if not self.resident:
                raise RuntimeError(f"request {index} fits the pool but could not be allocated")
            self._leave()
        if self.pin_targets and not self.pins_full:
            self._pin(index, prompt_keys)
        self.resident.append((request, trace_request, keys))
        return num_cached

    def _pin(self, index: int, keys: Sequence[Any]) -> None:
        """Pins the request's prefix up to its last target block (a target stands for the
        prefix up to it), if it adds any."""
        n = max((i + 1 for i, key in enumerate(keys) if key in self.pin_targets), default=0)
        if n == 0 or keys[n - 1] in self.pinned:
            return
        try:
            self.manager.pin(f"p{index}", keys[:n])
        except PinBudgetError:
            self.pins_full = True
            return
        except KeyError:  # a block of the chain is not cached (held twice, evicted): skip
            return
        self.pinned.update(keys[:n])

    def finish(self, index: int) -> None:
        """Request ``index`` leaves now (its output's blocks cached, its blocks freed), the
        others stay; nothing happens if it is not resident (it was too large)."""
        at = next((i for i, entry in enumerate(self.resident)
                   if entry[0].request_id == str(index)), None)
        if at is not None:
            self._leave(at)

    def _leave(self, at: int = 0) -> None:
        """The resident request at position ``at`` (the oldest by default) leaves."""
        request, trace_request, keys = self.resident[at]
        del self.resident[at]
        manager = self.manager
        decoded = trace_request.num_decoded_tokens
        if decoded:
            total = trace_request.num_prompt_tokens + decoded
            request.token_ids = range(total)
            request.block_hashes = keys
            request.num_computed_tokens = total - 1
            if manager.allocate_slots(request, 1) != []:
                raise RuntimeError("decoding a request needed blocks it had not reserved")
            if self.tier is not None:
                self.tier.store(keys)
        manager.free(request)
        manager.free_block_hashes(request)


def most_reused_blocks(workload: Workload, k: int) -> set[Any]:
    """The ``k`` prompt blocks found in the most requests (each standing for the prefix up to
    it; ties go to the longer prefix), leaving out blocks used once. An oracle: it reads the
    whole workload first, as an operator who knows the traffic would choose pins."""
    if k <= 0:
        return set()
    counts: dict[Any, int] = {}
    depth: dict[Any, int] = {}
    bs = workload.block_size
    for request in workload.requests:
        keys = workload.block_keys(request)
        for i, key in enumerate(keys[:request.num_prompt_tokens // bs]):
            counts[key] = counts.get(key, 0) + 1
            depth[key] = i
    ranked = sorted((key for key, c in counts.items() if c > 1),
                    key=lambda key: (-counts[key], -depth[key]))
    return set(ranked[:k])
class _TierModel:
    """A second cache tier of ``capacity`` blocks below a pool: an LRU set of block keys,
    written through (every full block enters it when computed), read past the pool's hit
    until its first miss, as the engine's tiers are (docs/tiers.md). Blocks it
    gives are then computed into the pool like any others (the engine loads them there)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"--tier-capacity must be at least 1 block, got {capacity}")
        self.capacity = capacity
        self.keys: OrderedDict[Any, None] = OrderedDict()

    def extend(self, keys: Sequence[Any], start: int, limit: int) -> int:
        """How many blocks from ``start`` (the pool's hit) up to ``limit`` the tier holds."""
        found = 0
        held = self.keys
        while start + found < limit and keys[start + found] in held:
            held.move_to_end(keys[start + found])
            found += 1
        return found

    def store(self, keys: Sequence[Any]) -> None:
        held = self.keys
        for key in keys:
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
                if len(held) > self.capacity:
                    held.popitem(last=False)


def replay_pool(workload: Workload, capacity: int, settings: ReplaySettings,
                tick: ProgressTick | None = None) -> CacheResult:
    """The figures of a pool of ``capacity`` blocks, replayed through the engine's manager."""
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1 block, got {capacity}")
    return _PoolReplay(workload, capacity, settings).run(tick)


def replay_infinite(workload: Workload, settings: ReplaySettings,
                    tick: ProgressTick | None = None,
                    on_request: Callable[[int, PrefixCacheStats], None] | None = None,
                    ) -> CacheResult:
    """The figures of an infinite cache: every full block computed so far stays cached.

    Same rules as the manager: the lookup walks from block 0 and stops at the first miss, the
    last block of a prompt that fills it exactly is never looked up (one token must be computed
    for the logits), and a request's output blocks are cached when it leaves (same load model
    as the pools). ``on_request`` hears each request's stats (index, stats)."""
    start = time.perf_counter()
    result = CacheResult(None)
    tally = _Tally(result, len(workload.requests), settings)
    bs = workload.block_size
    seen: set[Any] = set()
    leaving: deque[list[Any]] = deque()
    for index, request in enumerate(workload.requests):
        while len(leaving) >= settings.concurrency:
            seen.update(leaving.popleft())
        keys = workload.block_keys(request)
        prompt = request.num_prompt_tokens
        num_prompt_blocks = min(len(keys), prompt // bs)
        limit = min(num_prompt_blocks, (prompt - 1) // bs)
        hits = 0
        while hits < limit and keys[hits] in seen:
            hits += 1
        if num_prompt_blocks == len(keys):
            seen.update(keys)
            leaving.append([])
        else:
            seen.update(keys[:num_prompt_blocks])
            leaving.append(keys[num_prompt_blocks:])
        stats = PrefixCacheStats(requests=1, queries=num_prompt_blocks, hits=hits,
                                 query_tokens=prompt, hit_tokens=hits * bs)
        tally.observe(index, stats)
        if on_request is not None:
            on_request(index, stats)
        if tick is not None and (index + 1) % PROGRESS_EVERY == 0:
            tick(PROGRESS_EVERY)
    while leaving:
        seen.update(leaving.popleft())
    if tick is not None:
        tick(len(workload.requests) % PROGRESS_EVERY)
    result.distinct_blocks = len(seen)
    result.seconds = time.perf_counter() - start
    return result


def replay(workload: Workload, capacity: int | None, settings: ReplaySettings,
           tick: ProgressTick | None = None) -> CacheResult:
    """``replay_pool``, or ``replay_infinite`` when ``capacity`` is None."""
    if capacity is None:
        return replay_infinite(workload, settings, tick)
    return replay_pool(workload, capacity, settings, tick)


# ----------------------------------------------------------------------------- parallel runs

_FORKED: tuple[Workload, ReplaySettings, Any] | None = None
"""What forked workers replay: set before the pool forks, so the parsed workload is shared."""


def _forked_replay(capacity: int | None) -> CacheResult:
    assert _FORKED is not None
    workload, settings, counter = _FORKED

    def tick(count: int) -> None:
        with counter.get_lock():
            counter.value += count

    return replay(workload, capacity, settings, tick)


@dataclass
class ReplayRun:
    """Results in the order asked for, the wall time and the peak memory (MiB) of this process
    and of the largest worker process (0 without workers)."""

    results: list[CacheResult]
    seconds: float
    peak_rss_mib: float
    worker_peak_rss_mib: float
    jobs: int


def _peak_rss_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024


def replay_all(workload: Workload, capacities: Sequence[int | None], settings: ReplaySettings,
               jobs: int = 1, progress: Callable[[int], None] | None = None) -> ReplayRun:
    """Replays every capacity (None: infinite), in ``jobs`` forked processes when ``jobs > 1``.

    ``progress`` is called now and then with the number of request replays done in all."""
    start = time.perf_counter()
    jobs = max(1, min(jobs, len(capacities)))
    if jobs == 1 or "fork" not in multiprocessing.get_all_start_methods():
        done = 0

        def tick(count: int) -> None:
            nonlocal done
            done += count
            if progress is not None:
                progress(done)

        results = [replay(workload, c, settings, tick) for c in capacities]
        return ReplayRun(results, time.perf_counter() - start, _peak_rss_mib(resource.RUSAGE_SELF),
                         0.0, 1)
    results = _replay_forked(workload, capacities, settings, jobs, progress)
    return ReplayRun(results, time.perf_counter() - start, _peak_rss_mib(resource.RUSAGE_SELF),
                     _peak_rss_mib(resource.RUSAGE_CHILDREN), jobs)


def _size_key(capacity_blocks: int | None) -> float:
    """Sort key of a pool size: ascending, the infinite cache (None) last."""
    return math.inf if capacity_blocks is None else capacity_blocks


def _replay_forked(workload: Workload, capacities: Sequence[int | None],
                   settings: ReplaySettings, jobs: int,
                   progress: Callable[[int], None] | None) -> list[CacheResult]:
    global _FORKED
    context = multiprocessing.get_context("fork")
    counter = context.Value("q", 0)
    _FORKED = (workload, settings, counter)
    # Smallest pools first: they evict the most and take the longest.
    order = sorted(range(len(capacities)), key=lambda i: _size_key(capacities[i]))
    try:
        with context.Pool(jobs) as pool:
            pending = pool.map_async(_forked_replay, [capacities[i] for i in order], chunksize=1)
            while not pending.ready():
                pending.wait(0.1)
                if progress is not None:
                    progress(counter.value)
            ordered = pending.get()
            pool.close()
            pool.join()
    finally:
        _FORKED = None
    by_position = dict(zip(order, ordered, strict=True))
    return [by_position[i] for i in range(len(capacities))]


# ----------------------------------------------------------------------------- sizes


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_sizes(text: str) -> list[int]:
    """Bytes of each comma-separated size: ``4GiB``, ``512MiB``, ``2GB``, ``1.5TiB``, ``1024``."""
    sizes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", item)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(f"not a memory size: {item.strip()!r} (try 4GiB, 512MiB or 2GB)")
        sizes.append(int(float(match.group(1)) * _SIZE_UNITS[unit]))
    return sizes


def parse_capacities(text: str) -> list[int]:
    """Block counts from ``1000,10000,50000`` (each at least 1)."""
    capacities = []
    for item in text.split(","):
        try:
            value = int(item.strip().replace("_", ""))
        except ValueError:
            raise ValueError(f"not a number of blocks: {item.strip()!r}") from None
        if value < 1:
            raise ValueError(f"a capacity must be at least 1 block, got {value}")
        capacities.append(value)
    return capacities


_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
                "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class _ItemSize:
    itemsize: int


def model_kv_bytes_per_token(model: str | None, dtype: str) -> int:
    """KV bytes per token of ``model`` (a GGUF file or HF directory, None: the default model)
    with KV cache in ``dtype``, from ``prefixserve.model.arch.config`` (no weights are loaded)."""
    from prefixserve.model.arch.config import kv_cache_bytes_per_token

    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}; choose one of {', '.join(_DTYPE_BYTES)}")
    config = estimate_hybrid.model_config(model)
    return kv_cache_bytes_per_token(config, _ItemSize(_DTYPE_BYTES[dtype]))


def default_capacities(distinct_blocks: int) -> list[int]:
    """Pool sizes tried when none is given: ``DEFAULT_FRACTIONS`` of the distinct blocks,
    rounded to two significant digits."""
    out: list[int] = []
    for fraction in DEFAULT_FRACTIONS:
        value = max(1, round(distinct_blocks * fraction))
        digits = max(0, len(str(value)) - 2)
        value = max(1, round(value, -digits))
        if value not in out:
            out.append(value)
    return out


# ----------------------------------------------------------------------------- the command


class _Progress:
    """A rich progress bar on stderr for phases that last: shown only on a terminal, and only
    once a phase has run for ``delay`` seconds."""

    def __init__(self, enabled: bool, delay: float = 1.0) -> None:
        self.enabled = enabled
        self.delay = delay

    @contextmanager
    def phase(self, description: str, total: float) -> Iterator[Callable[[float], None]]:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        start = time.perf_counter()
        bar: Progress | None = None
        task = None

        def update(completed: float) -> None:
            nonlocal bar, task
            if bar is None:
                if not self.enabled or time.perf_counter() - start < self.delay:
                    return
                bar = Progress(TextColumn("{task.description}"), BarColumn(),
                               TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                               console=Console(stderr=True), transient=True)
                bar.start()
                task = bar.add_task(description, total=total)
            assert task is not None  # added with the bar
            bar.update(task, completed=completed)

        try:
            yield update
        finally:
            if bar is not None:
                bar.stop()


def _kv_bytes_per_token(args: argparse.Namespace) -> int | None:
    """KV bytes per token of a pool block: all layers, or, for a model with sliding windows,
    the layers of one KV cache group (a pool block holds one group's layers)."""
    if args.kv_bytes_per_token is not None:
        return args.kv_bytes_per_token
    if args.kv_model is not None:
        model = None if args.kv_model == "default" else args.kv_model
        per_token = model_kv_bytes_per_token(model, args.kv_dtype)
        layers, group_size, _ = estimate_hybrid.model_kv_groups(model)
        return per_token * group_size // layers
    return None


def _requested_capacities(args: argparse.Namespace, kv_bytes: int | None) -> list[int]:
    capacities: list[int] = []
    if args.capacity:
        capacities += parse_capacities(args.capacity)
    if args.kv_memory:
        if kv_bytes is None:
            raise ValueError("--kv-memory needs --kv-bytes-per-token or --kv-model to convert "
                             "bytes into blocks")
        block_bytes = kv_bytes * args.block_size
        for size in parse_sizes(args.kv_memory):
            blocks = size // block_bytes
            if blocks < 1:
                raise ValueError(f"{size} bytes hold no block of {block_bytes} bytes")
            capacities.append(blocks)
    return sorted(set(capacities))


def estimate(args: argparse.Namespace) -> Estimate:
    """Reads the input, replays it and returns the figures (raises TraceError, ValueError)."""
    if not 0.0 <= args.warmup_fraction < 1.0:
        raise ValueError(f"--warmup-fraction must be in [0, 1), got {args.warmup_fraction}")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.block_size < 1:
        raise ValueError(f"--block-size must be at least 1, got {args.block_size}")
    if args.window is not None and args.window < 1:
        raise ValueError(f"--window must be at least 1, got {args.window}")
    if args.pin_top < 0 or (args.ttl is not None and not args.ttl > 0):
        raise ValueError("--pin-top must be at least 0 and --ttl positive")
    if args.kv_bytes_per_token is not None and args.kv_bytes_per_token < 1:
        raise ValueError(f"--kv-bytes-per-token must be positive, got {args.kv_bytes_per_token}")
    kv_bytes = _kv_bytes_per_token(args)
    capacities = _requested_capacities(args, kv_bytes)
    progress = _Progress(enabled=not args.no_progress and sys.stderr.isatty())
    options = ReadOptions(format=args.format, block_size=args.block_size,
                          trace_block_size=args.trace_block_size, chain=args.chain,
                          tokenizer=args.tokenizer, skip_bad_lines=args.skip_bad_lines)
    start = time.perf_counter()
    with progress.phase("reading", 1.0) as update:
        workload = read_workload(args.input, options, update)
    read_seconds = time.perf_counter() - start
    num_requests = len(workload.requests)
    window = args.window or min(1000, max(1, num_requests // 20))
    group_windows = None
    if args.kv_model is not None:
        _, _, group_windows = estimate_hybrid.model_kv_groups(
            None if args.kv_model == "default" else args.kv_model)
    settings = ReplaySettings(concurrency=args.concurrency,
                              warmup_requests=math.floor(num_requests * args.warmup_fraction),
                              window=window, group_windows=group_windows,
                              pin_top=args.pin_top, ttl=args.ttl,
                              ttl_priority=args.ttl_priority, tier_capacity=args.tier_capacity)
    jobs = args.jobs or os.cpu_count() or 1
    if args.jobs is None and workload.num_prompt_blocks < SMALL_REPLAY_BLOCKS:
        jobs = 1
    tasks: list[int | None] = [*capacities, None]
    first: list[CacheResult] = []
    first_seconds = 0.0
    if not capacities:
        with progress.phase("infinite cache", num_requests) as update:
            first_run = replay_all(workload, [None], settings, 1, update)
        first, first_seconds = first_run.results, first_run.seconds
        tasks = [*default_capacities(first[0].distinct_blocks or 1)]
    with progress.phase(f"replaying {len(tasks)} caches", num_requests * len(tasks)) as update:
        run = replay_all(workload, tasks, settings, jobs, update)
    results = sorted(run.results + first, key=lambda r: _size_key(r.capacity_blocks))
    return Estimate(workload, settings, args.warmup_fraction, results, read_seconds,
                    first_seconds + run.seconds, run.jobs, run.peak_rss_mib,
                    run.worker_peak_rss_mib, kv_bytes)
