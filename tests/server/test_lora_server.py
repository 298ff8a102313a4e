"""LoRA adapters over HTTP on a real server (default model, float32): selection by ``model``,
``/v1/models``, loading and unloading at run time (admin), refusals, per-adapter cache counts
and metrics, no leaked blocks. Adapters are random low-rank PEFT files written by the test."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from lora_helpers import default_config, write_peft_adapter
from server_helpers import HTTP, ServerProcess, idle, openai_client, serve_for_module

ADMIN = "root-key"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-adapters")
    config = default_config()
    other_base = dataclasses.replace(config, intermediate_size=1024)
    return {"a": write_peft_adapter(root / "a", config, seed=11),
            "b": write_peft_adapter(root / "b", config, seed=12),
            "c": write_peft_adapter(root / "c", config, seed=13, rank=2),
            "big": write_peft_adapter(root / "big", config, seed=14, rank=32, parts=("o",)),
            "other": write_peft_adapter(root / "other", other_base, seed=15)}


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    yield from serve_for_module(["--dtype", "float32", "--num-blocks", "256", "--served-model-name",
                             "smol", "--lora-modules", f"a={adapters['a']}",
                             f"b={adapters['b']}", "--max-loras", "2", "--max-lora-rank", "8",
                             "--admin-key", ADMIN],
                                tmp_path_factory.mktemp("lora-server") / "server.log")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, timeout=120)


def complete(client: openai.OpenAI, model: str, prompt: str | list[int], **kwargs: object):
    return client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                     **kwargs)  # type: ignore[call-overload]


def admin(server: ServerProcess, route: str, body: dict[str, object],
          headers: dict[str, str] | None = None) -> httpx.Response:
    return HTTP.post(server.url + route, json=body, timeout=60,
                      headers=ADMIN_HEADERS if headers is None else headers)


def test_models_lists_adapters_with_their_base(client: openai.OpenAI) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["smol", "a", "b"]
    assert cards["a"].parent == "smol" and cards["b"].parent == "smol"  # type: ignore[attr-defined]
    assert cards["a"].root.startswith("lora-") and cards["a"].root != cards["b"].root
    assert cards["smol"].parent is None  # type: ignore[attr-defined]


def test_model_name_selects_the_adapter_and_its_cache(server: ServerProcess,
                                                      client: openai.OpenAI) -> None:
    """Each adapter answers differently and caches in its own namespace; the response names
    the adapter. Kills: ``model`` ignored (one output for all), blocks shared across adapters."""
    prompt = [100 + (i * 7919) % 30000 for i in range(200)]  # 12 full blocks of 16
    texts = {}
    for model in ("smol", "a", "b"):
        first = complete(client, model, prompt)
        assert first.model == model
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        texts[model] = first.choices[0].text
        again = complete(client, model, prompt)
        assert again.usage.prompt_tokens_details.cached_tokens == 192
        assert again.choices[0].text == texts[model]
    assert len(set(texts.values())) == 3
    chat = client.chat.completions.create(model="b", max_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == "b"
    samples = server.wait_for_metrics(idle)
    assert samples["prefixserve:lora_prefix_cache_hits_total{lora_name=a}"] >= 192
    assert samples["prefixserve:lora_prefix_cache_queries_total{lora_name=b}"] >= 400
    assert samples["prefixserve:lora_prefix_cache_hits_total{lora_name=smol}"] >= 192


def test_unknown_adapter_is_a_404_like_an_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        complete(client, "nope", "hello")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_load_and_unload_at_run_time(server: ServerProcess, client: openai.OpenAI,
                                     adapters: dict[str, Path]) -> None:
    body = {"lora_name": "c", "lora_path": str(adapters["c"])}
    assert admin(server, "/v1/load_lora_adapter", body, headers={}).status_code == 401
    loaded = admin(server, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["status"] == "loaded" and loaded.json()["lora_id"].startswith("lora-")
    assert "c" in {m.id for m in client.models.list().data}
    assert complete(client, "c", "Once upon a time").model == "c"
    again = admin(server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    unloaded = admin(server, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert unloaded.status_code == 200 and unloaded.json()["status"] == "unloaded"
    assert "c" not in {m.id for m in client.models.list().data}
    gone = admin(server, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_not_found"
    with pytest.raises(openai.NotFoundError):
        complete(client, "c", "hello")
    server.wait_for_metrics(idle)


@pytest.mark.parametrize(("name", "expected"), [
    ("big", "rank 32, above the limit of 8 (--max-lora-rank)"),
    ("other", "another base model"),
    ("missing", "expected a PEFT directory"),
])
def test_unusable_adapters_are_refused(server: ServerProcess, adapters: dict[str, Path],
                                       tmp_path: Path, name: str, expected: str) -> None:
    path = adapters.get(name, tmp_path / "missing")
    response = admin(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_lora" and expected in error["message"]
    assert str(path) not in error["message"]  # no server path in an answer
    taken = admin(server, "/v1/load_lora_adapter",
                  {"lora_name": "smol", "lora_path": str(adapters["c"])})
    assert taken.status_code == 400 and "base model's name" in taken.json()["error"]["message"]


def test_unloading_an_adapter_in_use_is_refused(server: ServerProcess,
                                                adapters: dict[str, Path]) -> None:
    """While a streamed request runs under ``c``, unloading it is a 409; the stream goes on;
    once it is done the unload succeeds and every block is back."""
    assert admin(server, "/v1/load_lora_adapter",
                 {"lora_name": "c", "lora_path": str(adapters["c"])}).status_code == 200
    body = {"model": "c", "prompt": f"[{uuid.uuid4().hex}] Tell me a story", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        refused = admin(server, "/v1/unload_lora_adapter", {"lora_name": "c"})
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "lora_in_use"
        assert any(line == "data: [DONE]" for line in lines)
    server.wait_for_metrics(idle)
    assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
