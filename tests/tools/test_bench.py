"""``prefixserve bench``: dataset generators (sharing exactly as specified, checked against a
perfect cache simulated here), metrics on synthetic timings, trace-to-token consistency, the
report files, and short end-to-end runs against a real ``prefixserve serve`` process."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from server_helpers import ServerProcess

from prefixserve.cli import main
from prefixserve.model.text.tokenizer import load_tokenizer
from prefixserve.tools.bench.client import metrics_url, parse_event, parse_prometheus
from prefixserve.tools.bench.datasets import (
    Conversation,
    Dataset,
    Session,
    Turn,
    WordVocabulary,
    multi_turn,
    random_prompts,
    shared_prefix,
)
from prefixserve.tools.bench.metrics import RequestRecord, summarize
from prefixserve.tools.bench.predict import perfect_cache
from prefixserve.tools.bench.report import (
    build_table,
    plot_ttft_cdf,
    print_runs,
    read_run,
    write_run,
)
from prefixserve.tools.bench.runner import SentPrompt, session_starts
from prefixserve.tools.bench.trace import trace_dataset

BLOCK = 16
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


@pytest.fixture(scope="module")
def vocabulary() -> WordVocabulary:
    return WordVocabulary(load_tokenizer(None))


def perfect_hits(prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]] | None = None,
                 block: int = BLOCK) -> tuple[int, int]:
    """(tokens a perfect cache serves, prompt tokens), simulated here: full blocks are keyed by
    the whole prefix up to their end; a prompt hits its leading cached blocks, at most
    ``(len - 1) // block`` of them; its full blocks, and those its reply fills (all reply
    tokens but the last are computed), are cached after it."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for index, prompt in enumerate(prompts):
        prompt = list(prompt)
        n = 0
        while n < (len(prompt) - 1) // block and tuple(prompt[: (n + 1) * block]) in seen:
            n += 1
        hit += n * block
        total += len(prompt)
        computed = prompt + (list(replies[index])[:-1] if replies else [])
        seen.update(tuple(computed[: (k + 1) * block]) for k in range(len(computed) // block))
    return hit, total


def prompts_of(dataset: Dataset) -> list[list[int]]:
    return [session.turns[0].tokens for session in dataset.sessions]


# ----------------------------------------------------------------------------- datasets


def test_word_prompts_round_trip_through_text(vocabulary: WordVocabulary) -> None:
    tokenizer = vocabulary.tokenizer
    rng = np.random.default_rng(1)
    for _ in range(20):
        ids = vocabulary.sample(rng, 300)
        assert tokenizer.encode(vocabulary.text(ids), add_special_tokens=False) == ids


@pytest.mark.parametrize("shuffle", [True, False])
def test_shared_prefix_shares_exactly_the_system_prompt(vocabulary: WordVocabulary,
                                                        shuffle: bool) -> None:
    groups, per_group, system, question = 3, 5, 100, 20
    dataset = shared_prefix(vocabulary, num_groups=groups, prompts_per_group=per_group,
                            system_prompt_len=system, question_len=question, output_len=7,
                            shuffle=shuffle, seed=3)
    prompts = prompts_of(dataset)
    assert len(prompts) == groups * per_group
    assert all(len(p) == system + question for p in prompts)
    assert all(s.turns[0].output_len == 7 for s in dataset.sessions)
    by_group: dict[int, list[list[int]]] = {}
    for session in dataset.sessions:
        by_group.setdefault(session.group, []).append(session.turns[0].tokens)
    assert sorted(by_group) == list(range(groups))
    heads = {g: members[0][:system] for g, members in by_group.items()}
    assert len({p[0] for p in heads.values()}) == groups  # groups differ from token 0 on
    for group, members in by_group.items():
        assert all(m[:system] == heads[group] for m in members)
        assert len({m[system] for m in members}) == per_group  # questions differ at once
    order = [s.group for s in dataset.sessions]
    assert (order == sorted(order)) is not shuffle
    hit, total = perfect_hits(prompts)
    expected = groups * (per_group - 1) * (system // BLOCK * BLOCK)
    assert (hit, total) == (expected, groups * per_group * (system + question))
    estimate = perfect_cache([SentPrompt(0.0, p, []) for p in prompts])
    assert estimate is not None
    assert (estimate["hit_tokens"], estimate["query_tokens"]) == (hit, total)
    again = shared_prefix(vocabulary, num_groups=groups, prompts_per_group=per_group,
                          system_prompt_len=system, question_len=question, output_len=7,
                          shuffle=shuffle, seed=3)
    assert prompts_of(again) == prompts


def test_multi_turn_prompts_are_history_plus_message(vocabulary: WordVocabulary) -> None:
    conversations, turns, system, question, output = 3, 4, 40, 12, 9
    dataset = multi_turn(vocabulary, num_conversations=conversations, num_turns=turns,
                         system_prompt_len=system, question_len=question, output_len=output,
                         seed=5)
    assert [len(s.turns) for s in dataset.sessions] == [turns] * conversations
    rng = np.random.default_rng(0)
    prompts: list[list[int]] = []
    replies: list[list[int]] = []
    firsts = set()
    for session in dataset.sessions:
        conversation = Conversation(session, vocabulary)
        previous: list[int] = []
        for turn in range(turns):
            ids, text, output_len = conversation.next_prompt()
            assert output_len == output
            assert len(ids) == system + (turn + 1) * question + turn * output
            assert ids[: len(previous)] == previous  # the history is kept whole
            assert vocabulary.tokenizer.encode(text, add_special_tokens=False) == ids
            reply = vocabulary.sample(rng, output)
            prompts.append(list(ids))
            replies.append(reply)
            if turn:
                assert ids[len(previous) - output: len(previous)] == replies[-2]
            conversation.add_reply(reply, vocabulary.text(reply))
            previous = list(ids) + reply
        assert conversation.done
        firsts.add(prompts[-turns][system])
    assert len(firsts) == conversations
    assert len({tuple(p[:system]) for p in prompts}) == 1  # one system prompt for all
    hit, total = perfect_hits(prompts, replies)
    # Turn 0 of later conversations hits the system prompt's full blocks; turn k > 0 hits every
    # full block of the previous prompt and of its computed reply (all but its last token).
    expected = (conversations - 1) * (system // BLOCK * BLOCK)
    for turn in range(1, turns):
        previous_len = system + turn * question + (turn - 1) * output
        length = previous_len + output + question
        expected += conversations * min((previous_len + output - 1) // BLOCK,
                                        (length - 1) // BLOCK) * BLOCK
    assert hit == expected
    estimate = perfect_cache([SentPrompt(float(i), p, r)
                              for i, (p, r) in enumerate(zip(prompts, replies, strict=True))])
    assert estimate is not None
    assert (estimate["hit_tokens"], estimate["query_tokens"]) == (hit, total)


def test_random_prompts_share_nothing(vocabulary: WordVocabulary) -> None:
    dataset = random_prompts(vocabulary, num_prompts=40, input_len=50, output_len=3, seed=2)
    prompts = prompts_of(dataset)
    assert len(prompts) == 40 and all(len(p) == 50 for p in prompts)
    assert len({p[0] for p in prompts}) == 40
    assert perfect_hits(prompts) == (0, 40 * 50)


@pytest.mark.parametrize("options", [
    {"num_groups": 0, "prompts_per_group": 1, "system_prompt_len": 1, "question_len": 1},
    {"num_groups": 1, "prompts_per_group": 1, "system_prompt_len": -1, "question_len": 1},
    {"num_groups": 1, "prompts_per_group": 1, "system_prompt_len": 1, "question_len": 0},
])
def test_shared_prefix_rejects_bad_sizes(vocabulary: WordVocabulary,
                                         options: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must"):
        shared_prefix(vocabulary, output_len=1, shuffle=False, seed=0, **options)


# ----------------------------------------------------------------------------- trace


def write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_trace_ids_become_consistent_token_blocks(vocabulary: WordVocabulary,
                                                  tmp_path: Path) -> None:
    # Blocks of 64 trace tokens, scale 4: 16 tokens a block. Ids are chained, as in Mooncake.
    records = [
        {"timestamp": 1000, "input_length": 192, "output_length": 40, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 170, "output_length": 8, "hash_ids": [0, 1, 3]},
        {"timestamp": 2000, "input_length": 100, "output_length": 1, "hash_ids": [0, 4]},
        {"timestamp": 4000, "input_length": 192, "output_length": 40, "hash_ids": [0, 1, 2]},
        {"timestamp": 4000, "input_length": 170, "output_length": 8, "hash_ids": [0, 1, 3]},
    ]
    path = write_trace(tmp_path / "trace.jsonl", records)
    dataset = trace_dataset(vocabulary, path=str(path), num_prompts=None, scale=4,
                            trace_block_size=64, time_scale=0.5, compress=False,
                            trace_format=None, seed=7)
    prompts = prompts_of(dataset)
    assert [len(p) for p in prompts] == [48, 42, 25, 48, 42]  # round(input / 4)
    assert [s.turns[0].output_len for s in dataset.sessions] == [10, 2, 1, 10, 2]
    assert [s.arrival for s in dataset.sessions] == [0.0, 0.25, 0.5, 1.5, 1.5]
    blocks: dict[int, list[int]] = {}
    for record, prompt in zip(records, prompts, strict=True):
        full = record["input_length"] // 64
        for position, block_id in enumerate(record["hash_ids"][:full]):
            tokens = prompt[position * 16: (position + 1) * 16]
            assert blocks.setdefault(block_id, tokens) == tokens  # equal ids, equal blocks
    distinct = {tuple(tokens) for tokens in blocks.values()}
    assert len(distinct) == len(blocks)  # different ids, different blocks
    assert prompts[3] == prompts[0] and prompts[4] == prompts[1]  # same blocks, same tail
    assert prompts[1][32:] != prompts[4][:10]
    compressed = trace_dataset(vocabulary, path=str(path), num_prompts=2, scale=4,
                               trace_block_size=64, time_scale=1.0, compress=True,
                               trace_format=None, seed=7)
    assert prompts_of(compressed) == prompts[:2]
    assert [s.arrival for s in compressed.sessions] == [None, None]
    with pytest.raises(ValueError, match="scale"):
        trace_dataset(vocabulary, path=str(path), num_prompts=None, scale=3,
                      trace_block_size=64, time_scale=1.0, compress=False, trace_format=None,
                      seed=7)


@pytest.mark.skipif(not (TRACES / "mooncake_conversation_trace.jsonl").exists(),
                    reason="the shared Mooncake trace is not here")
def test_real_trace_blocks_match_hash_ids(vocabulary: WordVocabulary) -> None:
    path = TRACES / "mooncake_conversation_trace.jsonl"
    with open(path) as trace:
        records = [json.loads(line) for line, _ in zip(trace, range(60), strict=False)]
    dataset = trace_dataset(vocabulary, path=str(path), num_prompts=60, scale=16,
                            trace_block_size=512, time_scale=1.0, compress=False,
                            trace_format="mooncake", seed=0)
    by_id: dict[int, tuple[int, ...]] = {}
    for record, prompt in zip(records, prompts_of(dataset), strict=True):
        assert len(prompt) == round(record["input_length"] / 16)
        for position, block_id in enumerate(record["hash_ids"][: record["input_length"] // 512]):
            tokens = tuple(prompt[position * 32: (position + 1) * 32])
            assert by_id.setdefault(block_id, tokens) == tokens
    assert len(set(by_id.values())) == len(by_id)
    sampled = trace_dataset(vocabulary, path=str(path), num_prompts=50, scale=16,
                            trace_block_size=512, time_scale=0.01, compress=False,
                            trace_format=None, seed=0, sample="conversations")
    assert 0 < len(sampled.sessions) <= 50
    arrivals = [s.arrival for s in sampled.sessions]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)


# ----------------------------------------------------------------------------- metrics


def record(start: float, ttft: float | None, e2e: float | None, tokens: int,
           **fields: object) -> RequestRecord:
    itl = [] if ttft is None or e2e is None or tokens < 2 else [
        (e2e - ttft) / (tokens - 1)] * (tokens - 1)
    return RequestRecord(session=0, turn=0, group=0, start=start, prompt_len=100,
                         output_len=tokens, ttft=ttft, e2e=e2e, itl=itl, token_events=tokens,
                         **fields)


def test_summary_of_synthetic_timings() -> None:
    records = [
        record(0.0, 0.1, 1.1, 11, prompt_tokens=100, completion_tokens=11, cached_tokens=50),
        record(0.5, 0.3, 2.3, 5, prompt_tokens=100, completion_tokens=5, cached_tokens=0),
        record(1.0, 0.2, 0.2, 1, prompt_tokens=100, completion_tokens=1, cached_tokens=100),
        record(1.5, None, None, 0, error="HTTP 400: bad"),
    ]
    summary = summarize(records)
    assert (summary["requests"], summary["completed"], summary["errors"]) == (4, 3, 1)
    assert summary["error_examples"] == ["HTTP 400: bad"]
    assert summary["short_outputs"] == 0
    assert summary["duration_s"] == pytest.approx(2.8)  # 0.0 .. 0.5 + 2.3
    assert summary["request_throughput"] == pytest.approx(3 / 2.8)
    assert summary["output_tokens"] == 17
    assert summary["output_throughput"] == pytest.approx(17 / 2.8)
    assert summary["total_token_throughput"] == pytest.approx(317 / 2.8)
    assert summary["cached_share"] == pytest.approx(150 / 300)
    ttft = summary["ttft_ms"]
    assert ttft["count"] == 3 and ttft["mean"] == pytest.approx(200.0)
    assert ttft["p50"] == pytest.approx(200.0)
    assert ttft["p90"] == pytest.approx(280.0)  # linear between 200 and 300
    assert ttft["p99"] == pytest.approx(298.0)
    tpot = summary["tpot_ms"]  # (1.1 - 0.1) / 10 and (2.3 - 0.3) / 4; one token: none
    assert tpot["count"] == 2 and tpot["mean"] == pytest.approx(300.0)
    itl = summary["itl_ms"]
    assert itl["count"] == 14 and itl["mean"] == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert summary["e2e_ms"]["p50"] == pytest.approx(1100.0)


def test_summary_without_usage_or_success() -> None:
    summary = summarize([record(0.0, 0.1, 0.5, 3)])
    assert summary["short_outputs"] == 0
    short = record(0.0, 0.1, 0.5, 3)
    short.output_len = 5
    assert summarize([short])["short_outputs"] == 1
    assert summary["cached_share"] is None and summary["cached_tokens"] is None
    assert summary["output_tokens"] == 3  # token events when the server reports no usage
    failed = summarize([record(0.0, None, None, 0, error="down")])
    assert failed["completed"] == 0 and failed["request_throughput"] is None
    assert failed["ttft_ms"] == {"count": 0, "mean": None, "p50": None, "p90": None,
                                 "p99": None}


def test_poisson_and_trace_arrivals() -> None:
    sessions = [Session([Turn([1], 1)]) for _ in range(4000)]
    starts = session_starts(sessions, 20.0, seed=4)
    gaps = np.diff([0.0, *starts])
    assert (gaps > 0).all() and gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert starts == session_starts(sessions, 20.0, seed=4)
    assert session_starts(sessions[:3], math.inf, seed=4) == [0.0, 0.0, 0.0]
    timed = [Session([Turn([1], 1)], arrival=2.5), Session([Turn([1], 1)])]
    assert session_starts(timed, math.inf, seed=0) == [2.5, 0.0]


def test_event_and_prometheus_parsing() -> None:
    assert parse_event("data: [DONE]") == "[DONE]"
    assert parse_event('data: {"choices": []}') == {"choices": []}
    assert parse_event(": keep-alive") is None and parse_event("") is None
    with pytest.raises(ValueError):
        parse_event("data: [1, 2]")
    text = ("# HELP x_total x\n# TYPE x_total counter\nx_total 12.0\n"
            'y_bucket{le="0.1",model_name="m"} 3\nprefixserve:prefix_cache_hits_total 7\n'
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 5\n')
    assert parse_prometheus(text) == {"x_total": 12.0, "prefixserve:prefix_cache_hits_total": 7,
                                      "vllm:prompt_tokens_total": 5}
    assert metrics_url("http://h:1/v1/") == "http://h:1/metrics"


# ----------------------------------------------------------------------------- report


def document(label: str, ttfts: list[float]) -> dict:
    records = [record(float(i), t, t + 1.0, 4, prompt_tokens=100, completion_tokens=4,
                      cached_tokens=25) for i, t in enumerate(ttfts)]
    return {"format": "prefixserve-bench/1", "label": label, "base_url": "http://x/v1",
            "dataset": {"name": "random", "params": {}},
            "load": {"request_rate": None, "max_concurrency": 2, "prompt_type": "token-ids"},
            "summary": summarize(records), "perfect_cache": {"token_hit_rate": 0.5},
            "server_metrics": {"prefixserve:prefix_cache_queries_total": 8.0,
                               "prefixserve:prefix_cache_hits_total": 2.0},
            "records": [r.to_json() for r in records]}


def test_report_files_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = document("fast", [0.1, 0.2, 0.3]), document("slow", [0.2, 0.4, 0.6])
    write_run(a, str(tmp_path / "a.json"))
    write_run(b, str(tmp_path / "b.json"))
    assert read_run(str(tmp_path / "a.json"))["summary"] == a["summary"]
    assert build_table([a, b]).row_count > 20
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                 "--plot", str(tmp_path / "cdf.png")]) == 0
    out = capsys.readouterr().out
    assert "fast" in out and "slow" in out and "(2.00x)" in out and "25.0%" in out
    assert (tmp_path / "cdf.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "other.json").write_text("{}")
    assert main(["bench", "compare", str(tmp_path / "other.json")]) == 2
    plot_ttft_cdf([a], str(tmp_path / "one.png"))
    assert (tmp_path / "one.png").exists()


def test_load_line_names_the_arrival_process(capsys: pytest.CaptureFixture[str]) -> None:
    limited = document("limited", [0.1])
    replayed = document("replayed", [0.1])
    replayed["dataset"] = {"name": "trace", "params": {"time_scale": 0.1,
                                                       "compress_arrivals": False}}
    replayed["load"]["max_concurrency"] = None
    compressed = document("compressed", [0.1])
    compressed["dataset"] = {"name": "trace", "params": {"time_scale": 0.1,
                                                         "compress_arrivals": True}}
    print_runs([limited, replayed, compressed], Console(width=400))
    out = capsys.readouterr().out
    assert out.count("rate inf, max 2 in flight") == 2
    assert "arrivals at the trace's times x0.1, no limit" in out


def test_bench_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--dataset", "shared-prefix", "--num-prompts", "3"]) == 2
    assert "--num-prompts does not apply" in capsys.readouterr().err
    assert main(["bench"]) == 2
    assert main(["bench", "--dataset", "trace"]) == 2
    assert "--trace-path" in capsys.readouterr().err
    assert main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--dataset", "random",
                 "--num-prompts", "2", "--no-progress"]) == 2
    assert "failed a first request" in capsys.readouterr().err


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(["--num-blocks", "512", "--max-model-len", "1024",
                             "--max-num-seqs", "4", "--log-stats-interval", "0"],
                            tmp_path_factory.mktemp("bench-server") / "server.log").start()
    yield process
    process.stop()


def bench(server: ServerProcess, out: Path, *options: str) -> dict:
    assert main(["bench", "--base-url", server.url + "/v1", "--no-progress", "--json", str(out),
                 *options]) == 0
    return read_run(str(out))


@pytest.mark.slow
def test_end_to_end_shared_prefix_and_multi_turn(server: ServerProcess, tmp_path: Path) -> None:
    run = bench(server, tmp_path / "shared.json", "--dataset", "shared-prefix", "--num-groups",
                "2", "--prompts-per-group", "3", "--system-prompt-len", "64", "--question-len",
                "8", "--output-len", "4", "--max-concurrency", "1", "--cache-salt", "e2e-1",
                "--plot", str(tmp_path / "shared.png"))
    summary = run["summary"]
    assert (summary["completed"], summary["errors"]) == (6, 0)
    assert run["load"]["prompt_type"] == "token-ids"
    records = run["records"]
    assert all(r["prompt_tokens"] == r["prompt_len"] == 72 for r in records)
    assert all(r["completion_tokens"] == 4 and r["ttft"] <= r["e2e"] for r in records)
    # One request at a time: the server serves exactly what a perfect cache would.
    assert summary["cached_tokens"] == 2 * 2 * 64
    assert summary["cached_share"] == pytest.approx(run["perfect_cache"]["token_hit_rate"])
    metrics = run["server_metrics"]
    assert metrics["prefixserve:prefix_cache_hits_total"] == summary["cached_tokens"]
    assert (tmp_path / "shared.png").exists()

    chat = bench(server, tmp_path / "chat.json", "--dataset", "multi-turn",
                 "--num-conversations", "2", "--num-turns", "3", "--question-len", "8",
                 "--output-len", "4", "--max-concurrency", "2", "--prompt-type", "text",
                 "--cache-salt", "e2e-2")
    assert (chat["summary"]["completed"], chat["summary"]["errors"]) == (6, 0)
    turns = sorted((r["session"], r["turn"], r["prompt_tokens"]) for r in chat["records"])
    assert [t[1] for t in turns] == [0, 1, 2, 0, 1, 2]
    for first, second in itertools.pairwise(turns):
        if first[0] == second[0]:
            assert second[2] > first[2] + 8  # the history grew by the reply and a message
    assert chat["load"]["prompt_type"] == "text"
