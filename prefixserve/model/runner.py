"""The model runner: owns the paged KV cache and runs one forward pass per engine step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.model.attention import build_metadata
from prefixserve.model.config import ModelConfig, kv_cache_bytes_per_token
from prefixserve.model.llama import CausalLM


@dataclass
class SeqBatchInput:
    """One sequence's work in a step.

    ``token_ids`` are the new tokens to compute (at least one); ``start_pos`` is how many of the
    sequence's tokens are already in the KV cache (the position of ``token_ids[0]``);
    ``block_table[i]`` is the block holding positions ``[i * block_size, (i + 1) * block_size)``
    and must cover every position up to ``start_pos + len(token_ids) - 1``.
    ``need_prompt_logits`` asks for the logits of every new token, not only the last.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_prompt_logits: bool = False


@dataclass
class ExecuteOutput:
    """Result of a step.

    ``logits[i]`` (float32, ``[num_seqs, vocab]``) are the logits after the last new token of
    sequence i, i.e. the distribution of its next token. ``prompt_logits[i]`` is None unless
    sequence i asked for it; then it is float32 ``[len(token_ids), vocab]``, row j being the
    distribution of the token after ``token_ids[j]``.
    """

    logits: torch.Tensor
    prompt_logits: list[torch.Tensor | None]


class ModelRunner:
    """Runs a :class:`CausalLM` over a preallocated paged KV cache.

    The cache is one tensor ``[num_layers, 2, num_blocks * block_size, kv_heads, head_dim]``
    (zero-initialised). Block ids are plain ints in ``[0, num_blocks)`` chosen by the caller;
    the runner never allocates or frees blocks. Blocks may be shared between sequences, and a
    sequence may read in a step a block that another sequence of the same step writes.
    """

    def __init__(
        self,
        config: ModelConfig,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if model.embed_tokens.weight.dtype != dtype:
            raise ValueError(
                f"model weights are {model.embed_tokens.weight.dtype}, the cache would be {dtype}"
            )
        self.config = config
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_cache = torch.zeros(
            (
                config.num_hidden_layers,
                2,
                num_blocks * block_size,
                config.num_key_value_heads,
                config.head_dim,
            ),
            dtype=dtype,
            device=self.device,
        )

    @staticmethod
    def num_blocks_for_memory(
        config: ModelConfig, dtype: torch.dtype, block_size: int, kv_cache_memory_bytes: int
    ) -> int:
        """How many blocks of ``block_size`` tokens fit in ``kv_cache_memory_bytes``."""
        per_block = kv_cache_bytes_per_token(config, dtype) * block_size
        return kv_cache_memory_bytes // per_block

    def _check(self, seq: SeqBatchInput) -> None:
        if not seq.token_ids:
            raise ValueError("a sequence needs at least one new token per step")
        if seq.start_pos < 0:
            raise ValueError(f"negative start_pos {seq.start_pos}")
        last_pos = seq.start_pos + len(seq.token_ids) - 1
        needed = last_pos // self.block_size + 1
        if len(seq.block_table) < needed:
            raise ValueError(
                f"block table of {len(seq.block_table)} blocks does not cover position {last_pos}"
            )
        used = seq.block_table[:needed]
        if min(used) < 0 or max(used) >= self.num_blocks:
            raise ValueError(f"block id out of range [0, {self.num_blocks})")
        if last_pos >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {last_pos} exceeds the model's {self.config.max_position_embeddings}"
            )

    @torch.inference_mode()
    def execute(self, seqs: list[SeqBatchInput]) -> ExecuteOutput:
        """Compute the new tokens of all ``seqs`` in one forward pass.

        Writes their K/V into the cache at their slots and returns logits (see
        :class:`ExecuteOutput`).
        """
        if not seqs:
            raise ValueError("execute needs at least one sequence")
        token_ids: list[int] = []
        positions: list[int] = []
        for seq in seqs:
            self._check(seq)
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + len(seq.token_ids)))
        meta = build_metadata(
            [(s.start_pos, len(s.token_ids)) for s in seqs],
            [s.block_table for s in seqs],
            self.block_size,
            self.device,
            self.dtype,
        )
        ids_t = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids_t, pos_t, self.kv_cache, meta, self.block_size)
        ends: list[int] = []
        row = 0
        for seq in seqs:
            row += len(seq.token_ids)
            ends.append(row)
        if len(seqs) == 1:
            last_hidden = hidden[-1:]
        else:
            last_rows = torch.tensor([e - 1 for e in ends], dtype=torch.long, device=self.device)
            last_hidden = hidden.index_select(0, last_rows)
        logits = self.model.compute_logits(last_hidden)
        prompt_logits: list[torch.Tensor | None] = []
        for seq, end in zip(seqs, ends, strict=True):
            if seq.need_prompt_logits:
                start = end - len(seq.token_ids)
                prompt_logits.append(self.model.compute_logits(hidden[start:end]))
            else:
                prompt_logits.append(None)
        return ExecuteOutput(logits, prompt_logits)
