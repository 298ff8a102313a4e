"""The ``trace`` dataset: a Mooncake-style block-hash trace replayed as token ids.

The trace is read by the estimator's own reader (``trace_formats.read_workload``, at the
trace's block size, so each id stays one block); its ``timestamp`` and ``output_length`` fields,
which the estimator does not keep, are read by the same line reader in a second pass.

Each trace block becomes ``trace_block_size / scale`` word tokens drawn from a generator seeded
with ``(seed, block id)``: equal ids give equal token blocks, and since the ids are chained (an
id always follows the same parent), equal ids give equal histories too. The prompt has
``round(input_length / scale)`` tokens: the blocks of its full trace blocks, then a partial tail
seeded with ``(seed, last full block id, tail length)``, so only prompts with the same blocks
and the same length share their tail. Outputs are scaled the same way. Arrivals follow the
timestamps (milliseconds), relative to the first request replayed and multiplied by
``time_scale``, unless ``compress`` leaves them to the runner's request rate and concurrency.

Which requests: the first ``num_prompts`` (``sample="first"``), or whole conversations
(``sample="conversations"``): requests are grouped by their first two block ids (Mooncake's
first block is a system prompt every request shares, its second starts a conversation), groups
are drawn at random (seeded) and kept while the total stays within ``num_prompts``, and their
requests are replayed in trace order. The beginning of a trace is mostly first turns, whose
hit rate is far below the whole trace's; sampled conversations keep later turns with their
history.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import cast

import numpy as np

from prefixserve.tools.bench.datasets import Dataset, Session, Turn, WordVocabulary
from prefixserve.tools.trace_formats import (
    LineError,
    ReadOptions,
    TraceError,
    iter_records,
    open_binary,
    read_workload,
)

TRACE_FORMATS = ("mooncake", "bailian")
"""Trace formats with one request a line and a timestamp, which the benchmark can replay."""

TRACE_SAMPLES = ("first", "conversations")


class _BlockTokens:
    """Token blocks keyed by trace block ids, drawn once and remembered."""

    def __init__(self, vocabulary: WordVocabulary, block_len: int, seed: int) -> None:
        self.vocabulary = vocabulary
        self.block_len = block_len
        self.seed = seed
        self._blocks: dict[Hashable, list[int]] = {}

    def _draw(self, key: tuple[int, ...], n: int) -> list[int]:
        return self.vocabulary.sample(np.random.default_rng([self.seed, *key]), n)

    def block(self, block_id: int) -> list[int]:
        tokens = self._blocks.get(block_id)
        if tokens is None:
            tokens = self._blocks[block_id] = self._draw((0, block_id), self.block_len)
        return tokens

    def tail(self, last_id: int | None, length: int) -> list[int]:
        parent = 0 if last_id is None else last_id + 1
        return self._draw((1, parent, length), length)


def _arrivals_and_outputs(path: str) -> list[tuple[float, int]]:
    """``(timestamp in ms, output_length)`` of each record of ``path``."""
    stream, raw, _ = open_binary(path)
    out: list[tuple[float, int]] = []
    try:
        for number, record in iter_records(stream):
            if isinstance(record, LineError):
                raise TraceError(f"{path}:{number}: {record}")
            timestamp = record.get("timestamp", 0)
            output_length = record.get("output_length", 0)
            if not isinstance(timestamp, int | float) or not isinstance(output_length, int):
                raise TraceError(f"{path}:{number}: 'timestamp' must be a number and "
                                 "'output_length' an integer")
            out.append((float(timestamp), output_length))
    finally:
        stream.close()
        if raw is not None:
            raw.close()
    return out


def _int_ids(ids: Iterable[Hashable]) -> list[int]:
    """Block ids of a replayable trace as ints: mooncake and bailian ``hash_ids`` are ints."""
    return [int(i) for i in cast("Iterable[int]", ids)]


def _conversations(keys: list[tuple[int, ...]], limit: int, seed: int) -> list[int]:
    """Indices of whole groups of equal ``keys``, drawn at random while they fit in ``limit``
    requests, in ascending order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    members = list(groups.values())
    chosen: list[int] = []
    for g in np.random.default_rng(seed).permutation(len(members)):
        if len(chosen) + len(members[g]) <= limit:
            chosen += members[g]
    return sorted(chosen)


def trace_dataset(vocabulary: WordVocabulary, *, path: str, num_prompts: int | None,
                  scale: int, trace_block_size: int, time_scale: float, compress: bool,
                  trace_format: str | None, seed: int, sample: str = "first") -> Dataset:
    """``num_prompts`` requests (all when None) of the trace at ``path``, chosen by ``sample``
    and scaled down by ``scale`` (which must divide ``trace_block_size``), as single-turn
    sessions in trace order. Raises ``TraceError`` for an unreadable trace, ``ValueError`` for
    bad settings."""
    if sample not in TRACE_SAMPLES:
        raise ValueError(f"trace sample must be one of {TRACE_SAMPLES}, got {sample!r}")
    if scale < 1 or trace_block_size % scale:
        raise ValueError(f"--scale must divide the trace block size {trace_block_size}, "
                         f"got {scale}")
    if time_scale < 0:
        raise ValueError(f"--time-scale must not be negative, got {time_scale}")
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
    workload = read_workload(path, ReadOptions(format=trace_format, block_size=trace_block_size,
                                               trace_block_size=trace_block_size))
    if workload.format not in TRACE_FORMATS:
        raise TraceError(f"{path}: a {workload.format} input cannot be replayed; the trace "
                         f"dataset takes {' or '.join(TRACE_FORMATS)} traces")
    extras = _arrivals_and_outputs(path)
    if len(extras) != len(workload.requests):
        raise TraceError(f"{path}: {len(extras)} records but {len(workload.requests)} requests")
    limit = len(extras) if num_prompts is None else num_prompts
    if sample == "first":
        chosen = list(range(min(limit, len(extras))))
    else:
        keys = [tuple(_int_ids(r.ids[:2])) for r in workload.requests]
        chosen = _conversations(keys, limit, seed)
    if not chosen:
        raise TraceError(f"{path}: no conversation fits in {limit} requests")
    blocks = _BlockTokens(vocabulary, trace_block_size // scale, seed)
    start = extras[chosen[0]][0]
    sessions = []
    for index in chosen:
        request = workload.requests[index]
        timestamp, output_length = extras[index]
        ids = _int_ids(workload.block_keys(request))
        tokens = [t for block_id in ids for t in blocks.block(block_id)]
        length = max(1, round(request.num_prompt_tokens / scale))
        tokens += blocks.tail(ids[-1] if ids else None, length - len(tokens))
        arrival = None if compress else (timestamp - start) / 1000.0 * time_scale
        sessions.append(Session([Turn(tokens, max(1, round(output_length / scale)))],
                                arrival=arrival, group=index))
    return Dataset("trace", sessions, {
        "trace_path": path, "trace_format": workload.format, "sample": sample,
        "num_prompts": len(sessions),
        "scale": scale, "trace_block_size": trace_block_size,
        "block_len": trace_block_size // scale, "time_scale": time_scale,
        "compress_arrivals": compress, "seed": seed})
