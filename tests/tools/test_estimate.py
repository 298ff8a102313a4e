"""``prefixserve estimate``: hand-computed hit counts for every input format and replay rule.

Each test writes a small workload to ``tmp_path`` and checks the figures against counts worked
out by hand in its comments (block size 4 unless said otherwise: ``[1..4]`` is one block).
"""

from __future__ import annotations

import gzip
import json
import lzma
import random
import subprocess
import sys
from pathlib import Path

import pytest

from prefixserve.cli import build_parser
from prefixserve.tools.estimate.replay import (
    CacheResult,
    Estimate,
    ReplaySettings,
    default_capacities,
    estimate,
    model_kv_bytes_per_token,
    parse_sizes,
    replay_infinite,
    replay_pool,
)
from prefixserve.tools.trace_formats import (
    ReadOptions,
    TraceError,
    TraceRequest,
    Workload,
    detect_format,
    read_workload,
)

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO.parent / "shared" / "traces"


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_estimate(path: Path, *options: str) -> Estimate:
    args = build_parser().parse_args(
        ["estimate", str(path), "--jobs", "1", "--no-progress", *options])
    return estimate(args)


def by_capacity(result: Estimate) -> dict[int | None, CacheResult]:
    return {r.capacity_blocks: r for r in result.results}


def tokens(first: int, last: int) -> list[int]:
    """Token ids ``first..last`` inclusive."""
    return list(range(first, last + 1))


# ---------------------------------------------------------------- token ids


def test_worked_example_of_the_design(tmp_path: Path) -> None:
    # 16-token shared prefix + a 4-token question, four times: 48 of 80 tokens from the cache.
    prefix = tokens(100, 115)
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"token_ids": prefix + tokens(200 + 4 * i, 203 + 4 * i)} for i in range(4)])
    results = by_capacity(run_estimate(path, "--block-size", "4", "--capacity", "4,5"))
    for capacity in (5, None):
        r = results[capacity]
        assert (r.hit_tokens, r.query_tokens, r.hit_blocks, r.query_blocks) == (48, 80, 12, 20)
        assert r.requests_with_hit == 3
        assert r.token_hit_rate == pytest.approx(0.6)
        assert r.speedup_bound == pytest.approx(2.5)
    # A 20-token prompt needs 5 blocks: a 4-block pool can run none of them.
    assert (results[4].hit_tokens, results[4].requests_too_large) == (0, 4)


LRU_WORKLOAD = [  # 9 tokens each: two full blocks and a partial one
    ("A", tokens(1, 9)), ("B", tokens(20, 28)), ("A", tokens(1, 9)),
    ("C", tokens(30, 38)), ("A", tokens(1, 9)), ("B", tokens(20, 28)),
]


def test_lru_eviction_through_the_pool(tmp_path: Path) -> None:
    # Pool of 6 blocks: A takes 3, B 3; A again hits 8 tokens (its partial block is new);
    # C then evicts B's blocks (the least recently freed) and A's old partial; A hits 8 again;
    # B misses. With 9 blocks nothing useful is evicted and B hits too, as in the infinite cache.
    path = write_jsonl(tmp_path / "lru.jsonl", [{"token_ids": t} for _, t in LRU_WORKLOAD])
    results = by_capacity(run_estimate(path, "--block-size", "4", "--capacity", "6,9"))
    six = results[6]
    assert (six.hit_tokens, six.hit_blocks, six.query_blocks, six.query_tokens) == (16, 4, 12, 54)
    assert six.requests_with_hit == 2
    assert results[9].hit_tokens == results[None].hit_tokens == 24


