"""The command line behind ``prefixserve bench`` and ``prefixserve bench compare``.

``run_bench``: makes the dataset, decides how prompts are sent (``auto``: token ids when a first
request with token ids succeeds, else text when the same prompt as text does), sends warm-up
requests (short unrelated prompts, not measured), reads the server's ``/metrics`` counters,
runs the dataset with a progress bar, reads the counters again, and prints, writes (``--json``)
and plots (``--plot``) the run. ``run_compare`` prints and plots runs written before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from prefixserve.tools.bench.client import ChatClient, CompletionClient, metrics_url, scrape
from prefixserve.tools.bench.datasets import (
    Dataset,
    Turn,
    WordVocabulary,
    agent,
    multi_turn,
    random_prompts,
    shared_prefix,
)
from prefixserve.tools.bench.metrics import RequestRecord, summarize
from prefixserve.tools.bench.predict import perfect_cache, write_prompt_log
from prefixserve.tools.bench.report import FORMAT, plot_ttft_cdf, print_runs, read_run, write_run
from prefixserve.tools.bench.runner import LoadSettings, RunOutput, run_dataset
from prefixserve.tools.bench.trace import trace_dataset
from prefixserve.tools.trace_formats import TraceError

DEFAULT_NUM_PROMPTS = 100
"""Prompts of the ``random`` and ``trace`` datasets when ``--num-prompts`` is not given."""

WARMUP_PROMPT_LEN = 32
WARMUP_SEED_OFFSET = 1_000_003
"""Warm-up prompts are drawn with ``seed + WARMUP_SEED_OFFSET``, apart from the dataset's."""


class UsageError(ValueError):
    """An option or a combination of options the command cannot run with."""


