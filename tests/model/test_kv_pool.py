"""The KV pool's memory (``prefixserve/model/kv_pool.py``): zeros, aligned, and resident only
where blocks are written, so that start-up clears nothing and an idle server holds no pool."""

from __future__ import annotations

import errno
import logging
import mmap

import pytest
import torch
from model_helpers import dense_model, tiny_config

from prefixserve.model import kv_pool
from prefixserve.model.kv_pool import zeroed_pool
from prefixserve.model.runner import ModelRunner, SeqBatchInput

MIB = 2**20


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / MIB


def test_a_cpu_pool_reads_zero_and_is_resident_only_where_written() -> None:
    """256 MiB of bfloat16: made without touching a page (torch.zeros makes all 256 resident),
    64-byte aligned like torch's own tensors, zero wherever read, and a written block costs
    its pages only: 64 KiB, not the 2 MiB of a transparent huge page (numpy's zeros ask for
    those: planted, two blocks' writes grew the resident set by 2 MiB)."""
    shape = (2, 2, 16 * 1024, 8, 256)
    before = resident_mib()
    pool = zeroed_pool(shape, torch.bfloat16, torch.device("cpu"))
    assert resident_mib() - before < 8
    assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert pool.data_ptr() % 64 == 0
    assert not pool[1, 1, -16:].any() and not pool[0, 0, :16].any()
    written = resident_mib()
    pool[0, 0, :16] = 1.5
    pool[0, 1, 8192:8208] = 1.5  # past the mapping's unaligned head (no huge page there)
    assert resident_mib() - written < 1
    assert float(pool[0, 0, :16].float().mean()) == 1.5 and not pool[0, 0, 16:32].any()
    assert resident_mib() - before < 16


def test_a_kernel_that_refuses_the_page_size_advice_still_gives_the_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel built without transparent huge pages answers ``MADV_NOHUGEPAGE`` with EINVAL:
    there are no huge pages to avoid, and the pool is made as elsewhere (planted: the advice's
    error passed on, the start fails)."""

    class Refusing(mmap.mmap):
        def madvise(self, *args: int) -> None:
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    pool = zeroed_pool((4 * MIB,), torch.uint8, torch.device("cpu"))
    assert pool.numel() == 4 * MIB and not pool[-16:].any()


def test_the_runner_allocates_its_kv_cache_untouched() -> None:
    """A runner with a 192 MiB float32 pool on a tiny model: its start leaves the pool out of
    the resident set, and a prompt then computes as usual into its blocks."""
    config = tiny_config()
    model = dense_model(config)
    block_size = 16
    per_block = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim \
        * 4 * block_size  # K and V of every layer, float32
    num_blocks = 192 * MIB // per_block
    before = resident_mib()
    runner = ModelRunner(config, model, num_blocks, block_size, torch.float32, "cpu")
    assert runner.kv_cache.numel() * 4 >= 190 * MIB
    assert resident_mib() - before < 32
    out = runner.execute([SeqBatchInput(list(range(1, 40)), 0, [0, 1, 2])])
    assert out.logits.shape[-1] == config.vocab_size
    assert runner.kv_cache[:, :, :39].abs().sum() > 0 and not runner.kv_cache[:, :, 48:].any()


def test_a_pool_the_system_refuses_is_a_clear_error_naming_the_flags() -> None:
    """256 TiB, past any x86-64 process's address space: refused at start, by name."""
    with pytest.raises(ValueError, match="--kv-cache-memory or --num-blocks"):
        zeroed_pool((2**47,), torch.bfloat16, torch.device("cpu"))


def test_a_pool_larger_than_the_memory_available_is_warned_of(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Its pages are taken only as blocks fill, so the server starts; the log says it may run
    out of memory later (the machine's available memory stands in at 1 MiB)."""
    monkeypatch.setattr(kv_pool, "_available_bytes", lambda: MIB)
    with caplog.at_level(logging.WARNING, logger="prefixserve.model.kv_pool"):
        pool = zeroed_pool((4 * MIB,), torch.uint8, torch.device("cpu"))
    assert pool.numel() == 4 * MIB
    assert "larger than the memory available now" in caplog.text
    caplog.clear()
    monkeypatch.setattr(kv_pool, "_available_bytes", lambda: 64 * MIB)
    with caplog.at_level(logging.WARNING, logger="prefixserve.model.kv_pool"):
        zeroed_pool((4 * MIB,), torch.uint8, torch.device("cpu"))
    assert caplog.text == ""