@pytest.mark.parametrize(("tier_blocks", "tier_tokens"), [(6, 8), (4, 0)])
def test_a_second_tier_gives_what_the_pool_evicted(tmp_path: Path, tier_blocks: int,
                                                   tier_tokens: int) -> None:
    # The LRU workload in a pool of 6 with a tier below it (issue 15): the last B misses in the
    # pool; a tier of 6 blocks still holds B's two full blocks (8 tokens), a tier of 4 has
    # evicted them for C's (the tier is LRU too: A's re-use moved A's blocks past B's).
    path = write_jsonl(tmp_path / "lru.jsonl", [{"token_ids": t} for _, t in LRU_WORKLOAD])
    result = run_estimate(path, "--block-size", "4", "--capacity", "6", "--tier-capacity",
                          str(tier_blocks))
    six = by_capacity(result)[6]
    assert six.hit_tokens == 16  # the pool's own hits do not change
    assert (six.tier_hit_tokens, six.tier_hit_blocks) == (tier_tokens, tier_tokens // 4)


def test_warmup_window_counts_only_later_requests(tmp_path: Path) -> None:
    # Warm-up 0.5 of 6 requests: only C, A, B count. Pool of 6: A hits 8; infinite: A and B.
    path = write_jsonl(tmp_path / "lru.jsonl", [{"token_ids": t} for _, t in LRU_WORKLOAD])
    result = run_estimate(path, "--block-size", "4", "--capacity", "6",
                          "--warmup-fraction", "0.5")
    results = by_capacity(result)
    assert result.settings.warmup_requests == 3
    assert (results[6].requests, results[6].hit_tokens, results[6].query_tokens) == (3, 8, 27)
    assert results[None].hit_tokens == 16
    assert results[6].replayed_blocks == 12  # the warm-up is replayed, just not counted


def test_cache_salt_and_lora_separate_requests(tmp_path: Path) -> None:
    prompt = tokens(1, 9)
    records = [
        {"token_ids": prompt, "cache_salt": "a"},
        {"token_ids": prompt, "cache_salt": "b"},  # other salt: 0
        {"token_ids": prompt, "cache_salt": "a"},  # 8
        {"token_ids": prompt},                     # no salt: 0
        {"token_ids": prompt},                     # 8
        {"token_ids": prompt, "lora_id": 1},       # LoRA: 0
        {"token_ids": prompt, "lora_id": 1},       # 8
    ]
    path = write_jsonl(tmp_path / "salt.jsonl", records)
    infinite = by_capacity(run_estimate(path, "--block-size", "4", "--capacity", "100"))[None]
    assert (infinite.hit_tokens, infinite.requests_with_hit) == (24, 3)


def test_known_outputs_are_decoded_and_cached(tmp_path: Path) -> None:
    # Output [9..13]: the last output token is never fed back, so tokens 1..12 are computed and
    # three blocks cached; the follow-up [1..16] hits them (12 tokens). With a 4-token output
    # [109..112] only 11 tokens are computed: two blocks, so the follow-up hits 8.
    path = write_jsonl(tmp_path / "out.jsonl", [
        {"token_ids": tokens(1, 8), "output_token_ids": tokens(9, 13)},
        {"token_ids": tokens(1, 16)},
        {"token_ids": tokens(101, 108), "output_token_ids": tokens(109, 112)},
        {"token_ids": tokens(101, 112) + [120, 121, 122]},
    ])
    results = by_capacity(run_estimate(path, "--block-size", "4", "--capacity", "100"))
    assert results[100].hit_tokens == results[None].hit_tokens == 12 + 8


def test_concurrency_delays_the_caching_of_outputs(tmp_path: Path) -> None:
    # With two resident requests, the first is still running (its output not decoded) when its
    # follow-up arrives: the follow-up hits the prompt's 2 blocks only.
    path = write_jsonl(tmp_path / "out.jsonl", [
        {"token_ids": tokens(1, 8), "output_token_ids": tokens(9, 13)},
        {"token_ids": tokens(1, 16)},
    ])
    one = by_capacity(run_estimate(path, "--block-size", "4", "--capacity", "100"))
    two = by_capacity(run_estimate(path, "--block-size", "4", "--capacity", "100",
                                   "--concurrency", "2"))
    assert one[100].hit_tokens == one[None].hit_tokens == 12
    assert two[100].hit_tokens == two[None].hit_tokens == 8


def random_workload(seed: int, block_size: int = 4, outputs: bool = False) -> Workload:
    """Prompts drawn from a few shared prefixes, chain-hashed like the token reader does."""
    from prefixserve.tools.trace_formats import _TokenHasher

    rng = random.Random(seed)
    hasher = _TokenHasher(block_size)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    requests: list[TraceRequest] = []
    for _ in range(120):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(50) for _ in range(rng.randrange(6))] if outputs else []
        requests.append(hasher.request(prompt, output, None, None))
    return Workload("random", "tokens", block_size, requests)


