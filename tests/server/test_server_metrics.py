"""``/metrics`` as dashboards and autoscalers scrape it: the prefix-cache counters in tokens
(as vLLM's) and in blocks, a ``model_name`` label on every sample, and the name prefix
(``prefixserve:`` by default, ``vllm:`` with ``--metrics-prefix vllm``). Against a real server
process, once per prefix, plus ``ServerMetrics`` and the bench report on their own."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import generate_latest
from server_helpers import HTTP, ServerProcess, serve_all

from prefixserve.core.tiers import TierStats
from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.engine.llm_engine import EngineStats
from prefixserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from prefixserve.server.metrics import ServerMetrics
from prefixserve.tools.bench.report import server_hit_rate

BLOCK_SIZE = 16
PROMPT_LEN = 40  # two full blocks can come from the cache; the last 8 tokens never do
SERVED_NAME = "metrics-model"

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
          "kv_cache_num_blocks", "kv_cache_num_free_blocks", "prefix_cache_hit_rate")
COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total",
            "prefix_cache_query_blocks_total", "prefix_cache_hit_blocks_total",
            "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
            "request_success_total")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds", "request_prompt_tokens",
              "request_generation_tokens")
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "prefixserve.json"
GONE = ("prefix_cache_query_tokens_total", "prefix_cache_hit_tokens_total")
"""The old token counters' names: the token counts are ``prefix_cache_queries/hits`` now."""


PREFIXES = ("prefixserve", "vllm")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """One server per metric name prefix, started side by side (the default prefix is left to
    the default)."""
    processes = {}
    for prefix in PREFIXES:
        args = ["--num-blocks", "64", "--block-size", str(BLOCK_SIZE), "--max-model-len", "256",
                "--served-model-name", SERVED_NAME, "--log-stats-interval", "0"]
        if prefix != "prefixserve":
            args += ["--metrics-prefix", prefix]
        processes[prefix] = ServerProcess(
            args, tmp_path_factory.mktemp(f"metrics-{prefix}") / "server.log")
    yield from serve_all(processes)


@pytest.fixture(params=PREFIXES)
def served(request: pytest.FixtureRequest, servers: dict[str, ServerProcess]
           ) -> tuple[ServerProcess, str]:
    """A server and its metric name prefix."""
    return servers[request.param], request.param


def fresh_prompt() -> list[int]:
    """Token ids that no earlier request sent."""
    return random.Random(uuid.uuid4().int).sample(range(100, 10_000), PROMPT_LEN)


