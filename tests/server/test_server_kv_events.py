"""``GET /kv_events`` on a real server: a router outside it follows the cache by pulling events,
hashes prompts to the values the server publishes, and resyncs from the snapshot; the same
batches pushed over ZMQ PUB (``--kv-events-zmq``) to a real SUB socket."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest
import zmq
from server_helpers import HTTP, ServerProcess, free_port

from prefixserve.core.kv_events import BlockStored, KVEventBatch, KVSnapshot
from prefixserve.router import CacheIndex, PromptHasher

SEED = "17017"
ZMQ_ENDPOINT = f"tcp://127.0.0.1:{free_port()}"
ADMIN = {"Authorization": "Bearer root-key"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    saved = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = SEED
    try:
        process = ServerProcess(["--num-blocks", "64", "--max-model-len", "512",
                                 "--prefix-caching-hash-algo", "sha256", "--admin-key",
                                 "root-key", "--log-stats-interval", "0",
                                 "--kv-events-zmq", ZMQ_ENDPOINT],
                                tmp_path_factory.mktemp("kv-events") / "server.log")
    finally:
        if saved is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = saved
    yield process.start()
    process.stop()


def _pull(server: ServerProcess, index: CacheIndex, epoch: str | None, after: int) -> dict:
    params: dict[str, str | int] = {"after": after}
    if epoch is not None:
        params["epoch"] = epoch
    body = HTTP.get(server.url + "/kv_events", params=params, headers=ADMIN, timeout=30).json()
    if "snapshot" in body:
        index.resync(KVSnapshot.from_wire(body["snapshot"]))
    for wire in body["batches"]:
        assert index.apply(KVEventBatch.from_wire(wire))
    return body


def test_an_outside_router_follows_the_cache(server: ServerProcess) -> None:
    """(Planted: hashing with another root than the server's gives no match; this fails.)"""
    index = CacheIndex()
    first = _pull(server, index, None, 0)
    assert "snapshot" in first and first["snapshot"]["blocks"] == []
    prompt = list(range(100, 150))  # 3 full blocks of 16
    response = HTTP.post(server.url + "/v1/completions", timeout=60,
                          json={"prompt": prompt, "max_tokens": 1, "cache_salt": "t1"})
    assert response.status_code == 200
    second = _pull(server, index, first["epoch"], first["seq"])
    assert "snapshot" not in second and second["batches"]
    stored = [e for b in second["batches"] for e in KVEventBatch.from_wire(b).events
              if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_block_hash is None
    hashes = PromptHasher(16, "sha256", seed=SEED).hash_values(prompt, "t1")
    assert index.matched_blocks(hashes) == {"server": 3}
    assert index.matched_blocks(PromptHasher(16, "sha256").hash_values(prompt))["server"] == 0
    # a consumer that lost its place (an old sequence number of a wrong epoch) gets a snapshot
    again = _pull(server, CacheIndex(), "stale-epoch", 0)
    assert set(again["snapshot"]["blocks"]) >= {h.hex() for h in hashes}


def test_kv_events_are_an_admin_action(server: ServerProcess) -> None:
    response = HTTP.get(server.url + "/kv_events", timeout=30)
    assert response.status_code == 401
    assert "admin key" in response.json()["error"]["message"]
    bad = HTTP.get(server.url + "/kv_events", params={"after": -1}, headers=ADMIN, timeout=30)
    assert bad.status_code == 400


def test_events_are_pushed_over_zmq(server: ServerProcess) -> None:
    """Each batch arrives as [topic, seq as 8 bytes big-endian, JSON]; a subscriber that joined
    late finds a gap, resyncs from ``GET /kv_events`` and then follows the cache, as
    docs/KV_EVENTS.md says. (Planted: not publishing, or a seq frame that differs from the
    batch's, fails this.)"""
    from prefixserve.server.admin.kv_event_zmq import TOPIC

    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
    socket.connect(ZMQ_ENDPOINT)
    try:
        time.sleep(0.5)  # ZMQ's slow joiner: the subscription must reach the server first
        prompt = list(range(300, 350))
        assert HTTP.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 1, "cache_salt": "zmq"}).status_code == 200
        hashes = PromptHasher(16, "sha256", seed=SEED).hash_values(prompt, "zmq")
        index = CacheIndex()
        deadline = time.monotonic() + 30
        while index.matched_blocks(hashes).get("server", 0) < 3:
            assert socket.poll(max(1, int(1000 * (deadline - time.monotonic())))), "no batch"
            topic, seq, payload = socket.recv_multipart()
            wire = json.loads(payload)
            assert topic == TOPIC and int.from_bytes(seq, "big") == wire["seq"]
            if not index.apply(KVEventBatch.from_wire(wire)):  # joined late: a gap
                _pull(server, index, None, 0)
    finally:
        socket.close(linger=0)


def test_a_bad_zmq_endpoint_is_refused() -> None:
    from prefixserve.cli import build_parser
    from prefixserve.server.launch import server_config

    args = build_parser().parse_args(["serve", "--kv-events-zmq", "localhost:5557"])
    with pytest.raises(ValueError, match="ZMQ endpoint"):
        server_config(args)