@pytest.mark.parametrize("seed", range(4))
def test_concurrency_without_outputs_changes_nothing(seed: int) -> None:
    # Requests leave in arrival order, so the resident ones are exactly the most recently used:
    # LRU would have kept them anyway, and every pool gives the sequential figures.
    workload = random_workload(seed)
    for capacity in (12, 30, 80):
        sequential = replay_pool(workload, capacity, ReplaySettings(concurrency=1))
        parallel = replay_pool(workload, capacity, ReplaySettings(concurrency=4))
        assert (parallel.hit_tokens, parallel.hit_blocks) == (
            sequential.hit_tokens, sequential.hit_blocks)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("concurrency", [1, 3])
def test_infinite_cache_equals_a_pool_that_never_evicts(seed: int, concurrency: int) -> None:
    workload = random_workload(seed, outputs=True)
    settings = ReplaySettings(concurrency=concurrency)
    huge = replay_pool(workload, 100_000, settings)
    infinite = replay_infinite(workload, settings)
    assert (huge.hit_tokens, huge.hit_blocks, huge.query_blocks, huge.requests_with_hit) == (
        infinite.hit_tokens, infinite.hit_blocks, infinite.query_blocks,
        infinite.requests_with_hit)
    assert huge.rolling == infinite.rolling


def test_gzip_input_reads_like_plain(tmp_path: Path) -> None:
    records = [{"token_ids": t} for _, t in LRU_WORKLOAD]
    plain = write_jsonl(tmp_path / "a.jsonl", records)
    packed = tmp_path / "a.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert by_capacity(run_estimate(packed, "--block-size", "4", "--capacity", "6"))[
        6].hit_tokens == 16


# ---------------------------------------------------------------- images


def image(offset: int, length: int, content_hash: str) -> dict:
    return {"offset": offset, "length": length, "hash": content_hash}


#: 13 tokens (3 full blocks of 4): text 1..4, an image's 6 placeholder tokens (id 0) at 4..9
#: (blocks 1 and 2), text 11..13.
PICTURED = tokens(1, 4) + [0] * 6 + tokens(11, 13)


def test_images_key_every_block_their_run_overlaps(tmp_path: Path) -> None:
    # The same picture at the same place hits all 3 blocks; another picture with the same
    # placeholder tokens hits block 0 (before its run) and misses from block 1, where its run
    # starts; the same tokens without an image hit block 0 only. Ignoring the hashes would give
    # 12 + 12 + 12.
    path = write_jsonl(tmp_path / "mm.jsonl", [
        {"token_ids": PICTURED, "mm_inputs": [image(4, 6, "red")]},
        {"token_ids": PICTURED, "mm_inputs": [image(4, 6, "red")]},   # 12
        {"token_ids": PICTURED, "mm_inputs": [image(4, 6, "blue")]},  # 4
        {"token_ids": PICTURED},                                      # 4
    ])
    result = run_estimate(path, "--block-size", "4", "--capacity", "100")
    infinite = by_capacity(result)[None]
    assert (infinite.hit_tokens, infinite.hit_blocks, infinite.requests_with_hit) == (20, 5, 3)
    red, _, blue, plain = (result.workload.block_keys(r) for r in result.workload.requests)
    assert red[0] == blue[0] == plain[0] and len({red[1], blue[1], plain[1]}) == 3


def test_a_request_without_images_is_unchanged(tmp_path: Path) -> None:
    # No field, an empty list, and the tokens read before images existed give the same ids;
    # an image from block 1 on changes blocks 1 and 2 and leaves block 0 as it was.
    from prefixserve.tools.trace_formats import _TokenHasher

    path = write_jsonl(tmp_path / "plain.jsonl", [
        {"token_ids": PICTURED}, {"token_ids": PICTURED, "mm_inputs": []},
        {"token_ids": PICTURED, "mm_inputs": [image(4, 6, "red")]}])
    workload = read_workload(str(path), ReadOptions(block_size=4))
    before = list(_TokenHasher(4).request(PICTURED, [], None, None).ids)
    bare, empty, pictured = (list(r.ids) for r in workload.requests)
    assert bare == empty == before
    assert pictured[0] == before[0]
    assert all(a != b for a, b in zip(pictured[1:], before[1:], strict=True))


