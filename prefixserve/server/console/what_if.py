"""The console's what-if: ``prefixserve estimate`` run on the server's own request log.

The log (``CacheBoard.request_log``: the block hash ids of recent prompts, as a mooncake trace
of the engine's block size) is written to a temporary file and the estimator is run on it as
the command line runs it, in child processes (the server's event loop and engine thread go
on), three times:

1. the pool at 0.5x, 1x, 2x and 4x the server's KV blocks (and the infinite cache);
2. the pool as it is with a disk tier of ``tier_blocks`` below it;
3. ``replicas`` replicas of the server's pool each, under prefix-aware and round-robin routing.

The answer carries the figures and the commands, which give the same figures on the log that
``GET /v1/cache/requests`` returns. A second call on an unchanged log answers from memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from prefixserve.server.errors import ApiError

_log = logging.getLogger(__name__)

#: Seconds the three estimator runs may take together before the call answers 503.
TIMEOUT_S = 300.0
SIZE_FACTORS = (0.5, 1.0, 2.0, 4.0)


def estimate_commands(log_path: str, block_size: int, pool_blocks: int, tier_blocks: int,
                      replicas: int, out: str) -> list[list[str]]:
    """The three ``prefixserve estimate`` argument lists (without the program), each writing
    its JSON to ``out`` + ``.N.json``."""
    sizes = sorted({max(1, round(pool_blocks * f)) for f in SIZE_FACTORS})
    common = ["estimate", log_path, "--format", "mooncake", "--block-size", str(block_size),
              "--jobs", "1", "--no-progress"]
    return [
        [*common, "--capacity", ",".join(map(str, sizes)), "--json", f"{out}.1.json"],
        [*common, "--capacity", str(pool_blocks), "--tier-capacity", str(tier_blocks),
         "--json", f"{out}.2.json"],
        [*common, "--capacity", str(pool_blocks), "--replicas", str(replicas),
         "--routing", "prefix-aware,round-robin", "--json", f"{out}.3.json"],
    ]


class WhatIf:
    """Runs the estimates, remembering the last answer per log and parameters."""

    def __init__(self, block_size: int, pool_blocks: int) -> None:
        self.block_size = block_size
        self.pool_blocks = pool_blocks
        self._last: tuple[Any, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()

    async def answer(self, log: list[dict[str, Any]], tier_blocks: int,
                     replicas: int) -> dict[str, Any]:
        key = (len(log), log[-1]["timestamp"] if log else None, tier_blocks, replicas)
        async with self._lock:
            if self._last is not None and self._last[0] == key:
                return self._last[1]
            if not log:
                result: dict[str, Any] = {"requests": 0, "sizes": [], "tier": None,
                                          "replicas": [], "commands": []}
            else:
                result = await self._run(log, tier_blocks, replicas)
            self._last = (key, result)
            return result

    async def _run(self, log: list[dict[str, Any]], tier_blocks: int,
                   replicas: int) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="prefixserve-what-if-") as folder:
            path = os.path.join(folder, "requests.jsonl")
            out = os.path.join(folder, "estimate")
            await asyncio.to_thread(_write_jsonl, path, log)
            commands = estimate_commands(path, self.block_size, self.pool_blocks, tier_blocks,
                                         replicas, out)
            await asyncio.gather(*[_run_estimate(c) for c in commands])
            figures = [await asyncio.to_thread(_read_json, f"{out}.{i}.json") for i in (1, 2, 3)]
        shown = [["prefixserve", *c] for c in estimate_commands(
            "requests.jsonl", self.block_size, self.pool_blocks, tier_blocks, replicas, "out")]
        return self._shape(len(log), figures, tier_blocks, [" ".join(c) for c in shown])

    def _shape(self, requests: int, figures: list[dict[str, Any]], tier_blocks: int,
               commands: list[str]) -> dict[str, Any]:
        sizes = [{"capacity_blocks": c["capacity_blocks"],
                  "factor": None if c["infinite"] else c["capacity_blocks"] / self.pool_blocks,
                  "token_hit_rate": c["token_hit_rate"], "block_hit_rate": c["block_hit_rate"]}
                 for c in figures[0]["caches"]]
        tier = next(c for c in figures[1]["caches"] if not c["infinite"])
        return {
            "requests": requests, "block_size": self.block_size,
            "pool_blocks": self.pool_blocks, "sizes": sizes,
            "tier": {"tier_blocks": tier_blocks, "token_hit_rate": tier["token_hit_rate"],
                     "tier_token_hit_rate": tier["tier_token_hit_rate"],
                     "block_hit_rate": tier["block_hit_rate"]},
            "replicas": [{"routing": r["routing"], "replicas": r["replicas"],
                          "token_hit_rate": r["token_hit_rate"],
                          "block_hit_rate": r["block_hit_rate"]}
                         for r in figures[2]["results"]],
            "commands": commands,
        }


def _write_jsonl(path: str, records: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, separators=(",", ":")) + "\n")


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


async def _run_estimate(arguments: list[str]) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixserve", *arguments, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise ApiError(503, f"the estimate took more than {TIMEOUT_S:g} s; try again later",
                       code="what_if_timeout") from None
    if process.returncode != 0:  # the details (with the temporary folder) go to the log only
        _log.error("prefixserve estimate failed (exit %s): %s", process.returncode,
                   stderr.decode("utf-8", "replace").strip()[-2000:])
        raise ApiError(500, f"the estimate failed (exit {process.returncode}); the server's "
                       "log says why", code="what_if_failed")
