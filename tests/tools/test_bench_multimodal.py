"""The benchmark's ``multimodal`` dataset: pictures drawn with Pillow and named by the engine's
own content hash, chats that carry their picture in every later turn's history, prompt logs
whose images key the perfect-cache estimate, and a short run against a real tiny LLaVA server
on 127.0.0.1 (``tests/vlm_helpers.py``) whose later turns come from the cache."""

from __future__ import annotations

import base64
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from server_helpers import ServerProcess

from prefixserve.cli import main
from prefixserve.core import MultiModalInput
from prefixserve.model.text.tokenizer import load_tokenizer
from prefixserve.model.vision.image import decode_image
from prefixserve.tools.bench.datasets import (
    IMAGE_PLACEHOLDER_ID,
    IMAGE_TOKENS,
    Conversation,
    WordVocabulary,
)
from prefixserve.tools.bench.multimodal import PICTURE_SIZES, multimodal, pictures
from prefixserve.tools.bench.predict import perfect_cache, write_prompt_log
from prefixserve.tools.bench.report import read_run
from prefixserve.tools.bench.runner import SentPrompt
from prefixserve.tools.trace_formats import ReadOptions, read_workload

BLOCK = 16


@pytest.fixture(scope="module")
def vocabulary() -> WordVocabulary:
    return WordVocabulary(load_tokenizer(None))


def decoded_hash(url: str) -> str:
    """The content hash the engine gives the picture of a ``data:`` URL."""
    head, data = url.split(",", 1)
    assert head == "data:image/png;base64"
    return decode_image(base64.b64decode(data)).content_hash


def test_pictures_differ_and_carry_the_engines_hash() -> None:
    drawn = pictures(5, seed=2)
    assert [(p.width, p.height) for p in drawn] == [*PICTURE_SIZES, PICTURE_SIZES[0]]
    assert len({p.content_hash for p in drawn}) == 5
    assert all(decoded_hash(p.url) == p.content_hash for p in drawn)
    assert [p.content_hash for p in pictures(5, seed=2)] == [p.content_hash for p in drawn]
    assert pictures(1, seed=3)[0].content_hash != drawn[0].content_hash


def test_bad_sizes_are_refused(vocabulary: WordVocabulary) -> None:
    sizes = {"num_images": 2, "num_conversations": 2, "num_turns": 2, "system_prompt_len": 0,
             "question_len": 4, "output_len": 2, "seed": 0}
    for name, value in (("num_images", 0), ("num_turns", 0), ("system_prompt_len", -1)):
        with pytest.raises(ValueError, match=name.replace("_", "-")):
            multimodal(vocabulary, **{**sizes, name: value})
    assert main(["bench", "--dataset", "multimodal", "--num-prompts", "3"]) == 2


def walk(conversation: Conversation, rng: np.random.Generator, vocabulary: WordVocabulary,
         reply_len: int) -> list[SentPrompt]:
    """Every turn's prompt, answered with random words; the prompts as the runner keeps them."""
    sent = []
    while not conversation.done:
        ids, _, _ = conversation.next_prompt()
        reply = vocabulary.sample(rng, reply_len)
        sent.append(SentPrompt(0.0, ids, reply, tuple(conversation.mm_inputs)))
        conversation.add_reply(reply, vocabulary.text(reply))
    return sent


def test_each_chat_shows_its_picture_once_and_keeps_it(vocabulary: WordVocabulary) -> None:
    system, question = 32, 16
    dataset = multimodal(vocabulary, num_images=2, num_conversations=3, num_turns=3,
                         system_prompt_len=system, question_len=question, output_len=5, seed=4)
    assert dataset.endpoint == "chat" and dataset.num_requests == 9
    hashes = dataset.params["image_hashes"]
    rng = np.random.default_rng(0)
    for index, session in enumerate(dataset.sessions):
        conversation = Conversation(session, vocabulary)
        sent = walk(conversation, rng, vocabulary, 5)
        picture = MultiModalInput(system, IMAGE_TOKENS, hashes[index % 2])
        for before, after in itertools.pairwise(sent):
            assert after.ids[: len(before.ids) + 5] == before.ids + before.reply_ids
        assert all(p.mm_inputs == (picture,) for p in sent)  # the history keeps the picture
        assert sent[0].ids[system: system + IMAGE_TOKENS] == [IMAGE_PLACEHOLDER_ID] * IMAGE_TOKENS
        messages = conversation.messages
        assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "user"] * 2
        image_part, text_part = messages[1]["content"]
        assert decoded_hash(image_part["image_url"]["url"]) == hashes[index % 2]
        assert text_part["type"] == "text" and isinstance(messages[3]["content"], str)


