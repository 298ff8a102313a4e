"""Sampling parameters through a real server and the real ``openai`` client, each checked against
what it specifies on the model's own distribution.

The server reports raw logprobs (before penalties, masks, temperature and filters; see
``prefixserve/model/sampler.py``) of the sampled token and of the 20 most likely tokens at every
position. Each filter names a set of allowed tokens in terms of that distribution (at
temperature 1 the tempered distribution is the raw one), so every sampled token can be checked;
a seeded batch at a high temperature makes an ignored filter show at once. Penalties shift the
logits of tokens already generated, so the greedy choice under a penalty is the argmax of the
penalised raw logprobs, which the test recomputes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import openai
import pytest
from server_helpers import ServerProcess

PROMPT = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    # float32: the logprobs reported and the logits sampled from agree to float precision
    process = ServerProcess(["--dtype", "float32", "--num-blocks", "256",
                             "--max-model-len", "512", "--served-model-name", "smol"],
                            tmp_path_factory.mktemp("sampling") / "server.log").start()
    yield openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0,
                        timeout=120)
    assert process.stop() == 0, process.log


def positions(client: openai.OpenAI, n: int = 4, max_tokens: int = 24, **kwargs: object
              ) -> list[tuple[float, dict[str, float]]]:
    """(sampled token's logprob, top-20 logprobs) at every generated position of n choices."""
    extra = {k: kwargs.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "min_tokens")
             if k in kwargs}
    response = client.completions.create(model="smol", prompt=PROMPT, n=n,
                                         max_tokens=max_tokens, logprobs=20, seed=1234,
                                         extra_body=extra, **kwargs)  # type: ignore[arg-type]
    out = []
    for choice in response.choices:
        logprobs = choice.logprobs
        out += list(zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True))
    return out


@pytest.fixture(scope="module")
def unfiltered(client: openai.OpenAI) -> dict[float, list[tuple[float, dict[str, float]]]]:
    """Seeded batches without any filter, by temperature: each test's proof that its check has
    teeth (an ignored filter would draw like these)."""
    return {t: positions(client, temperature=t) for t in (1.0, 2.0)}


def test_top_k_draws_only_from_the_k_most_likely(
        client: openai.OpenAI, unfiltered: dict[float, list[tuple[float, dict[str, float]]]]
) -> None:
    for k in (1, 3):
        for logprob, top in positions(client, temperature=2.0, top_k=k):
            kth = sorted(top.values(), reverse=True)[k - 1]
            assert logprob >= kth - 1e-4, f"top_k={k} drew a token outside the top {k}"
    # the check has teeth: at this temperature an unfiltered draw leaves the top 3 at once
    assert any(lp < sorted(top.values(), reverse=True)[2] - 1e-4 for lp, top in unfiltered[2.0])


def _mass_above(logprob: float, top: dict[str, float]) -> float:
    return sum(math.exp(v) for v in top.values() if v > logprob + 1e-5)


def test_top_p_draws_only_from_the_nucleus(
        client: openai.OpenAI, unfiltered: dict[float, list[tuple[float, dict[str, float]]]]
) -> None:
    """A token is in the nucleus of p when the tokens more likely than it hold less than p."""
    for logprob, top in positions(client, temperature=1.0, top_p=0.3):
        assert _mass_above(logprob, top) < 0.3 + 1e-4
    assert any(_mass_above(lp, top) >= 0.3 for lp, top in unfiltered[1.0])


def test_min_p_draws_only_tokens_at_least_min_p_times_the_most_likely(
        client: openai.OpenAI, unfiltered: dict[float, list[tuple[float, dict[str, float]]]]
) -> None:
    for logprob, top in positions(client, temperature=1.0, min_p=0.2):
        assert logprob >= max(top.values()) + math.log(0.2) - 1e-4
    assert any(lp < max(top.values()) + math.log(0.2) for lp, top in unfiltered[1.0])


