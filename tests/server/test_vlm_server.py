"""Images through the HTTP APIs, on real servers on 127.0.0.1 driven by the official ``openai``
and ``anthropic`` clients: a tiny random-weight LLaVA model (``tests/vlm_helpers.py``) and a
tiny text-only model beside it.

A second turn about the same image comes from the cache and runs no encoder; the same pixels
in another format hit; another image with the same text misses from the image's block on;
Anthropic ``image`` blocks share the cache; an ``http`` URL is fetched only from an allowed
host; bad images are 400s that name the problem, and the server serves on."""

from __future__ import annotations

import base64
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from PIL import Image
from server_helpers import HTTP, ServerProcess, free_port, serve_all
from vlm_helpers import (
    IMAGE_TOKEN,
    TOKENS_PER_IMAGE,
    data_url,
    encoded,
    picture,
    write_tiny_llava,
    write_tiny_text_model,
)

from prefixserve.model.text.tokenizer import load_tokenizer

BLOCK = 16
SYSTEM = ("You look at pictures for a museum's visitors and answer questions about them: the "
          "colours, the shapes, what the picture may show and how it was made. Keep answers "
          "short, plain and kind, and say so when the picture does not show what is asked. ")
PICTURE = picture(40)


class _Pictures(BaseHTTPRequestHandler):
    """``/pic.png``: PICTURE; ``/hop``: a redirect to it on ``localhost`` (not allowed)."""

    def do_GET(self) -> None:
        if self.path == "/pic.png":
            body = encoded(PICTURE)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/pic.png")
            self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def pictures() -> Iterator[int]:
    """A local HTTP server of pictures; its port."""
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), _Pictures)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_port
    httpd.shutdown()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vlm")
    write_tiny_llava(path, "clip")
    return path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, pictures: int, vlm_dir: Path
            ) -> Iterator[dict[str, ServerProcess]]:
    vlm, text = vlm_dir, tmp_path_factory.mktemp("text")
    write_tiny_text_model(text)
    logs = tmp_path_factory.mktemp("logs")
    common = ["--dtype", "float32", "--block-size", str(BLOCK), "--num-blocks", "256"]
    processes = {
        "vlm": ServerProcess([str(vlm), *common, "--served-model-name", "vlm",
                              "--limit-mm-per-prompt", "2", "--max-image-pixels", "1000000",
                              "--allowed-media-domains", "127.0.0.1"], logs / "vlm.log"),
        "text": ServerProcess([str(text), *common, "--served-model-name", "text"],
                              logs / "text.log"),
    }
    yield from serve_all(processes)
    for process in processes.values():
        assert "Traceback" not in process.log, process.log


@pytest.fixture(scope="module")
def client(servers: dict[str, ServerProcess]) -> openai.OpenAI:
    return openai.OpenAI(base_url=servers["vlm"].url + "/v1", api_key="unused",
                         max_retries=0, timeout=120)


def system() -> str:
    """The system prompt after a fresh tag: no earlier test cached it."""
    return f"[visit {uuid.uuid4().hex}] {SYSTEM * 3}"


def user(question: str, *urls: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": question}]}


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], model: str = "vlm") -> Any:
    return client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                          max_tokens=4, temperature=0)


def cached(response: Any) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def encoder(server: ServerProcess) -> tuple[float, float]:
    samples = server.metrics()
    return (samples["prefixserve:mm_encoder_runs_total"],
            samples["prefixserve:mm_encoder_cache_hits_total"])


def image_start(vlm_dir: Path, system_text: str, question: str) -> int:
    """Where the image's tokens start in the prompt of ``[system, user(question, image)]``."""
    tokenizer = load_tokenizer(str(vlm_dir))
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": system_text},
         {"role": "user", "content": f"{IMAGE_TOKEN}\n{question}"}])
    assert isinstance(ids, list)
    return ids.index(tokenizer.backend.token_to_id(IMAGE_TOKEN))