def test_images_hit_as_in_the_cores_own_manager(tmp_path: Path) -> None:
    """A small trace of prompts with images, some shared, some moved, replayed by the estimate
    and run through the core's ``KVCacheManager`` as the engine's scheduler drives it (look
    up, allocate, free): the same hit counts, request by request."""
    from core_helpers import run_once

    from prefixserve.core import CacheRequest, KVCacheManager, MultiModalInput

    rng = random.Random(7)
    records = []
    for _ in range(40):
        text = [rng.randrange(1, 4) for _ in range(rng.randrange(0, 9))]
        runs, prompt = [], list(text)
        for _ in range(rng.randrange(0, 3)):
            runs.append(image(len(prompt), rng.choice([3, 6]), rng.choice("abc")))
            prompt += [0] * runs[-1]["length"] + [rng.randrange(1, 4)]
        records.append({"token_ids": prompt + [9], "mm_inputs": runs})
    path = write_jsonl(tmp_path / "mm.jsonl", records)
    workload = read_workload(str(path), ReadOptions(block_size=4))
    replayed = replay_infinite(workload, ReplaySettings())
    manager = KVCacheManager(4096, 4)
    core_hits = [run_once(manager, CacheRequest(
        f"r{i}", r["token_ids"], mm_inputs=[MultiModalInput(m["offset"], m["length"], m["hash"])
                                            for m in r["mm_inputs"]]))
        for i, r in enumerate(records)]
    assert replayed.hit_tokens == sum(core_hits) > 0
    assert replayed.requests_with_hit == sum(h > 0 for h in core_hits)


# ---------------------------------------------------------------- text and chat


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory whose tokenizer maps each space-separated word to one id and whose chat
    template writes ``<role> content </s>`` per message, then ``<assistant>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("word_tokenizer")
    vocab = {"[UNK]": 0, "</s>": 1, "<user>": 2, "<assistant>": 3}
    vocab.update({f"w{i}": 10 + i for i in range(100)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
                "{% if add_generation_prompt %}<assistant> {% endif %}")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "chat_template": template}))
    (folder / "config.json").write_text("{}")
    return folder


def words(first: int, last: int) -> str:
    return " ".join(f"w{i}" for i in range(first, last + 1))


def test_text_prompts_and_responses(tmp_path: Path, word_tokenizer: Path) -> None:
    # "w1..w9" twice: 8 tokens hit. "w21..w28" answered "w29..w32" (+ </s>): tokens 21..32 are
    # computed, three blocks; the follow-up "w21..w35" (15 tokens) hits 12.
    path = write_jsonl(tmp_path / "text.jsonl", [
        {"prompt": words(1, 9)},
        {"prompt": words(1, 9)},
        {"prompt": words(21, 28), "response": words(29, 32)},
        {"prompt": words(21, 35)},
    ])
    result = run_estimate(path, "--block-size", "4", "--capacity", "50",
                          "--tokenizer", str(word_tokenizer))
    assert result.workload.format == "text"
    assert [r.num_prompt_tokens for r in result.workload.requests] == [9, 9, 8, 15]
    assert by_capacity(result)[None].hit_tokens == 8 + 12


def test_chat_messages_use_the_chat_template(tmp_path: Path, word_tokenizer: Path) -> None:
    # Turn 1 renders "<user> w1 w2 w3 </s> <assistant>" (6 tokens); the answer "w4 w5 w6 </s>"
    # is decoded up to w6: 9 tokens, two full blocks. Turn 2 renders 14 tokens that start with
    # those 9: it hits 2 blocks (block 3 would hold w6 </s> <user> w7, never computed).
    turn1 = [{"role": "user", "content": "w1 w2 w3"}]
    turn2 = [*turn1, {"role": "assistant", "content": "w4 w5 w6"},
             {"role": "user", "content": "w7"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": turn1, "response": {"role": "assistant", "content": "w4 w5 w6"}},
        {"messages": turn2},
    ])
    result = run_estimate(path, "--block-size", "4", "--capacity", "50",
                          "--tokenizer", str(word_tokenizer))
    assert result.workload.format == "chat"
    assert [r.num_prompt_tokens for r in result.workload.requests] == [6, 14]
    assert result.workload.requests[0].num_decoded_tokens == 3
    # the output's length (the closed-loop model's decode work): w4 w5 w6 </s>; none known
    assert [r.num_output_tokens for r in result.workload.requests] == [4, 0]
    results = by_capacity(result)
    assert results[50].hit_tokens == results[None].hit_tokens == 8