def _greedy(client: openai.OpenAI, **kwargs: object) -> list[tuple[str, dict[str, float]]]:
    extra = {k: kwargs.pop(k) for k in ("repetition_penalty",) if k in kwargs}
    response = client.completions.create(model="smol", prompt=PROMPT, max_tokens=40,
                                         temperature=0, logprobs=20, extra_body=extra,
                                         **kwargs)  # type: ignore[arg-type]
    logprobs = response.choices[0].logprobs
    return list(zip(logprobs.tokens, logprobs.top_logprobs, strict=True))


@pytest.fixture(scope="module")
def plain(client: openai.OpenAI) -> list[str]:
    """The greedy tokens without any penalty (shared by the penalty tests)."""
    return [token for token, _ in _greedy(client)]


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.7), (0.8, 0.4)])
def test_presence_and_frequency_penalties_shift_the_generated_tokens_logits(
        client: openai.OpenAI, plain: list[str], presence: float, frequency: float) -> None:
    """Greedy under the penalties picks, at each step, the argmax of raw logprob minus
    ``presence`` for every token already generated and ``frequency`` times its count."""
    steps = _greedy(client, presence_penalty=presence, frequency_penalty=frequency)
    counts: Counter[str] = Counter()
    checked = 0
    for token, top in steps:
        scores = {t: lp - (presence if counts[t] else 0.0) - frequency * counts[t]
                  for t, lp in top.items()}
        best = max(scores, key=scores.__getitem__)
        # a token outside the top 20 can only win if the best penalised score is below them
        if scores[best] >= min(top.values()):
            assert scores[token] >= scores[best] - 1e-3, f"{token!r} is not the argmax"
            checked += 1
        counts[token] += 1
    assert checked >= len(steps) // 2
    assert [token for token, _ in steps] != plain  # the penalty changed the text


def test_repetition_penalty_moves_greedy_off_repeated_tokens(client: openai.OpenAI,
                                                            plain: list[str]) -> None:
    """A repetition penalty lowers the logits of every token already in the prompt or the
    output, so the greedy text repeats fewer of its own tokens than without it."""
    def repeats(tokens: list[str]) -> int:
        return len(tokens) - len(set(tokens))

    penalised = [t for t, _ in _greedy(client, repetition_penalty=1.8)]
    assert repeats(penalised) < repeats(plain)


def test_min_tokens_masks_the_end_of_sequence_until_reached(client: openai.OpenAI) -> None:
    """A chat answer that ends early on its own: with min_tokens=N the end-of-sequence token is
    masked at the sampler (not sampled and skipped later) for the first N tokens. At the step
    where the plain greedy answer ended, the raw distribution (logprobs are reported before the
    mask) still ranks EOS first, and the held answer takes the best token other than it."""
    messages = [{"role": "user", "content": "Reply with the single word: yes"}]

    def chat(**extra: object) -> tuple[str, list[tuple[str, dict[str, float]]], int]:
        response = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=64, temperature=0, logprobs=True,
            top_logprobs=5, extra_body=extra)  # type: ignore[arg-type]
        choice = response.choices[0]
        steps = [(c.token, {t.token: t.logprob for t in c.top_logprobs})
                 for c in choice.logprobs.content]
        return choice.finish_reason, steps, response.usage.completion_tokens

    finish, short, used = chat()
    assert finish == "stop" and used == len(short)
    eos, eos_top = short[-1]
    assert max(eos_top, key=eos_top.__getitem__) == eos  # greedy ended on the model's EOS
    n = len(short) + 6
    finish, held, used = chat(min_tokens=n)
    assert used == len(held) >= n and finish in ("stop", "length")
    assert [token for token, _ in held[:len(short) - 1]] == [t for t, _ in short[:-1]]
    assert eos not in [token for token, _ in held[:n]], "EOS sampled before min_tokens"
    token, top = held[len(short) - 1]
    # the same raw distribution as the plain run (up to float noise: the prefix is a cache hit)
    assert top == pytest.approx(eos_top, abs=1e-2)
    assert token == max((t for t in top if t != eos), key=top.__getitem__)