def test_second_turn_about_an_image_comes_from_the_cache(servers: dict[str, ServerProcess],
                                                         client: openai.OpenAI) -> None:
    server = servers["vlm"]
    turn = [{"role": "system", "content": system() + SYSTEM * 3},  # ~460 tokens
            user("What is in the picture?", data_url(picture(41)))]
    runs, _ = encoder(server)
    first = ask(client, turn)
    assert cached(first) < first.usage.prompt_tokens // 2
    assert encoder(server)[0] == runs + 1
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And the colours?"}]
    second = ask(client, turn)
    assert cached(second) >= 0.9 * second.usage.prompt_tokens
    assert encoder(server)[0] == runs + 1


def test_same_pixels_hit_another_image_misses_from_its_block(
        vlm_dir: Path, client: openai.OpenAI) -> None:
    text, question = system(), "Describe the shapes."
    start = image_start(vlm_dir, text, question)
    png = ask(client, [{"role": "system", "content": text},
                       user(question, data_url(picture(42), "PNG"))])
    webp = ask(client, [{"role": "system", "content": text},
                        user(question, data_url(picture(42), "WEBP"))])
    assert cached(webp) == (webp.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert webp.usage.prompt_tokens == png.usage.prompt_tokens > start + TOKENS_PER_IMAGE
    other = ask(client, [{"role": "system", "content": text},
                         user(question, data_url(picture(43), "PNG"))])
    assert cached(other) == start // BLOCK * BLOCK


def test_anthropic_image_blocks(servers: dict[str, ServerProcess]) -> None:
    claude = anthropic.Anthropic(base_url=servers["vlm"].url, api_key="unused", max_retries=0,
                                 timeout=120)
    data = base64.b64encode(encoded(picture(44))).decode()
    content: list[Any] = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": data}},
        {"type": "text", "text": "Is it bright?"}]
    request: dict[str, Any] = {"model": "vlm", "max_tokens": 4, "system": system(),
                               "messages": [{"role": "user", "content": content}]}
    first = claude.messages.create(**request)
    second = claude.messages.create(**request)
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens == (total - 1) // BLOCK * BLOCK
    assert first.usage.cache_read_input_tokens < second.usage.cache_read_input_tokens
    counted = claude.messages.count_tokens(model="vlm", system=request["system"],
                                           messages=request["messages"])
    assert counted.input_tokens == total
    content[0]["source"]["data"] = base64.b64encode(b"not a picture").decode()
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(**request)
    assert error.value.body["type"] == "error"  # type: ignore[index]
    assert "messages.0.content.0: the data is not an image" in str(error.value)


def test_anthropic_breakpoint_on_an_image_ends_with_its_tokens(
        servers: dict[str, ServerProcess], vlm_dir: Path) -> None:
    """``cache_control`` on an image block: the blocks written are those up to the end of the
    image's run (the placeholder's expansion shifts the breakpoint)."""
    claude = anthropic.Anthropic(base_url=servers["vlm"].url, api_key="unused", max_retries=0,
                                 timeout=120)
    text, question = system(), "Any faces?"
    while image_start(vlm_dir, text, question) % BLOCK == BLOCK - 1:
        text += " Thanks."  # the image's first and last tokens in different blocks
    data = base64.b64encode(encoded(picture(46))).decode()
    reply = claude.messages.create(model="vlm", max_tokens=4, system=text, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data},
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": question}]}])
    end = image_start(vlm_dir, text, question) + TOKENS_PER_IMAGE
    assert reply.usage.cache_read_input_tokens == 0
    assert reply.usage.cache_creation_input_tokens == end // BLOCK * BLOCK