def complete(server: ServerProcess, ids: list[int]) -> dict[str, Any]:
    """The ``usage`` of a one-token completion of ``ids``."""
    response = HTTP.post(server.url + "/v1/completions", timeout=120,
                          json={"model": SERVED_NAME, "prompt": ids, "max_tokens": 1,
                                "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_prefix_cache_counters_count_tokens_and_blocks(served: tuple[ServerProcess, str]
                                                        ) -> None:
    server, prefix = served
    before = server.metrics()
    ids = fresh_prompt()
    usages = [complete(server, ids) for _ in range(2)]
    prompt_tokens = [u["prompt_tokens"] for u in usages]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert prompt_tokens == [PROMPT_LEN, PROMPT_LEN]
    assert cached == [0, 2 * BLOCK_SIZE]
    # The engine publishes its counters just after it hands out the outputs: wait for them.
    after = server.wait_for_metrics(lambda s: s[f"{prefix}:prompt_tokens_total"]
                                    >= before[f"{prefix}:prompt_tokens_total"] + PROMPT_LEN * 2)

    def change(name: str) -> float:
        return after[f"{prefix}:{name}"] - before[f"{prefix}:{name}"]

    assert change("prefix_cache_queries_total") == sum(prompt_tokens)
    assert change("prefix_cache_hits_total") == sum(cached)
    assert change("prefix_cache_hit_blocks_total") == sum(cached) // BLOCK_SIZE
    assert change("prefix_cache_query_blocks_total") == sum(p // BLOCK_SIZE
                                                            for p in prompt_tokens)
    assert not [name for name in GONE if f"{prefix}:{name}" in after]


def test_every_sample_has_the_model_name_and_the_prefix(served: tuple[ServerProcess, str]
                                                         ) -> None:
    server, prefix = served
    complete(server, fresh_prompt())
    samples = server.samples()
    assert {s.labels.get("model_name") for s in samples} == {SERVED_NAME}
    names = {s.name for s in samples}
    assert not [name for name in names if not name.startswith(prefix + ":")]
    bare = {name.removeprefix(prefix + ":") for name in names}
    expected = {*GAUGES, *COUNTERS, *(h + "_count" for h in HISTOGRAMS)}
    assert expected <= bare, expected - bare
    reasons = {s.labels["finished_reason"] for s in samples
               if s.name == f"{prefix}:request_success_total"}
    assert reasons == {"stop", "length", "abort"}


def dashboard_metric_names(prefix: str) -> set[str]:
    """The metric names the Grafana dashboard's queries (panels and variables) name, with its
    ``prefix`` variable set to ``prefix``."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert [o["value"] for o in variables["prefix"]["options"]] == list(PREFIXES)
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries.append(variables["model"]["definition"])
    text = "\n".join(queries)
    assert not re.findall(r"\b(?:prefixserve|vllm):", text)  # every name through ${prefix}
    text = text.replace("${prefix}", prefix)
    return set(re.findall(rf"\b{prefix}:[a-z0-9_]+", text))


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(
        served: tuple[ServerProcess, str]) -> None:
    """``deploy/grafana/prefixserve.json`` parses, offers both name prefixes, and every metric
    its queries name is exported: by the served process, or (the ``kv_tier_*`` families, which
    exist only with cache tiers, and the evictions, which have samples once a block was
    evicted) by the same collector given such stats. Kills a panel whose metric was renamed or
    misspelt, and one written for a single prefix."""
    server, prefix = served
    complete(server, fresh_prompt())
    exported = {s.name for s in server.samples()}
    stats = engine_with(kv_tiers=(TierStats("disk"),), evictions_by_priority={35: 1})
    tiered = ServerMetrics(stats, SERVED_NAME, prefix)
    exported |= {s.name for family in tiered.registry.collect() for s in family.samples}
    names = dashboard_metric_names(prefix)
    assert len(names) >= 25, names
    assert names <= exported, sorted(names - exported)


# ----------------------------------------------------------------------- without a server
def engine_with(**figures: Any) -> AsyncLLM:
    """An engine whose ``stats()`` holds ``figures`` (zero for the others, no cache tiers)."""
    names = [field.name for field in dataclasses.fields(EngineStats)]
    stats = SimpleNamespace(**{name: figures.get(name, 0) for name in names})
    stats.kv_tiers = figures.get("kv_tiers", ())
    return cast(AsyncLLM, SimpleNamespace(stats=lambda: stats))


def test_server_metrics_names_labels_and_token_counters() -> None:
    engine = engine_with(prefix_cache_queries=4, prefix_cache_hits=2,
                         prefix_cache_query_tokens=80, prefix_cache_hit_tokens=32)
    registry = ServerMetrics(engine, "m", "vllm").registry
    label = {"model_name": "m"}
    assert registry.get_sample_value("vllm:prefix_cache_queries_total", label) == 80
    assert registry.get_sample_value("vllm:prefix_cache_hits_total", label) == 32
    assert registry.get_sample_value("vllm:prefix_cache_query_blocks_total", label) == 4
    assert registry.get_sample_value("vllm:prefix_cache_hit_blocks_total", label) == 2
    assert b"prefixserve:" not in generate_latest(registry)
    default = ServerMetrics(engine, "m").registry
    assert default.get_sample_value("prefixserve:prefix_cache_hits_total", label) == 32


def test_tier_metrics_have_one_sample_per_tier() -> None:
    engine = engine_with(kv_tiers=(TierStats("disk", hit_tokens=48, corrupt_blocks=1,
                                             writable=False, full_events=1),
                                   TierStats("redis", up=False, down_events=2)))
    registry = ServerMetrics(engine, "m").registry

    def value(name: str, tier: str) -> float | None:
        return registry.get_sample_value(f"prefixserve:kv_tier_{name}",
                                         {"model_name": "m", "tier": tier})

    assert (value("up", "disk"), value("up", "redis")) == (1, 0)
    assert value("hit_tokens_total", "disk") == 48
    assert value("corrupt_blocks_total", "disk") == 1
    assert value("down_events_total", "redis") == 2
    assert (value("writable", "disk"), value("full_events_total", "disk")) == (0, 1)
    assert registry.get_sample_value("prefixserve:kv_tier_up",
                                     {"model_name": "m", "tier": "pool"}) is None
    none = ServerMetrics(engine_with(), "m").registry
    assert b"kv_tier" not in generate_latest(none)


def output(tokens: int, finish: str | None, times: RequestMetrics) -> RequestOutput:
    return RequestOutput("r", None, list(range(PROMPT_LEN)),
                         [CompletionOutput(0, "x" * tokens, list(range(tokens)), finish)],
                         finish is not None, 0, times)


def test_request_tracker_observes_sizes_and_phases() -> None:
    metrics = ServerMetrics(engine_with(), "m")
    times = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5,
                           first_token_time=101.0, last_token_time=103.0)
    tracker = metrics.track(1)
    tracker.observe(output(1, None, times))
    tracker.observe(output(2, "length", times))
    tracker.close()

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(f"prefixserve:{name}",
                                                 {"model_name": "m", **labels})

    assert value("request_success_total", finished_reason="length") == 1
    assert value("request_success_total", finished_reason="abort") == 0
    assert value("request_prompt_tokens_sum") == PROMPT_LEN
    assert value("request_generation_tokens_sum") == 3
    assert value("request_queue_time_seconds_sum") == 0.5
    assert value("request_prefill_time_seconds_sum") == 0.5
    assert value("request_decode_time_seconds_sum") == 2.0
    assert value("request_inference_time_seconds_sum") == 2.5
    assert value("time_to_first_token_seconds_count") == 1
    assert value("e2e_request_latency_seconds_count") == 1


def test_bench_reads_the_token_counters_under_every_naming() -> None:
    def rate(**counters: float) -> float | None:
        """``server_hit_rate`` of a run whose counters are ``PREFIX_NAME=value``."""
        return server_hit_rate({"server_metrics": {
            name.replace("_", ":", 1): value for name, value in counters.items()}})

    assert rate(prefixserve_prefix_cache_queries_total=80,
                prefixserve_prefix_cache_hits_total=32) == 0.4
    assert rate(vllm_prefix_cache_queries_total=80, vllm_prefix_cache_hits_total=20) == 0.25
    # A run file from before the rename: the plain names counted blocks then.
    assert rate(prefixserve_prefix_cache_queries_total=4, prefixserve_prefix_cache_hits_total=2,
                prefixserve_prefix_cache_query_tokens_total=80,
                prefixserve_prefix_cache_hit_tokens_total=32) == 0.4
    assert rate() is None
