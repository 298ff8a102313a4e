"""Does the prefix cache, the batch or the chunking change a token? Runs the same greedy
prompts each way and lists the prompts whose tokens differ.

The promise of the deterministic mode (``--deterministic``, ``LLM(deterministic=True)``): a
request's output depends only on its own tokens, sampling parameters and seed. The checks,
each against the prompt run alone with a fresh cache salt (nothing cached, no other request,
the whole prompt in one step):

* ``batch``: the prompt in one ``generate`` call with ``batch_size - 1`` others;
* ``cache``: the prompt again after the same prompt ran, most of it read from the prefix cache;
* ``chunked``: the prompt on a second engine whose step budget (``max_num_batched_tokens``)
  cuts prompts into chunks;
* ``server`` (:func:`server_checks`): a server's completions sent one at a time vs all at once.

``benchmarks/determinism_report.py`` runs them with and without the mode;
``tests/engine/test_deterministic.py`` asserts them in the mode.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from prefixserve import LLM, SamplingParams

SYSTEMS = (
    "You are a careful assistant. Answer in plain words, briefly, and say when you are not "
    "sure of a fact.",
    "You are a travel guide who knows the history of every town in Europe and tells it like a "
    "story to children.",
    "Act as a senior engineer reviewing a colleague's design: point at the weakest part first "
    "and suggest one fix.",
    "You are a chef. Every answer names the ingredients first, then the steps, with times and "
    "temperatures.",
    "You translate everything into simple English for people learning the language, and you "
    "explain one hard word per answer.",
)
QUESTIONS = (
    "Why is the sky blue in the day and red in the evening?",
    "How do I keep bread fresh for a week without a freezer?",
    "What happened in the year 1066, and why does it still matter?",
    "Explain how a hash table finds a key, step by step.",
    "Write a short poem about a lighthouse keeper and his cat.",
    "What should I pack for three days of walking in the mountains in autumn?",
    "List three ways to make a slow program faster, from the cheapest to the dearest.",
    "Tell me a story about a robot who wants to learn to paint.",
    "How does a bicycle stay upright when it moves?",
    "What is the difference between weather and climate?",
)


def varied_prompts(count: int) -> list[str]:
    """``count`` prompts (50 different ones, then repeats): each question under each system
    text, so that prompts have different lengths and share prefixes (some cache blocks)."""
    pairs = [(s, q) for q in QUESTIONS for s in SYSTEMS]
    return [f"{system}\n\nQuestion: {question}\nAnswer:"
            for system, question in itertools.islice(itertools.cycle(pairs), count)]


@dataclass
class CheckResult:
    """One check: which prompts (indices) gave other tokens than alone, out of how many."""

    name: str
    total: int
    differing: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    """Prompt tokens read from the prefix cache in the check's runs (the ``cache`` check)."""


class _Salts:
    """A new cache salt per call: a run that can reuse nothing from the prefix cache."""

    def __init__(self) -> None:
        self.count = itertools.count()

    def __call__(self) -> str:
        return f"determinism-check-{next(self.count)}"


def _tokens(llm: LLM, prompts: Sequence[str], params: SamplingParams, salt: str | None
            ) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(list(prompts), params, salt)]


def offline_checks(llm: LLM, prompts: Sequence[str], max_tokens: int, batch_size: int = 17,
                   chunked: LLM | None = None) -> list[CheckResult]:
    """The ``batch``, ``cache`` and (with ``chunked``, an engine of the same model with a small
    step budget) ``chunked`` checks of the module docstring for greedy ``prompts``, each
    generating ``max_tokens`` tokens (``ignore_eos``)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    salt = _Salts()
    alone = [_tokens(llm, [p], params, salt())[0] for p in prompts]
    batch = CheckResult("batch", len(prompts))
    others = itertools.cycle(range(len(prompts)))
    for first in range(0, len(prompts), batch_size):
        members = list(range(first, min(first + batch_size, len(prompts))))
        fillers = [next(others) for _ in range(batch_size - len(members))]
        got = _tokens(llm, [prompts[i] for i in members + fillers], params, salt())
        batch.differing += [i for i, tokens in zip(members, got, strict=False)
                            if tokens != alone[i]]
    cache = CheckResult("cache", len(prompts))
    for i, prompt in enumerate(prompts):
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))
        out = llm.generate(prompt, params)[0]
        cache.cached_tokens += out.num_cached_tokens
        if list(out.outputs[0].token_ids) != alone[i]:
            cache.differing.append(i)
    results = [batch, cache]
    if chunked is not None:
        results.append(CheckResult("chunked", len(prompts), [
            i for i, p in enumerate(prompts) if _tokens(chunked, [p], params, salt())[0] != alone[i]
        ]))
    return results


def _complete(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    response = client.post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


def server_checks(url: str, model: str, prompts: Sequence[str], max_tokens: int,
                  concurrency: int = 16) -> CheckResult:
    """The ``server`` check: each prompt's greedy completion from the server at ``url``, sent
    one at a time, then all at once (``concurrency`` in flight): the prompts whose text
    differs."""
    with httpx.Client() as client:
        sequential = [_complete(client, url, model, p, max_tokens) for p in prompts]
        with ThreadPoolExecutor(concurrency) as pool:
            concurrent = list(pool.map(lambda p: _complete(client, url, model, p, max_tokens),
                                       prompts))
    differing = [i for i, (a, b) in enumerate(zip(sequential, concurrent, strict=True)) if a != b]
    return CheckResult("server", len(prompts), differing)