def test_the_prompt_log_keys_blocks_by_picture(vocabulary: WordVocabulary,
                                               tmp_path: Path) -> None:
    """The three first turns (pictures 0, 1, 0 after a 32-token system prompt, 196 image
    tokens, 16-token questions; 244 tokens): the second hits the system prompt only (32), the
    third the system prompt and every full block of picture 0 (14 blocks, 224). A log that
    dropped the pictures' hashes would give the second turn 224 too."""
    dataset = multimodal(vocabulary, num_images=2, num_conversations=3, num_turns=1,
                         system_prompt_len=32, question_len=16, output_len=1, seed=5)
    rng = np.random.default_rng(1)
    sent = [p for s in dataset.sessions for p in walk(Conversation(s, vocabulary), rng,
                                                        vocabulary, 1)]
    estimate = perfect_cache(sent, BLOCK)
    assert estimate is not None
    assert (estimate["hit_tokens"], estimate["query_tokens"]) == (32 + 224, 3 * 244)
    write_prompt_log(sent, str(tmp_path / "log.jsonl"))
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [line["mm_inputs"] for line in lines] == [
        [{"offset": 32, "length": IMAGE_TOKENS, "hash": h}]
        for h in (dataset.params["image_hashes"] * 2)[:3]]
    workload = read_workload(str(tmp_path / "log.jsonl"), ReadOptions(block_size=BLOCK))
    assert len(workload.requests) == 3


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from vlm_helpers import write_tiny_llava

    path = tmp_path_factory.mktemp("vlm")
    write_tiny_llava(path, "clip")
    process = ServerProcess([str(path), "--dtype", "float32", "--block-size", str(BLOCK),
                             "--num-blocks", "256", "--log-stats-interval", "0"],
                            tmp_path_factory.mktemp("vlm-logs") / "server.log").start()
    yield process
    process.stop()
    assert "Traceback" not in process.log, process.log


@pytest.mark.slow
def test_later_turns_about_a_picture_come_from_the_cache(vlm_server: ServerProcess,
                                                         tmp_path: Path) -> None:
    """Three chats of three turns about two pictures, one request at a time: every request
    succeeds; every later turn finds at least the full blocks of the turn before it cached;
    the third chat (the first's picture) finds more than the second (another picture); the
    encoder runs once a picture; the prompt log carries the pictures' hashes."""
    out, log = tmp_path / "run.json", tmp_path / "prompts.jsonl"
    assert main(["bench", "--base-url", vlm_server.url + "/v1", "--no-progress", "--json",
                 str(out), "--save-prompts", str(log), "--dataset", "multimodal",
                 "--num-images", "2", "--num-conversations", "3", "--num-turns", "3",
                 "--question-len", "8", "--output-len", "4", "--max-concurrency", "1"]) == 0
    run = read_run(str(out))
    assert (run["summary"]["completed"], run["summary"]["errors"]) == (9, 0)
    records = sorted(run["records"], key=lambda r: (r["session"], r["turn"]))
    by_session = [records[i: i + 3] for i in range(0, 9, 3)]
    for turns in by_session:
        for before, after in itertools.pairwise(turns):
            assert after["cached_tokens"] >= before["prompt_tokens"] // BLOCK * BLOCK > 0
    # the first turns: the third chat finds picture 0's blocks, the second only the text
    # before its own picture
    assert by_session[2][0]["cached_tokens"] > by_session[1][0]["cached_tokens"]
    metrics = run["server_metrics"]
    runs = [v for k, v in metrics.items() if k.endswith("mm_encoder_runs_total")]
    assert runs == [2]
    hashes = run["dataset"]["params"]["image_hashes"]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 9
    assert {m["hash"] for line in lines for m in line["mm_inputs"]} == set(hashes)