# ---------------------------------------------------------------- block-hash traces


MOONCAKE_SMALL = [
    {"hash_ids": [1, 2, 3], "input_length": 20},
    {"hash_ids": [1, 2], "input_length": 13},
    {"hash_ids": [1, 2], "input_length": 16},
    {"hash_ids": [1, 2, 3], "input_length": 17},
]


def test_mooncake_expanded_to_smaller_blocks(tmp_path: Path) -> None:
    # Trace blocks of 8 at block size 4: id i -> sub-blocks (i,0), (i,1). Request 2 (13 tokens)
    # has 3 full blocks and hits all 3; request 3 (16 tokens) fills 4 blocks but looks up only 3
    # (one token must be computed); request 4 (17 tokens) hits 4 of its 4 full blocks.
    path = write_jsonl(tmp_path / "m.jsonl", MOONCAKE_SMALL)
    result = run_estimate(path, "--block-size", "4", "--trace-block-size", "8",
                          "--capacity", "100")
    assert result.workload.expansion == 2
    infinite = by_capacity(result)[None]
    assert (infinite.hit_tokens, infinite.hit_blocks, infinite.query_blocks) == (40, 10, 16)


def test_mooncake_at_its_own_block_size(tmp_path: Path) -> None:
    # Block size 8: full blocks 2, 1, 2, 2; hits 0, 1, 1, 2 (the partial last block never).
    path = write_jsonl(tmp_path / "m.jsonl", MOONCAKE_SMALL)
    result = run_estimate(path, "--block-size", "8", "--trace-block-size", "8",
                          "--capacity", "100")
    assert result.workload.expansion == 1
    infinite = by_capacity(result)[None]
    assert (infinite.hit_tokens, infinite.query_blocks) == (32, 7)


def test_mooncake_merged_to_larger_blocks(tmp_path: Path) -> None:
    # Block size 16 over trace blocks of 8: a block is named by the chained id of its second
    # trace block. Full blocks 1, 0, 1, 1; only request 4 (17 tokens) may look its block up.
    path = write_jsonl(tmp_path / "m.jsonl", MOONCAKE_SMALL)
    infinite = by_capacity(run_estimate(path, "--block-size", "16", "--trace-block-size", "8",
                                        "--capacity", "100"))[None]
    assert (infinite.hit_tokens, infinite.query_blocks) == (16, 3)


def test_mooncake_default_block_size_is_512(tmp_path: Path) -> None:
    # 1000 tokens over two 512-token ids: 62 full 16-token blocks (32 + 30), all hit the 2nd time.
    path = write_jsonl(tmp_path / "m.jsonl", [{"hash_ids": [5, 6], "input_length": 1000}] * 2)
    result = run_estimate(path, "--capacity", "100")
    assert result.workload.trace_block_size == 512
    assert by_capacity(result)[None].hit_tokens == 62 * 16


BAILIAN = [  # 16-token blocks hashed on their own content
    {"chat_id": 1, "parent_chat_id": -1, "turn": 1, "hash_ids": [1, 8, 9, 50],
     "input_length": 49},
    {"chat_id": 2, "parent_chat_id": -1, "turn": 1, "hash_ids": [7, 60], "input_length": 17},
    {"chat_id": 3, "parent_chat_id": -1, "turn": 1, "hash_ids": [7, 8, 9, 70],
     "input_length": 49},
]


def test_bailian_ids_are_chained_here(tmp_path: Path) -> None:
    # Request 3 shares block 0 (id 7) with request 2 and blocks 1-2 (ids 8, 9) with request 1,
    # whose history differs: chained, only block 0 hits; taken as they are, all three would.
    path = write_jsonl(tmp_path / "b.jsonl", BAILIAN)
    chained = run_estimate(path, "--capacity", "100")
    assert (chained.workload.format, chained.workload.chained_here) == ("bailian", True)
    assert by_capacity(chained)[None].hit_tokens == 16
    unchained = run_estimate(path, "--capacity", "100", "--no-chain")
    assert by_capacity(unchained)[None].hit_tokens == 48


def write_sessions(path: Path, sessions: list[dict]) -> Path:
    path.write_bytes(lzma.compress("".join(json.dumps(s) + "\n" for s in sessions).encode()))
    return path


