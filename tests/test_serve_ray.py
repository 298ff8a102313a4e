"""``prefixserve serve --replicas 2`` on a local Ray cluster (one cluster for the module): the
cache-aware router keeps a shared prefix's traffic together, round-robin splits it; ``/metrics``
merges the replicas with a ``replica`` label.

The single server's cached share on this traffic is the perfect cache's, which ``prefixserve
bench`` reports beside every run (``perfect_cache``): one request at a time, a server whose cache
holds the whole run serves exactly that (``test_bench.test_end_to_end_shared_prefix_and_multi_
turn`` asserts it), so the comparison needs no third server.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerProcess

from prefixserve.cli import main
from prefixserve.tools.bench.report import read_run

RAY_STARTUP_S = 360.0
"""A Ray cluster, its Serve controller and proxy and two model loads: 80-150 s measured on a
2-core machine shared with other work (the whole module: 100-160 s)."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(["--replicas", "2", "--routing-override", "--dtype", "float32",
                             "--max-num-seqs", "4", "--num-threads", "1", "--num-blocks", "512",
                             "--max-model-len", "1024", "--log-stats-interval", "0",
                             "--ray-num-cpus", "2", "--ray-replica-cpus", "0.5"],
                            tmp_path_factory.mktemp("ray") / "server.log").start(RAY_STARTUP_S)
    yield process
    process.stop()


def _bench(url: str, out: Path, salt: str) -> dict:
    assert main(["bench", "--base-url", url, "--no-progress", "--json", str(out),
                 "--dataset", "shared-prefix", "--num-groups", "4", "--prompts-per-group", "4",
                 "--system-prompt-len", "64", "--question-len", "8", "--output-len", "2",
                 "--ordered", "--max-concurrency", "1", "--cache-salt", salt]) == 0
    return read_run(str(out))


def test_prefix_aware_keeps_the_single_servers_cached_share(cluster: ServerProcess,
                                                            tmp_path: Path) -> None:
    """Prefix-aware within 5 points of the single server; round-robin visibly less (ordered
    groups alternate between the replicas, so each computes every system prompt once).
    (Planted: routing prefix-aware requests in turn makes the first assertion fail.)"""
    aware = _bench(cluster.url + "/v1", tmp_path / "aware.json", "aware")
    rr = _bench(cluster.url + "/routing/round-robin/v1", tmp_path / "rr.json", "rr")
    for run in (aware, rr):
        assert (run["summary"]["completed"], run["summary"]["errors"]) == (16, 0)
    single = aware["perfect_cache"]["token_hit_rate"]
    assert rr["perfect_cache"]["token_hit_rate"] == pytest.approx(single)
    assert abs(aware["summary"]["cached_share"] - single) <= 0.05
    assert rr["summary"]["cached_share"] <= single - 0.15


def test_metrics_are_merged_with_a_replica_label(cluster: ServerProcess) -> None:
    text = httpx.get(cluster.url + "/metrics", timeout=60).text
    lines = [line for line in text.splitlines()
             if line.startswith("prefixserve:kv_cache_num_blocks")]
    replicas = {line.split('replica="')[1].split('"')[0] for line in lines}
    assert len(replicas) == 2, text[:2000]
    assert text.count("# TYPE prefixserve:kv_cache_num_blocks ") == 1


def test_bad_requests_get_the_single_servers_errors(cluster: ServerProcess) -> None:
    response = httpx.post(cluster.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1},
                          timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    assert httpx.get(cluster.url + "/routing/nope/v1/models", timeout=60).status_code == 404
