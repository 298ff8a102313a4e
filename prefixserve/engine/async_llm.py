"""``AsyncLLM``: the engine loop in a background thread, driven from asyncio.

All engine state is touched by the engine thread only. Callers hand it commands through a
queue (add, abort, reset, stats) and receive each request's outputs on an ``asyncio.Queue`` of
their own event loop. A caller that stops iterating (a client that disconnects) aborts its
request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from prefixserve.core import Retention
from prefixserve.core.kv_events import KVEventBatch, KVSnapshot
from prefixserve.engine.cache_board import BoardView
from prefixserve.engine.config import EngineConfig
from prefixserve.engine.errors import EngineDeadError
from prefixserve.engine.llm_engine import (
    PIN_WARMUP_PARAMS,
    PIN_WARMUP_RETENTION,
    EngineStats,
    LLMEngine,
    QueueReservation,
)
from prefixserve.engine.lora_registry import LoRAInfo
from prefixserve.engine.multimodal import PlacedImages
from prefixserve.engine.stat_logger import StatLogger
from prefixserve.engine.step_hooks import StepHook
from prefixserve.model.text.tokenizer import Tokenizer
from prefixserve.model.vision.image import DecodedImage
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams

logger = logging.getLogger("prefixserve.engine")

T = TypeVar("T")

_IDLE_WAIT_S = 1.0
"""A pin's prefill keeps its blocks at the top priority until the pin takes them."""
"""Longest sleep of the engine thread while no work can run (it wakes at once on a command)."""


class _PublishStats(StepHook):
    """Publishes the engine's stats once a step's requests are scheduled, before the model
    runs them: a step can take seconds (a long prefill), and the gauges read from the stats
    (running, waiting, KV usage) show the work it computes while it computes, not the state
    before it was admitted."""

    def __init__(self, owner: AsyncLLM) -> None:
        self.owner = owner

    def before_execute(self) -> None:
        self.owner._stats = self.owner.engine.get_stats()