SESSIONS = [
    {"id": "s1", "block_size": 64, "requests": [
        {"in": 130, "out": 5, "hash_ids": [1, 2]},
        {"in": 200, "out": 5, "hash_ids": [1, 2, 3]},
        {"type": "subagent", "requests": [{"in": 64, "out": 1, "hash_ids": [10]}]},
        {"in": 260, "out": 5, "hash_ids": [1, 2, 3, 4]},
    ]},
    {"id": "s2", "block_size": 64, "requests": [
        {"in": 130, "hash_ids": [1, 2]},
        {"in": 129, "hash_ids": [1, 2]},
    ]},
]


@pytest.mark.parametrize("block_size", [64, 16])
def test_kvcache_tester_sessions_are_namespaced(tmp_path: Path, block_size: int) -> None:
    # s1: 0, 128, 0 (the sub-agent's 64 tokens fill one block it may not look up), 192.
    # s2 reuses s1's local ids 1, 2 but shares nothing with it: 0, then 128.
    path = write_sessions(tmp_path / "s.jsonl.xz", SESSIONS)
    result = run_estimate(path, "--block-size", str(block_size), "--capacity", "1000")
    assert result.workload.format == "kvcache-tester"
    assert [r.num_prompt_tokens for r in result.workload.requests] == [130, 200, 64, 260, 130,
                                                                      129]
    assert [r.num_output_tokens for r in result.workload.requests] == [5, 5, 1, 5, 0, 0]
    infinite = by_capacity(result)[None]
    assert (infinite.hit_tokens, infinite.requests_with_hit) == (448, 3)
    assert by_capacity(result)[1000].hit_tokens == 448


def test_formats_are_detected_from_the_first_record() -> None:
    assert detect_format({"token_ids": [1]}) == "tokens"
    assert detect_format({"prompt": "hi"}) == "text"
    assert detect_format({"messages": []}) == "chat"
    assert detect_format({"hash_ids": [1], "input_length": 3}) == "mooncake"
    assert detect_format({"hash_ids": [1], "chat_id": 3}) == "bailian"
    assert detect_format({"id": "s", "requests": []}) == "kvcache-tester"
    assert detect_format({"something": 1}) is None


# ---------------------------------------------------------------- errors


def test_bad_line_stops_with_its_number_and_reason(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"token_ids": [1, 2, 3, 4, 5]}\nnot json\n'
                    '{"token_ids": [1, "x"]}\n{"token_ids": [1, 2]}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: not valid JSON"):
        read_workload(str(path), ReadOptions(block_size=4))
    workload = read_workload(str(path), ReadOptions(block_size=4, skip_bad_lines=True))
    assert (len(workload.requests), workload.bad_lines) == (2, 2)
    assert "bad.jsonl:3: token_ids[1] is 'x', not an integer" in workload.bad_line_examples[1]


@pytest.mark.parametrize(("record", "reason"), [
    ({"hash_ids": [1, 2, 3], "input_length": 512}, "at most ceil"),
    ({"hash_ids": [1], "input_length": 0}, "'input_length' must be at least 1"),
    ({"hash_ids": [-1], "input_length": 10}, "negative"),
    ({"hash_ids": [1]}, "missing 'input_length'"),
])
def test_bad_trace_records_are_explained(tmp_path: Path, record: dict, reason: str) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"hash_ids": [1], "input_length": 10}, record])
    with pytest.raises(TraceError, match=":2: .*" + reason):
        read_workload(str(path), ReadOptions())


@pytest.mark.parametrize(("mm_inputs", "reason"), [
    ([image(-1, 2, "a")], r"mm_inputs\[0\]: 'offset' must be at least 0, got -1"),
    ([image(0, 2, "a"), image(6, 4, "b")], r"mm_inputs\[1\] covers tokens 6\.\.9, past the end "
                                           r"of the prompt's 8 tokens"),
    ([image(0, 2, 5)], r"mm_inputs\[0\]: 'hash' must be a non-empty string, got 5"),
    ([image(0, 2, "")], r"'hash' must be a non-empty string"),
    ([image(0, 0, "a")], r"'length' must be at least 1"),
    ([{"offset": 1, "hash": "a"}], r"mm_inputs\[0\]: missing 'length'"),
    ([image(True, 2, "a")], r"'offset' must be an integer"),
    (["a"], r"mm_inputs\[0\] is 'a', not an object"),
    ({"offset": 0}, r"'mm_inputs' must be a list"),
    ([image(0, 4, "a"), image(2, 2, "b")],
     r"'mm_inputs' overlap: the run at token 2 starts inside the run at token 0"),
])
def test_bad_images_are_explained(tmp_path: Path, mm_inputs: object, reason: str) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"token_ids": tokens(1, 8), "mm_inputs": [image(0, 8, "fits")]},
        {"token_ids": tokens(1, 8), "mm_inputs": mm_inputs}])
    with pytest.raises(TraceError, match=r"t\.jsonl:2: (mm_inputs\[\d\]: )?" + reason):
        read_workload(str(path), ReadOptions(block_size=4))
    skipped = read_workload(str(path), ReadOptions(block_size=4, skip_bad_lines=True))
    assert (len(skipped.requests), skipped.bad_lines) == (1, 1)


