"""What a perfect prefix cache would have served of a run, by ``prefixserve estimate``.

The prompts a run sent (token ids, in send order, with their pictures' hashes) and their
replies (the reply text encoded again) are written as an estimator ``tokens`` log and replayed
through the estimator's infinite cache, at the engine's block size: every full block computed
so far stays cached. Replies are decoded before the next request arrives (``concurrency`` 1),
as the runner sends a turn only once the reply to the one before has come. The figures are the
prefill saving caching can give on this traffic: the share of prompt tokens found in cache and
the 1/(1-h) bound on prefill speed-up.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from prefixserve.tools.bench.runner import SentPrompt
from prefixserve.tools.estimate.replay import ReplaySettings, replay_infinite
from prefixserve.tools.trace_formats import ReadOptions, read_workload

ENGINE_BLOCK_SIZE = 16
"""The engine's default KV block size, at which the estimate is taken."""


def write_prompt_log(sent: Sequence[SentPrompt], path: str) -> None:
    """Writes the prompts as an estimator ``tokens`` log: one ``{"token_ids",
    "output_token_ids"}`` line each, with ``"mm_inputs"`` (``{"offset", "length", "hash"}``
    of each picture) when the prompt holds pictures, in send order (``prefixserve estimate
    PATH`` reads it)."""
    with open(path, "w", encoding="utf-8") as log:
        for prompt in sent:
            line: dict[str, Any] = {"token_ids": prompt.ids, "output_token_ids": prompt.reply_ids}
            if prompt.mm_inputs:
                line["mm_inputs"] = [{"offset": mm.offset, "length": mm.length,
                                      "hash": mm.content_hash} for mm in prompt.mm_inputs]
            log.write(json.dumps(line) + "\n")


def perfect_cache(sent: Sequence[SentPrompt], block_size: int = ENGINE_BLOCK_SIZE
                  ) -> dict[str, Any] | None:
    """The infinite-cache figures of the prompts sent (None when nothing was sent)."""
    if not sent:
        return None
    with tempfile.TemporaryDirectory(prefix="prefixserve-bench-") as folder:
        path = os.path.join(folder, "prompts.jsonl")
        write_prompt_log(sent, path)
        workload = read_workload(path, ReadOptions(format="tokens", block_size=block_size))
    result = replay_infinite(workload, ReplaySettings(concurrency=1))
    return {
        "source": "prefixserve estimate, infinite cache",
        "block_size": block_size,
        "requests": result.requests,
        "query_tokens": result.query_tokens,
        "hit_tokens": result.hit_tokens,
        "token_hit_rate": result.token_hit_rate,
        "block_hit_rate": result.block_hit_rate,
        "speedup_bound": result.speedup_bound if result.token_hit_rate < 1 else None,
    }