class AsyncLLM:
    """Submits requests to an ``LLMEngine`` running in its own thread and streams outputs."""

    def __init__(self, config: EngineConfig | None = None,
                 log_stats_interval: float | None = 10.0) -> None:
        self.engine: LLMEngine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._stopping = False
        self._stat_logger = StatLogger(log_stats_interval) if log_stats_interval else None
        self._build_error: BaseException | None = None
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config, built),
                                        name="prefixserve-engine", daemon=True)
        self._thread.start()
        built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        self._stats = self.engine.get_stats()
        self._loras: tuple[LoRAInfo, ...] = tuple(self.engine.list_loras())

    def _run(self, config: EngineConfig | None, built: threading.Event) -> None:
        """The engine thread: builds the engine, then runs the loop. The model is loaded here,
        not in the caller's thread, so that all its OpenMP work starts from this one thread:
        libgomp keeps a thread pool per thread that starts parallel regions, and with two pools
        (a model loaded in one thread and run in another) there are more OpenMP threads than
        cores, so libgomp's workers spin only briefly before they sleep and every parallel
        region pays a wakeup. Measured on 2 cores: a fused decode step took 8.5-8.7 ms from the
        loading thread and 23-31 ms from another one (``benchmarks/bench_quant.py --parts 5``)."""
        try:
            self.engine = LLMEngine(config)
            self.engine.warm_up()  # the first request's steps are then a request's
            self.engine.hooks.append(_PublishStats(self))
        except BaseException as exc:  # handed to the constructor, which raises it
            self._build_error = exc
            return
        finally:
            built.set()
        self._loop()

    # ------------------------------------------------------------------ what the engine is
    # Fixed once the engine is built, so these read it from any thread.
    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size: token ids are in ``[0, vocab_size)``."""
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        """The context length in tokens, prompt and output together."""
        return self.engine.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        """The number of blocks in the KV cache."""
        return self.engine.num_kv_blocks

    @property
    def block_size(self) -> int:
        """Tokens per KV cache block."""
        return self.engine.block_size

    @property
    def max_waiting_requests(self) -> int | None:
        """The most sequences the waiting queue holds (None: unbounded)."""
        return self.engine.max_waiting_requests

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in."""
        return self.engine.dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache holds."""
        return self.engine.kv_cache_dtype

    @property
    def image_token(self) -> str | None:
        """The image placeholder token's text; None for a model that takes no images."""
        return self.engine.image_token

    @property
    def max_images_per_prompt(self) -> int:
        """The most images one prompt may hold (``limit_mm_per_prompt``)."""
        return self.engine.config.limit_mm_per_prompt

    def validate_prompt(self, token_ids: Sequence[int], max_tokens: int | None) -> None:
        """Raises ``RequestError`` unless the prompt could run (see
        ``LLMEngine.validate_prompt``); safe from any thread."""
        self.engine.validate_prompt(token_ids, max_tokens)

    def place_images(self, token_ids: Sequence[int], images: Sequence[DecodedImage]
                     ) -> tuple[list[int], PlacedImages]:
        """``LLMEngine.place_images``; safe from any thread."""
        return self.engine.place_images(token_ids, images)

    # ------------------------------------------------------------------ public API
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        retention: Retention | None = None,
        lora: str | None = None,
        reservation: QueueReservation | None = None,
        images: PlacedImages | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the request's outputs (deltas) until it finishes. Raises the engine's
        ``RequestError``/``QueueFullError`` before the first output if it cannot be queued
        (room held by ``reservation`` is taken first: :meth:`reserve_queue_room`). Leaving
        the iteration early aborts the request, also when it is cancelled while the engine
        thread has not queued the request yet."""
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue[Any] = asyncio.Queue()
        arrival = time.time()

        def add() -> None:
            self.engine.add_request(prompt, params, request_id, cache_salt=cache_salt,
                                    add_special_tokens=add_special_tokens, arrival_time=arrival,
                                    retention=retention, lora=lora, reservation=reservation,
                                    images=images)
            self._streams[request_id] = (loop, stream)

        try:
            await self._call(add)
        except asyncio.CancelledError:  # the add may still run: abort after it (commands run
            self.abort(request_id)      # in order), or the request would run with no reader
            raise
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def reserve_queue_room(self, n: int) -> QueueReservation:
        """``LLMEngine.reserve_queue_room`` in the engine thread: room in the waiting queue for
        the ``n`` sequences of several prompts, or the ``QueueFullError`` that refuses them
        all. Pass it to their :meth:`generate` calls, then :meth:`release_queue_room`."""
        call = asyncio.ensure_future(self._call(lambda: self.engine.reserve_queue_room(n)))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:  # the room is held all the same: give it back
            call.add_done_callback(self._release_reserved)
            raise

    def _release_reserved(self, call: asyncio.Future[QueueReservation]) -> None:
        if not call.cancelled() and call.exception() is None:
            self.release_queue_room(call.result())

    def release_queue_room(self, reservation: QueueReservation) -> None:
        """Returns the room ``reservation`` holds that no prompt took (after the commands
        queued before this one: the prompts' own). A no-op once the engine has stopped."""
        with contextlib.suppress(EngineDeadError):  # no queue left to return room to
            self._submit(lambda: self.engine.release_queue_room(reservation))

    def abort(self, request_id: str) -> None:
        """Aborts a request (no-op if it already finished); its blocks are freed."""
        def run() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)
        self._submit(run)

    def abort_all(self, message: str) -> None:
        """Aborts every running request (freeing its blocks); each caller's iteration raises
        ``EngineDeadError(message)``. A no-op once the engine thread has stopped (its callers
        got that error already)."""
        def run() -> None:
            for request_id in list(self._streams):
                self.engine.abort_request(request_id)
                self._deliver(request_id, EngineDeadError(message))
        if self._thread.is_alive():
            self._submit(run)

    async def reset_prefix_cache(self, keep_pins: bool = False) -> bool:
        return await self._call(lambda: self.engine.reset_prefix_cache(keep_pins=keep_pins))

    async def pin_prefix(self, pin_id: str, token_ids: Sequence[int],
                         cache_salt: str | None = None) -> int:
        """Computes the prefix (one prefill, kept at the top priority for a minute so it is
        still cached when it finishes) and pins its full blocks; returns their number. Raises
        ``RequestError`` over the pin budget (checked before computing) or for a bad prompt."""
        ids = list(token_ids)
        await self._call(lambda: self.engine.check_pin(ids))
        async for _ in self.generate(ids, PIN_WARMUP_PARAMS,
                                     f"pin-{pin_id}-{uuid.uuid4().hex[:8]}",
                                     cache_salt=cache_salt, retention=PIN_WARMUP_RETENTION):
            pass
        return await self._call(lambda: self.engine.pin_cached_prefix(pin_id, ids, cache_salt))

    async def unpin(self, pin_id: str) -> bool:
        return await self._call(lambda: self.engine.unpin(pin_id))

    async def pins(self) -> dict[str, int]:
        """Every pin's id and the blocks it holds."""
        return await self._call(self.engine.pins)

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine has LoRA adapter slots (``enable_lora``)."""
        return self.engine.config.enable_lora

    @property
    def lora_adapters(self) -> tuple[LoRAInfo, ...]:
        """The loaded adapters, as of the latest load or unload (any thread may read it)."""
        return self._loras

    async def add_lora(self, name: str, path: str) -> LoRAInfo:
        """Loads an adapter in the engine thread (see ``LLMEngine.add_lora``)."""
        def add() -> LoRAInfo:
            info = self.engine.add_lora(name, path)
            self._loras = tuple(self.engine.list_loras())
            return info
        return await self._call(add)

    async def remove_lora(self, name: str) -> None:
        """Unloads an adapter in the engine thread (see ``LLMEngine.remove_lora``)."""
        def remove() -> None:
            self.engine.remove_lora(name)
            self._loras = tuple(self.engine.list_loras())
        await self._call(remove)

    async def enable_kv_events(self, replica_id: str, history: int = 256) -> str:
        """``LLMEngine.enable_kv_events``, run in the engine thread; returns the epoch."""
        return await self._call(lambda: self.engine.enable_kv_events(replica_id, history))

    async def kv_events(self, after_seq: int) -> tuple[str, int, list[KVEventBatch] | None]:
        """``LLMEngine.kv_events``, run in the engine thread."""
        return await self._call(lambda: self.engine.kv_events(after_seq))

    async def kv_snapshot(self) -> KVSnapshot:
        """``LLMEngine.kv_snapshot``, run in the engine thread."""
        return await self._call(self.engine.kv_snapshot)

    async def cache_view(self, top: int = 20) -> BoardView:
        """``LLMEngine.cache_view``, run in the engine thread (between steps)."""
        return await self._call(lambda: self.engine.cache_view(top))

    async def request_log(self) -> list[dict[str, Any]]:
        """``LLMEngine.request_log``, run in the engine thread."""
        return await self._call(self.engine.request_log)

    def stats(self) -> EngineStats:
        """The latest snapshot, taken by the engine thread after the commands it ran (a
        request queued shows as waiting at once), when a step's requests are scheduled and
        after each step."""
        return self._stats

    def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts what is left and stops the engine thread."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ plumbing
    def _submit(self, command: Callable[[], None]) -> None:
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread has stopped")
        self._commands.put(command)
        self._wakeup.set()

    async def _call(self, function: Callable[[], T]) -> T:
        """Runs ``function`` in the engine thread and returns (or raises) its result. A call
        cancelled before the engine thread reached it does not run (the caller is gone; setting
        the result of the cancelled future would raise in the engine thread and stop it)."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(function())
            except BaseException as exc:  # handed back to the caller
                future.set_exception(exc)

        self._submit(run)
        return await asyncio.wrap_future(future)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            self.engine.abort_request(request_id)

    def _wait_for_work(self) -> None:
        """Sleeps until a command arrives (or ``_IDLE_WAIT_S`` passes). Commands are drained at
        the top of every loop turn, so a wakeup cleared here after it was set is never lost."""
        self._wakeup.wait(_IDLE_WAIT_S)
        self._wakeup.clear()

    def _run_commands(self) -> int:
        """Runs the commands queued so far; returns how many ran."""
        ran = 0
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return ran
            command()
            ran += 1

    def _loop(self) -> None:
        """Drains the commands, then steps the engine. It never spins: with nothing unfinished,
        or after a step that scheduled nothing (no work can run until a request arrives or is
        aborted), it waits for a command instead of stepping again."""
        engine = self.engine
        while not self._stopping:
            if self._run_commands() or not engine.has_unfinished_requests():
                self._stats = engine.get_stats()  # a request just queued shows as waiting
            if not engine.has_unfinished_requests():
                self._wait_for_work()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("engine step failed; aborting the running requests")
                for request_id in list(self._streams):
                    engine.abort_request(request_id)
                    self._deliver(request_id, RuntimeError(f"engine step failed: {exc}"))
                continue
            for output in outputs:
                self._deliver(output.request_id, output)
            self._stats = engine.get_stats()
            if self._stat_logger is not None:
                self._stat_logger.maybe_log(self._stats)
            if not engine.last_step_scheduled:
                self._wait_for_work()
        for request_id in list(self._streams):
            engine.abort_request(request_id)
            self._deliver(request_id, EngineDeadError("the engine is shutting down"))
        try:
            engine.close()
        except Exception:
            logger.exception("closing the engine failed")