def make_dataset(args: argparse.Namespace, vocabulary: WordVocabulary) -> Dataset:
    """The dataset ``args`` ask for (raises ``UsageError``, ``ValueError``, ``TraceError``)."""
    name = args.dataset
    if name in ("shared-prefix", "multi-turn", "multimodal") and args.num_prompts is not None:
        raise UsageError(f"--num-prompts does not apply to {name}: its size is set by "
                         + ("--num-groups and --prompts-per-group" if name == "shared-prefix"
                            else "--num-conversations and --num-turns"))
    if name == "shared-prefix":
        return shared_prefix(
            vocabulary, num_groups=args.num_groups, prompts_per_group=args.prompts_per_group,
            system_prompt_len=_or(args.system_prompt_len, 1024), question_len=args.question_len,
            output_len=_or(args.output_len, 64), shuffle=args.shuffle, seed=args.seed)
    if name == "multi-turn":
        return multi_turn(
            vocabulary, num_conversations=args.num_conversations, num_turns=args.num_turns,
            system_prompt_len=_or(args.system_prompt_len, 0), question_len=args.question_len,
            output_len=_or(args.output_len, 64), seed=args.seed)
    if name == "agent":
        return agent(vocabulary, num_sessions=args.num_sessions, num_turns=args.num_turns,
                     tool_tokens=args.tool_tokens, system_tokens=args.system_tokens,
                     num_tools=args.num_tools, task_len=args.question_len,
                     result_len=args.result_len, user_share=args.user_share,
                     output_len=_or(args.output_len, 32), seed=args.seed)
    if name == "multimodal":
        from prefixserve.tools.bench.multimodal import multimodal

        return multimodal(
            vocabulary, num_images=args.num_images, num_conversations=args.num_conversations,
            num_turns=args.num_turns, system_prompt_len=_or(args.system_prompt_len, 0),
            question_len=args.question_len, output_len=_or(args.output_len, 64),
            seed=args.seed)
    if name == "random":
        return random_prompts(vocabulary, num_prompts=_or(args.num_prompts, DEFAULT_NUM_PROMPTS),
                              input_len=args.input_len, output_len=_or(args.output_len, 64),
                              seed=args.seed)
    if args.trace_path is None:
        raise UsageError("the trace dataset needs --trace-path")
    dataset = trace_dataset(
        vocabulary, path=args.trace_path, num_prompts=_or(args.num_prompts, DEFAULT_NUM_PROMPTS),
        scale=args.scale, trace_block_size=args.trace_block_size, time_scale=args.time_scale,
        compress=args.compress_arrivals, trace_format=args.trace_format, seed=args.seed,
        sample=args.trace_sample)
    if args.output_len is not None:
        for session in dataset.sessions:
            session.turns = [Turn(t.tokens, args.output_len) for t in session.turns]
        dataset.params["output_len"] = args.output_len
    return dataset


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _extra_body(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise UsageError("--extra-body must be a JSON object")
    return body


def default_label(args: argparse.Namespace) -> str:
    where = urlsplit(args.base_url).netloc or args.base_url
    load = f"c{args.max_concurrency}" if args.max_concurrency else (
        "rate inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s")
    return f"{args.dataset} {load} @ {where}"


class _Progress:
    """A rich progress bar of finished requests on stderr (a no-op when disabled)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar: Any = None
        self.errors = 0
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[errors]} failed"), TimeElapsedColumn(),
                            console=Console(stderr=True), transient=True)
        self.task = self.bar.add_task("requests", total=total, errors=0)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def record(self, record: RequestRecord) -> None:
        self.errors += not record.ok
        if self.bar is not None:
            self.bar.update(self.task, advance=1, errors=self.errors)


async def _measure(args: argparse.Namespace, dataset: Dataset, vocabulary: WordVocabulary,
                   load: LoadSettings) -> tuple[RunOutput, str, dict[str, float] | None]:
    """Chooses the prompt type, warms up, runs; returns the run, the prompt type used and the
    change of the server's counters (None when it has no ``/metrics``). A dataset that names
    its endpoint (pictures need chat messages) is sent there whatever ``--endpoint`` says."""
    prompt_type = "token-ids" if args.prompt_type == "auto" else args.prompt_type
    endpoint = dataset.endpoint or getattr(args, "endpoint", "completions")
    kind = ChatClient if endpoint == "chat" else CompletionClient
    client = kind(args.base_url, prompt_type=prompt_type, model=args.model,
                  ignore_eos=args.ignore_eos, cache_salt=args.cache_salt,
                  extra_body=_extra_body(args.extra_body), api_key=args.api_key,
                  timeout=args.timeout)
    async with client:
        rng = np.random.default_rng(args.seed + WARMUP_SEED_OFFSET)
        warmups = [vocabulary.sample(rng, WARMUP_PROMPT_LEN) for _ in range(max(1, args.warmup))]
        if args.prompt_type == "auto":
            ids = warmups.pop(0)
            prompt_type = await client.choose_prompt_type(ids, vocabulary.text(ids))
        for ids in warmups[: args.warmup]:
            result = await client.complete(ids, vocabulary.text(ids), 4)
            if result.error is not None:
                raise RuntimeError(f"a warm-up request failed: {result.error}")
        url = args.metrics_url or metrics_url(args.base_url)
        before = await scrape(url)
        with _Progress(not args.no_progress, dataset.num_requests) as progress:
            output = await run_dataset(dataset, client, vocabulary, load, progress.record)
        after = await scrape(url) if before is not None else None
    counters = None
    if before is not None and after is not None:
        counters = {name: after[name] - before[name] for name in sorted(after)
                    if name.endswith("_total") and name in before}
    return output, prompt_type, counters


def run_bench(args: argparse.Namespace) -> int:
    """``prefixserve bench``: 0 when at least one request completed, 1 when none did, 2 when
    the options or the dataset are unusable or the server cannot be reached."""
    from prefixserve.model.text.tokenizer import load_tokenizer

    try:
        if args.dataset is None:
            raise UsageError("--dataset is required (or use: prefixserve bench compare ...)")
        if args.warmup < 0 or not args.timeout > 0:
            raise UsageError("--warmup must not be negative and --timeout must be positive")
        load = LoadSettings(args.request_rate, args.max_concurrency, args.seed)
        vocabulary = WordVocabulary(load_tokenizer(args.tokenizer))
        dataset = make_dataset(args, vocabulary)
        created = datetime.now(UTC).isoformat(timespec="seconds")
        started = time.perf_counter()
        output, prompt_type, counters = asyncio.run(_measure(args, dataset, vocabulary, load))
    except (UsageError, ValueError, TraceError, OSError, RuntimeError) as exc:
        print(f"prefixserve bench: error: {exc}", file=sys.stderr)
        return 2
    document = {
        "format": FORMAT,
        "label": args.label or default_label(args),
        "created": created,
        "wall_s": time.perf_counter() - started,
        "base_url": args.base_url,
        "dataset": {"name": dataset.name, "params": dataset.params,
                    "requests": dataset.num_requests},
        "load": {"request_rate": None if math.isinf(load.request_rate) else load.request_rate,
                 "max_concurrency": load.max_concurrency, "seed": load.seed,
                 "prompt_type": prompt_type, "ignore_eos": args.ignore_eos,
                 "cache_salt": args.cache_salt, "model": args.model,
                 "extra_body": _extra_body(args.extra_body), "warmup": args.warmup},
        "summary": summarize(output.records),
        "perfect_cache": perfect_cache(output.sent),
        "server_metrics": counters,
        "records": [r.to_json() for r in sorted(output.records, key=lambda r: r.start)],
    }
    print_runs([document])
    if args.json:
        write_run(document, args.json)
    if args.plot:
        plot_ttft_cdf([document], args.plot)
    if args.save_prompts:
        write_prompt_log(output.sent, args.save_prompts)
    return 0 if document["summary"]["completed"] else 1


def run_compare(args: argparse.Namespace) -> int:
    """``prefixserve bench compare``: 0, or 2 when a file cannot be read."""
    try:
        documents = [read_run(path) for path in args.runs]
    except (OSError, ValueError) as exc:
        print(f"prefixserve bench compare: error: {exc}", file=sys.stderr)
        return 2
    print_runs(documents)
    if args.plot:
        plot_ttft_cdf(documents, args.plot)
    return 0