def test_images_in_text_prompts_and_on_hash_traces(tmp_path: Path,
                                                   word_tokenizer: Path) -> None:
    # Text: offsets are in the tokenised prompt. "w1..w9" with an image at tokens 4..7 (block
    # 1): the same image hits both blocks, another one block 0. Offsets are checked against the
    # tokenised prompt (3 tokens here); a block-hash trace's ids already name its images, so
    # the field is refused there, in a session too.
    good = write_jsonl(tmp_path / "t.jsonl", [
        {"prompt": words(1, 9), "mm_inputs": [image(4, 4, h)]} for h in ("a", "a", "b")])
    result = run_estimate(good, "--block-size", "4", "--capacity", "50",
                          "--tokenizer", str(word_tokenizer))
    assert by_capacity(result)[None].hit_tokens == 8 + 4
    text = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "w1 w2 w3",
                                               "mm_inputs": [image(1, 3, "a")]}])
    with pytest.raises(TraceError, match=r"x\.jsonl:1: .*past the end of the prompt's 3 tok"):
        read_workload(str(text), ReadOptions(block_size=4, tokenizer=str(word_tokenizer)))
    moon = write_jsonl(tmp_path / "m.jsonl", [
        {"hash_ids": [1], "input_length": 10, "mm_inputs": [image(0, 2, "a")]}])
    with pytest.raises(TraceError, match=r"m\.jsonl:1: 'mm_inputs' needs a prompt of token ids"):
        read_workload(str(moon), ReadOptions())
    sessions = write_sessions(tmp_path / "s.jsonl.xz", [{"id": "s", "requests": [
        {"in": 64, "hash_ids": [1], "mm_inputs": [image(0, 2, "a")]}]}])
    with pytest.raises(TraceError, match=r":1: requests\[0\]: 'mm_inputs' needs a prompt"):
        read_workload(str(sessions), ReadOptions())


def test_bad_session_request_names_where_it_is(tmp_path: Path) -> None:
    sessions = [{"id": "s", "requests": [{"in": 64, "hash_ids": [1]},
                                         {"requests": [{"hash_ids": [2]}]}]}]
    path = write_sessions(tmp_path / "s.jsonl.xz", sessions)
    with pytest.raises(TraceError, match=r":1: requests\[1\]\.requests\[0\]: missing 'in'"):
        read_workload(str(path), ReadOptions())