def test_images_from_an_allowed_host_only(servers: dict[str, ServerProcess],
                                          client: openai.OpenAI, pictures: int) -> None:
    text = system()
    by_data = ask(client, [{"role": "system", "content": text},
                           user("Which animal?", data_url(PICTURE))])
    by_http = ask(client, [{"role": "system", "content": text},
                           user("Which animal?", f"http://127.0.0.1:{pictures}/pic.png")])
    assert cached(by_http) == (by_data.usage.prompt_tokens - 1) // BLOCK * BLOCK
    for url, host in ((f"http://localhost:{pictures}/pic.png", "'localhost'"),
                      (f"http://127.0.0.1:{pictures}/hop", "'localhost'"),
                      ("https://example.com/cat.png", "'example.com'")):
        with pytest.raises(openai.BadRequestError) as error:
            ask(client, [user("Which animal?", url)])
        assert error.value.code == "image_url_not_allowed", url
        assert f"{host} is not one" in error.value.message


def bomb() -> str:
    """A PNG of 5000x5000 pixels in a few KB."""
    return "data:image/png;base64," + base64.b64encode(
        encoded(Image.new("L", (5000, 5000)))).decode()


@pytest.mark.parametrize(("urls", "code", "words"), [
    (["data:image/png;base64," + base64.b64encode(b"GIF? no, text").decode()],
     "invalid_image", "not an image"),
    (["data:image/png;base64,@@@"], "invalid_image", "not valid base64"),
    (["data:text/plain;base64,aGk="], "invalid_image", "media type 'text/plain'"),
    ([bomb()], "image_too_large", "5000x5000 = 25,000,000 pixels, more than the limit of "
     "1,000,000"),
    ([data_url(picture(1))] * 3, "too_many_images", "more than 2 images"),
])
def test_bad_images_are_400s_and_the_server_serves_on(
        servers: dict[str, ServerProcess], client: openai.OpenAI, urls: list[str], code: str,
        words: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, [user("What is it?", *urls)])
    assert (error.value.code, error.value.param) == (code, "messages")
    assert words in error.value.message
    assert ask(client, [user("Still there?", data_url(picture(2)))]).choices


def test_the_image_token_typed_as_text_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, [user(f"look: {IMAGE_TOKEN}", data_url(picture(3)))])
    assert error.value.code == "invalid_image"
    assert "2 image placeholder tokens for 1 images" in error.value.message


def test_a_text_only_model_refuses_images(servers: dict[str, ServerProcess]) -> None:
    text = openai.OpenAI(base_url=servers["text"].url + "/v1", api_key="unused",
                         max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as error:
        ask(text, [user("What is it?", data_url(picture(4)))], model="text")
    assert error.value.code == "image_not_supported"
    assert "messages.0.content.0: this model takes no images" in error.value.message
    assert ask(text, [{"role": "user", "content": "Hello?"}], model="text").choices


def test_images_outside_user_messages_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, [{"role": "system", "content": [
            {"type": "image_url", "image_url": {"url": data_url(picture(5))}}]},
            user("Hi")])
    assert "only user messages may hold image_url parts" in error.value.message


def test_metrics_count_encoder_runs_and_hits(servers: dict[str, ServerProcess],
                                             client: openai.OpenAI) -> None:
    """An image encoded once, then asked about under another system prompt: a prefix miss
    from the first block, an encoder cache hit."""
    server = servers["vlm"]
    image = data_url(picture(45))
    ask(client, [{"role": "system", "content": system()}, user("Lines?", image)])
    runs, hits = encoder(server)
    again = ask(client, [{"role": "system", "content": system()}, user("Lines?", image)])
    assert cached(again) == 0
    assert encoder(server) == (runs, hits + 1)



def test_tokenize_takes_no_images(servers: dict[str, ServerProcess]) -> None:
    response = HTTP.post(servers["vlm"].url + "/tokenize", timeout=60, json={
        "model": "vlm", "messages": [user("What is it?", data_url(picture(6)))]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "image_not_supported"
    assert "taken by /v1/chat/completions only" in error["message"]
