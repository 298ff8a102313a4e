"""The per-step shortcuts of a decode step give exactly what the long way gives.

* ``Request.block_ids``, kept by the scheduler as blocks are allocated, always equals the KV
  cache manager's table (``get_block_ids``), through chunked prefill, cache hits, preemption
  and resumption;
* the runner's ``BlockTables`` (a tensor of block tables, updated with only what is new) give
  the same attention metadata as tables built from the lists at every step;
* the sampler's bare-argmax path and ``argmax_rows`` (numpy on CPU) pick what ``torch.argmax``
  and the general sampling path pick, ties and NaN included.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.core import KVCacheManager
from prefixserve.engine.request import Request, RequestStatus
from prefixserve.engine.scheduler import Scheduler
from prefixserve.model.attention import shared_prefix as shared_prefix_attention
from prefixserve.model.attention.paged import AttentionMetadata, TableRows, build_metadata
from prefixserve.model.runner import BlockTables, SeqBatchInput
from prefixserve.model.sampler import Sampler, argmax_rows
from prefixserve.sampling_params import SamplingParams

CPU = torch.device("cpu")


def assert_same_metadata(got: AttentionMetadata, want: AttentionMetadata) -> None:
    assert torch.equal(got.slot_mapping, want.slot_mapping)
    assert got.num_tokens == want.num_tokens
    assert (got.decode is None) == (want.decode is None)
    if got.decode is not None and want.decode is not None:
        g, w = got.decode, want.decode
        assert (g.rows is None) == (w.rows is None)
        assert g.rows is None or w.rows is None or torch.equal(g.rows, w.rows)
        assert torch.equal(g.block_tables, w.block_tables)
        assert g.num_keys == w.num_keys
        assert (g.mask is None) == (w.mask is None)
        assert g.mask is None or w.mask is None or torch.equal(g.mask, w.mask)
        assert (g.shared is None) == (w.shared is None)
    assert len(got.prefills) == len(want.prefills)
    for g_seq, w_seq in zip(got.prefills, want.prefills, strict=True):
        assert (g_seq.start, g_seq.end, g_seq.cached, g_seq.num_keys) == (
            w_seq.start, w_seq.end, w_seq.cached, w_seq.num_keys)
        if w_seq.block_table is not None:
            assert g_seq.block_table is not None
            assert torch.equal(g_seq.block_table, w_seq.block_table)


def check_step(scheduler: Scheduler, tables: BlockTables, block_size: int) -> int:
    """One scheduling step with a simulated model; checks the block ids and the metadata."""
    out = scheduler.schedule()
    manager = scheduler.kv_cache_manager
    for request in scheduler.running:
        assert request.block_ids == manager.get_block_ids(request)
    for request in scheduler.waiting:
        assert request.block_ids == []
    if not out.scheduled:
        return 0
    seqs = []
    for item in out.scheduled:
        request, start = item.request, item.request.num_computed_tokens
        seqs.append(SeqBatchInput(request.token_ids[start:start + item.num_new_tokens], start,
                                  request.block_ids, seq_id=request.request_id))
    needed = [(s.start_pos + len(s.token_ids) - 1) // block_size + 1 for s in seqs]
    rows = tables.update(seqs, needed)
    seq_lens = [(s.start_pos, len(s.token_ids)) for s in seqs]
    lists = [s.block_table for s in seqs]
    assert_same_metadata(
        build_metadata(seq_lens, lists, block_size, CPU, table_rows=TableRows(tables.buffer, rows)),
        build_metadata(seq_lens, lists, block_size, CPU))
    for item in out.scheduled:
        request = item.request
        request.num_computed_tokens += item.num_new_tokens
        if request.is_prefill_done:
            request.append_output_token(request.num_tokens % 3)
            if len(request.output_token_ids) >= (request.params.max_tokens or 0):
                scheduler.finish_request(request)
                assert request.block_ids == []
    return out.num_tokens


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(1, 24), caching=st.booleans(), seed=st.integers(0, 2**16))
def test_block_ids_and_table_rows_follow_the_manager(num_blocks: int, block_size: int,
                                                     budget: int, caching: bool,
                                                     seed: int) -> None:
    rng = random.Random(seed)
    scheduler = Scheduler(KVCacheManager(num_blocks, block_size, caching), 4, budget)
    tables = BlockTables(num_blocks, CPU, rows=2, width=2)  # small, so that it has to grow
    capacity = num_blocks * block_size
    shared = [rng.randrange(3) for _ in range(capacity)]
    for i in range(6):
        length = rng.randrange(1, capacity // 2 + 1)
        prompt = shared[:length] if i % 2 else [rng.randrange(3) for _ in range(length)]
        max_tokens = rng.randrange(1, capacity - length + 1)
        scheduler.add_request(Request(request_id=f"r{i}", token_ids=list(prompt),
                                      prompt_token_ids=prompt,
                                      params=SamplingParams(max_tokens=max_tokens)))
    for _ in range(20 * capacity):
        if not scheduler.has_unfinished_requests():
            break
        assert check_step(scheduler, tables, block_size) >= 1
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == num_blocks


def test_a_preempted_request_gets_a_new_list() -> None:
    scheduler = Scheduler(KVCacheManager(4, 2, False), 4, 16)
    first = Request(request_id="a", token_ids=[1, 2, 3], prompt_token_ids=[1, 2, 3])
    second = Request(request_id="b", token_ids=[4, 5, 6], prompt_token_ids=[4, 5, 6])
    scheduler.add_request(first)
    scheduler.add_request(second)
    scheduler.schedule()
    held = second.block_ids
    assert held and first.block_ids
    for request in (first, second):
        request.num_computed_tokens = request.num_tokens
        request.append_output_token(0)
        request.append_output_token(0)  # two tokens: each needs a third block
    scheduler.schedule()
    assert second.status is RequestStatus.PREEMPTED and second.block_ids == []
    assert held is not second.block_ids


def row_is(tables: BlockTables, row: int, blocks: list[int]) -> bool:
    """Whether the row holds ``blocks``, then zeros."""
    values = tables.buffer[row].tolist()
    return values == blocks + [0] * (len(values) - len(blocks))


def test_table_rows_start_again_on_a_new_list_and_free_absent_sequences() -> None:
    tables = BlockTables(64, CPU, rows=1, width=1)
    a, b = [3, 4, 5], [7]
    rows = tables.update([SeqBatchInput([0], 8, a, seq_id="a"), SeqBatchInput([0], 0, b,
                                                                             seq_id="b")], [3, 1])
    assert row_is(tables, rows[0], [3, 4, 5]) and row_is(tables, rows[1], [7])
    # "a" resumes on a new list; "b" is absent and its row is zeroed and freed.
    rows = tables.update([SeqBatchInput([0], 8, [9, 8, 7], seq_id="a")], [3])
    assert row_is(tables, rows[0], [9, 8, 7])
    assert tables.buffer.sum().item() == 24
    # The same list grown: only the new block is copied; shorter than before: copied again.
    table = [9, 8, 7]
    tables.update([SeqBatchInput([0], 8, table, seq_id="a")], [3])
    table.append(6)
    rows = tables.update([SeqBatchInput([0], 12, table, seq_id="a")], [4])
    assert row_is(tables, rows[0], [9, 8, 7, 6])
    rows = tables.update([SeqBatchInput([0], 1, table, seq_id="a")], [1])
    assert row_is(tables, rows[0], [9])
    with pytest.raises(ValueError, match="out of range"):
        tables.update([SeqBatchInput([0], 0, [64], seq_id="c")], [1])
    with pytest.raises(ValueError, match="unique"):
        tables.update([SeqBatchInput([0], 0, [1], seq_id="d")] * 2, [1, 1])


def test_a_lone_sequence_and_distinct_first_blocks_skip_the_sharing_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    tables = [list(range(10)), list(range(10))]
    monkeypatch.setattr(shared_prefix_attention, "MIN_SAVED_KEYS", 1)
    assert build_metadata([(150, 1), (159, 1)], tables, 16, CPU).decode.shared is not None
    distinct = [list(range(10)), [99, *range(1, 10)]]
    assert build_metadata([(150, 1), (159, 1)], distinct, 16, CPU).decode.shared is None
    assert build_metadata([(150, 1)], tables[:1], 16, CPU).decode.shared is None
    monkeypatch.setattr(shared_prefix_attention, "MIN_SAVED_KEYS", 0)
    assert build_metadata([(150, 1)], tables[:1], 16, CPU).decode.shared is not None


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_argmax_rows_is_torch_argmax(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 5000, generator=generator)
    logits[0, 17] = logits[0, 4000] = 1e4  # a tie: the first wins
    if rows > 1:
        logits[1, 2500] = logits[1, 100] = float("nan")  # NaN is the maximum, the first wins
        logits[-1] = float("-inf")
    for tensor in (logits, logits.t().contiguous().t(), logits.bfloat16()):
        assert argmax_rows(tensor) == tensor.argmax(dim=1).tolist()
    assert argmax_rows(logits[:, 10:]) == logits[:, 10:].argmax(dim=1).tolist()


def test_the_bare_argmax_path_equals_the_general_path() -> None:
    sampler = Sampler([0])
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    logits[:, 0] = 100.0  # EOS wins unless masked
    plain = SamplingParams(temperature=0)
    cases = [plain, SamplingParams(temperature=0, min_tokens=2),
             SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0, min_tokens=1)]
    outputs: list[list[int]] = [[], [5], [], [5]]
    got = sampler.sample(logits, cases, [None] * 4, [[1, 2]] * 4, outputs)
    want = sampler._sample(logits, cases, [None] * 4, [[1, 2]] * 4, outputs, {})
    assert got.token_ids == want.token_ids
    assert got.token_ids[0] == 0 and got.token_ids[1] != 0 and got.token_ids[3] == 0
    assert got.logprobs[0] is None and got.logprobs[2] is not None
    alone = sampler.sample(logits[:1], [plain], [None], [[1, 2]], [[]])
    assert alone.token_ids == [0] and alone.logprobs == [None]