def test_unusable_inputs(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open"):
        read_workload(str(tmp_path / "missing.jsonl"), ReadOptions())
    unknown = write_jsonl(tmp_path / "u.jsonl", [{"something": 1}])
    with pytest.raises(TraceError, match="cannot tell the format"):
        read_workload(str(unknown), ReadOptions())
    odd = write_jsonl(tmp_path / "m.jsonl", [{"hash_ids": [1], "input_length": 24}])
    with pytest.raises(TraceError, match="one must be a multiple of the other"):
        read_workload(str(odd), ReadOptions(block_size=16, trace_block_size=24))
    mismatch = write_jsonl(tmp_path / "t.jsonl", [{"token_ids": [1, 2]}])
    with pytest.raises(TraceError, match="no 'hash_ids' field"):
        read_workload(str(mismatch), ReadOptions(format="mooncake"))


# ---------------------------------------------------------------- sizes


def test_memory_sizes_become_blocks(tmp_path: Path) -> None:
    assert parse_sizes("4GiB,512MiB, 2GB,1024") == [4 * 2**30, 512 * 2**20, 2 * 10**9, 1024]
    with pytest.raises(ValueError, match="not a memory size"):
        parse_sizes("4 parsecs")
    path = write_jsonl(tmp_path / "m.jsonl", [{"hash_ids": [1], "input_length": 600}])
    # 128 KiB a token (Llama 3.1 8B in bf16) at 512-token blocks: 64 MiB a block, 16 per GiB.
    result = run_estimate(path, "--block-size", "512", "--kv-memory", "1GiB,2GiB",
                          "--kv-bytes-per-token", "131072")
    assert [r.capacity_blocks for r in result.finite] == [16, 32]
    with pytest.raises(ValueError, match="needs --kv-bytes-per-token"):
        run_estimate(path, "--kv-memory", "1GiB")


def test_kv_bytes_per_token_of_the_default_model() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; K and V in bf16 -> 30 * 2 * 3 * 64 * 2.
    try:
        assert model_kv_bytes_per_token(None, "bf16") == 23040
    except FileNotFoundError:
        pytest.skip("the default model is not installed")


def test_default_capacities_are_fractions_of_the_distinct_blocks() -> None:
    assert default_capacities(5_662_916) == [57_000, 280_000, 1_100_000, 2_800_000]
    assert default_capacities(3) == [1, 2]


# ---------------------------------------------------------------- command line


def test_cli_end_to_end(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "lru.jsonl", [{"token_ids": t} for _, t in LRU_WORKLOAD])
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    done = subprocess.run(
        [sys.executable, "-m", "prefixserve", "estimate", str(path), "--block-size", "4",
         "--capacity", "6,9", "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "infinite" in done.stdout and "hit rate" in done.stdout
    report = json.loads(out_json.read_text())
    assert set(report) == {"input", "settings", "caches", "timing"}
    assert report["input"]["requests"] == 6
    caches = {c["capacity_blocks"]: c for c in report["caches"]}
    assert set(caches) == {6, 9, None}
    assert set(caches[6]) >= {"block_hit_rate", "token_hit_rate", "prefill_tokens_saved",
                              "speedup_bound", "hit_request_share", "requests_too_large",
                              "rolling", "capacity_tokens"}
    assert caches[6]["prefill_tokens_saved"] == 16 and caches[None]["hit_tokens"] == 24
    assert set(report["timing"]) >= {"blocks_per_second", "peak_rss_mib", "replay_seconds"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reports_a_bad_line_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"token_ids": [1, 2, 3]}\n{"token_ids": []}\n')
    done = subprocess.run([sys.executable, "-m", "prefixserve", "estimate", str(path)],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 2
    assert "bad.jsonl:2: 'token_ids' is empty" in done.stderr


# ---------------------------------------------------------------- the real traces


@pytest.mark.skipif(not (TRACES / "mooncake_synthetic_trace.jsonl").exists(),
                    reason="the Mooncake traces are not here")
def test_mooncake_synthetic_agrees_with_kvcache_simulator() -> None:
    # Hit tokens of kvcache-simulator 0.1.3 (LRU, last 50% of requests) on this trace with each
    # request's partial last block given a fresh id, so that it never hits (as in the engine);
    # see benchmarks/compare_estimate.py. Same definitions: the counts agree exactly.
    result = run_estimate(TRACES / "mooncake_synthetic_trace.jsonl", "--block-size", "512",
                          "--capacity", "512,2048,8192,32768", "--warmup-fraction", "0.5")
    hit_tokens = {r.capacity_blocks: r.hit_tokens for r in result.results}
    assert hit_tokens == {512: 2_563_584, 2048: 8_326_656, 8192: 20_005_376,
                          32768: 30_843_904, None: 31_493_120}
    assert result.infinite.query_tokens == 36_552_394


@pytest.mark.skipif(not (TRACES / "mooncake_synthetic_trace.jsonl").exists(),
                    reason="the Mooncake traces are not here")
def test_mooncake_synthetic_cache_ratio_matches_the_paper() -> None:
    # Mooncake (FAST'25) Table 2: cache ratio 66% for the synthetic trace.
    path = str(TRACES / "mooncake_synthetic_trace.jsonl")
    infinite = replay_infinite(read_workload(path, ReadOptions()), ReplaySettings())
    assert infinite.token_hit_rate == pytest.approx(0.66, abs=0.015)
