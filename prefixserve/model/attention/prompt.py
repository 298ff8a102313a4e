"""Attention of a step's prompt positions in C, over the paged cache (``kernels/decode.c``).

A prompt computed after a cached prefix (the question after a shared system prompt, the next
turn of a conversation) attends to every cached position: through torch, each sequence first
copies its whole context out of the cache and then runs SDPA, so sequences on one prefix copy
and score it again each, and on CPU that was most of the time of such a step
(``benchmarks/RESULTS.md``). Here each position of a prompt is one row of
the fused decode step's attention (``decode.c``'s ``attention``): the rows' contexts are cut in
chunks, the rows that hold the same blocks for a chunk (the positions of one prompt, and of the
prompts on one prefix) are grouped, each group reads its chunk from the cache once, and the
chunks' partial results are merged by their log-sum-exp.

:class:`PromptAttention` applies where the fused decode step does
(:func:`~prefixserve.model.attention.fused_decode.unsupported`), and where only the projections
(dense
weights, LoRA wrappers) keep the fused step off
(:func:`~prefixserve.model.attention.fused_decode.unsupported_attention`): there it takes every
step's
rows, decode rows included. A sliding-window KV cache group plans its rows over their windows
(``plan(..., window=W)``), one :class:`PromptAttention` per group. It needs the kernel's
512-bit form for the head size (:func:`available`). The runner plans each eager step's
attention with it (:meth:`PromptAttention.plan`, once a step) and every layer runs it
(:meth:`KernelPlan.run`). The result equals SDPA's up to float rounding (another summation
order): ``tests/model/test_prompt_attention.py`` bounds the difference.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from prefixserve.model.attention import decode_kernel


def available(head_dim: int) -> bool:
    """Whether this CPU's build of the kernel attends at this head size in its 512-bit form
    (the one measured faster than SDPA; the AVX2 form was not)."""
    lib = decode_kernel.library.get()
    return lib is not None and bool(lib.attention_has_fast_form(head_dim))


def attends_in_bf16() -> bool:
    """Whether this CPU's build attends with bfloat16 queries and weights over a bfloat16 cache
    with ``vdpbf16ps`` (AVX512-BF16): ``PromptAttention(..., bf16_queries=True)`` takes it."""
    lib = decode_kernel.library.get()
    return lib is not None and bool(lib.attention_has_bf16_form())


@dataclass
class KernelPlan:
    """One step's rows planned for the kernel: kept alive with the arrays they point into, and
    the float32 queries and outputs every layer reuses (``[rows, heads * head_dim]``)."""

    owner: PromptAttention
    batch: decode_kernel.BatchStruct
    arrays: tuple[torch.Tensor, ...]
    plan: torch.Tensor
    query: torch.Tensor
    out: torch.Tensor

    def run(self, q: torch.Tensor, layer_cache: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` ``[rows, heads, head_dim]`` over this layer's ``layer_cache``,
        the rows' own K/V written to it already; returns ``[rows, heads, head_dim]`` in q's
        dtype (a tensor of its own: the plan's buffers serve the next layer)."""
        assert layer_cache.is_contiguous()
        self.query.copy_(q.reshape(self.query.shape))
        self.owner.lib.attention_run(ctypes.byref(self.owner.model), ctypes.byref(self.batch),
                                     self.plan.data_ptr(), layer_cache.data_ptr(),
                                     self.query.data_ptr(), self.out.data_ptr())
        return self.out.to(q.dtype, copy=True).view(q.shape)


class PromptAttention:
    """The kernel's attention for a model's cache: heads, KV heads, head size, block size and
    cache type (one of :data:`~prefixserve.model.attention.decode_kernel.KV_TYPES`).
    ``bf16_queries``
    says that the queries are bfloat16 values (a bfloat16 model's): with a bfloat16 cache the
    kernel then attends in bfloat16 (:func:`attends_in_bf16`), reading keys and values in place
    and rounding the softmax weights to bfloat16 as torch's SDPA does in bfloat16. It keeps
    the buffers
    of the latest plan, grown as steps need, for the next: one step's plan is used up before
    the next is made (fresh pages of a few megabytes a step cost 5% of a prompt step's time in
    page faults)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block_size: int,
                 kv_cache: torch.Tensor, bf16_queries: bool = False) -> None:
        lib = decode_kernel.library.get()
        assert lib is not None and available(head_dim), "check available() first"
        self.lib = lib
        self.width = heads * head_dim
        self.model = decode_kernel.ModelStruct(0, 0, heads, kv_heads, head_dim, 0, block_size,
                                         kv_cache.shape[2], decode_kernel.KV_TYPES[kv_cache.dtype],
                                         0, int(bf16_queries), 0.0, None, None)
        self._buffer = torch.empty(0, dtype=torch.float32)

    def plan(self, positions: list[int], table_rows: list[int], tables: torch.Tensor,
             window: int | None = None) -> KernelPlan:
        """Plans the step whose row i is at position ``positions[i]`` of the sequence with
        block table row ``table_rows[i]`` of ``tables`` (long, ``[num_rows, width]``), each
        row attending over its last ``window`` positions (None: its whole context). A
        window's blocks before its first position are never read (the null block may stand
        there)."""
        pos_t = torch.tensor(positions, dtype=torch.int64)
        rows_t = torch.tensor(table_rows, dtype=torch.int64)
        batch = decode_kernel.BatchStruct(len(positions), pos_t.data_ptr(), tables.data_ptr(),
                                    rows_t.data_ptr(), tables.stride(0))
        plan_floats = (self.lib.attention_plan_bytes(ctypes.byref(self.model),
                                                     ctypes.byref(batch)) + 3) // 4
        row_floats = len(positions) * self.width
        if self._buffer.numel() < plan_floats + 2 * row_floats:
            self._buffer = torch.empty(plan_floats + 2 * row_floats, dtype=torch.float32)
        plan = self._buffer[:plan_floats]
        query = self._buffer[plan_floats:plan_floats + row_floats].view(-1, self.width)
        out = self._buffer[plan_floats + row_floats:plan_floats + 2 * row_floats]
        self.lib.attention_plan(ctypes.byref(self.model), ctypes.byref(batch), window or 0,
                                plan.data_ptr())
        return KernelPlan(self, batch, (pos_t, rows_t, tables), plan, query,
                          out.view(-1, self.width))
