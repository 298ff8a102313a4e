"""Tokenizer of the default model (SmolLM2 GGUF) vs HF transformers, chat template, detokenizer.

Reference: transformers' own tokenizer for the same GGUF file. transformers does not know the
GGUF pre-tokenizer name ``smollm`` and falls back to plain GPT-2 splitting, while SmolLM2's
published ``tokenizer.json`` (and llama.cpp's ``smollm`` pre-tokenizer) first put every digit on
its own. The two only differ on a run of spaces before a digit (``"  1"``), so text with digits
is compared with transformers' vocabulary under SmolLM2's published pre-tokenizer instead.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_cache import cached_reference
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from prefixserve.model.arch.config import default_model_path
from prefixserve.model.text.chat_template import ChatTemplateError
from prefixserve.model.text.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello world",
    "héllo wörld, naïve café",
    "你好，世界！这是一个测试。",
    "emoji 😀👍🏽 done 🇫🇷",
    "don't I'll WE'RE they've",
    "  leading and trailing  \n\n\ttabs\r\nCRLF",
    "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "text<|im_end|>glued<jupyter_code>x",
    "",
    " ",
]
DIGIT_TEXTS = ["  12345 678.9", "1+1=2, 3.14159, 2024-11-30", "x  9\n  10", "١٢٣ ²³"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Merci 😀"},
    ],
]


@functools.cache
def ours() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    path = default_model_path()
    return cached_reference(  # converted once per machine: tests/reference_cache.py
        "smollm2-tokenizer", path,
        lambda: AutoTokenizer.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path)),
        AutoTokenizer.from_pretrained)


@pytest.fixture(scope="module")
def published(hf) -> BackendTokenizer:
    """transformers' vocabulary with SmolLM2's published pre-tokenizer (Digits, ByteLevel)."""
    backend = BackendTokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


def test_metadata(hf) -> None:
    tok = ours()
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.convert_ids_to_tokens([0, 1, 2, 28]) == hf.convert_ids_to_tokens([0, 1, 2, 28])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(hf, text: str) -> None:
    tok = ours()
    ids = tok.encode(text)
    assert ids == hf(text)["input_ids"]
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_digits_split_like_smollm2(published: BackendTokenizer, text: str) -> None:
    tok = ours()
    ids = tok.encode(text)
    assert ids == published.encode(text).ids
    assert tok.decode(ids) == text
    digit_ids = {tok.encode(d)[0] for d in "0123456789"}
    assert tok.encode("  12") == [*tok.encode("  "), *(tok.encode(d)[0] for d in "12")]
    assert digit_ids.isdisjoint(tok.encode("ab"))


def test_hf_directory_matches_transformers(hf, tmp_path: Path) -> None:
    """A directory written by transformers (tokenizer.json, config, chat_template.jinja)."""
    hf.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id == 1
    for text in TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"]
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages, tokenize=False) == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )


def test_no_bos_added() -> None:
    tok = ours()
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi")[0] != tok.bos_token_id


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(hf, messages, add_generation_prompt: bool) -> None:
    tok = ours()
    text = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ids == (want["input_ids"] if hasattr(want, "keys") else want)


def with_template(template: str) -> Tokenizer:
    tok = ours()
    return Tokenizer(
        tok.backend, bos_token_id=1, eos_token_ids=tok.eos_token_ids, chat_template=template
    )


def test_chat_template_features() -> None:
    tok = with_template(
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "é<"}], tokenize=False) == (
        '<|im_start|>{"role": "user", "content": "é<"}'
    )
    with pytest.raises(ChatTemplateError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)


def test_chat_template_is_sandboxed() -> None:
    tok = with_template("{% set _ = messages.append(1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([], tokenize=False)


@functools.cache
def broken_byte_ids() -> list[int]:
    """Ids whose text alone is not valid UTF-8 (parts of multi-byte characters)."""
    tok = ours()
    return [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]


def token_ids() -> st.SearchStrategy[int]:
    tok = ours()
    return st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.integers(0, 16),
        st.sampled_from(broken_byte_ids()),
    )


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(token_ids(), max_size=8),
    chunks=st.lists(st.lists(token_ids(), min_size=1, max_size=3), max_size=12),
    skip=st.booleans(),
)
def test_incremental_detokenizer(prompt: list[int], chunks: list[list[int]], skip: bool) -> None:
    tok = ours()
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces = []
    for chunk in chunks:
        piece = detok.add(chunk)
        assert not piece.endswith("\ufffd")
        pieces.append(piece)
    pieces.append(detok.flush())
    outputs = [i for chunk in chunks for i in chunk]
    assert "".join(pieces) == tok.decode(outputs, skip_special_tokens=skip)


def test_detokenizer_holds_back_partial_characters() -> None:
    tok = ours()
    ids = tok.encode("a😀")
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    pieces = [detok.add([i]) for i in ids]
    assert pieces[0] == "a"
    assert pieces[-1] == "😀"
    assert all(p == "" for p in pieces[1:-1])
    assert detok.flush() == ""


def test_tokenizer_imports_without_torch() -> None:
    """The tokenizer (and the GGUF reader it opens the file with) loads and runs in a process
    that can import neither torch nor numpy."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['numpy'] = None\n"
        "import prefixserve.model as pm\n"
        "from prefixserve.model.text.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer()\n"
        "assert tok.encode('Hello world') == [19556, 905]\n"
        "assert pm.load_tokenizer is load_tokenizer\n"
        "assert sys.modules['torch'] is None\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
