"""The periodic engine log line."""

from __future__ import annotations

import logging
import time

from prefixserve.engine.llm_engine import EngineStats

logger = logging.getLogger("prefixserve.engine")


class StatLogger:
    """Logs throughput, queue sizes, KV cache usage and the rolling prefix-cache hit rate (over
    the most recent ~1000 requests) at most once per ``interval`` seconds."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_generation = 0

    def maybe_log(self, stats: EngineStats) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        logger.info(format_stats(stats, (stats.prompt_tokens - self._last_prompt) / elapsed,
                                 (stats.generation_tokens - self._last_generation) / elapsed))
        self._last_time = now
        self._last_prompt = stats.prompt_tokens
        self._last_generation = stats.generation_tokens


def format_stats(stats: EngineStats, prompt_throughput: float,
                 generation_throughput: float) -> str:
    """The log line; the encoder's counts join it once an image has been seen."""
    line = (
        f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
        f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
        f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
        f"KV cache usage: {stats.kv_cache_usage:.1%}, "
        f"Prefix cache hit rate: {stats.prefix_cache_hit_rate:.1%}"
    )
    if stats.encoder_runs or stats.encoder_cache_hits:
        line += (f", Images encoded: {stats.encoder_runs}, "
                 f"encoder cache hits: {stats.encoder_cache_hits}")
    return line
