"""The model runner: owns the paged KV cache and runs one forward pass per engine step."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from itertools import accumulate

import torch

from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.llama import CausalLM
from prefixserve.model.arch.lora import LoRAModel
from prefixserve.model.attention import batch_invariant, fused_decode
from prefixserve.model.attention import prompt as prompt_attention
from prefixserve.model.attention.paged import AttentionMetadata, TableRows, build_metadata
from prefixserve.model.attention.window import build_window_metadata
from prefixserve.model.kv_layout import kv_block_bytes, kv_layout
from prefixserve.model.kv_pool import zeroed_pool
from prefixserve.model.weights import quant_kernels
from prefixserve.model.weights.dtypes import cpu_has_amx

MIN_SPLIT_CONTEXT = 1024
"""A step that mixes prefills and decodes runs its decodes through the fused layers (a second
pass over the weights, ~10 ms for the default model on 2 cores) when their contexts add up to
this many tokens; below, they ride along in the prefill's forward pass, where each costs its
gather and attention (~13 us per token of context per step, measured at 1,100 tokens)."""

FUSED_STEP_ROWS = 64
"""A step of at most this many new tokens, prompt chunks included (none with image embeds or
asking for its prompt's logits), runs whole through the fused layers, each token a row at its
position as drafts are: a short prompt, or the short rest of a prompt whose prefix came from
the cache, skips the ~40 torch operations a layer of the eager step costs. Its activations are
rounded to 16 bits per block of 32, as a decode step's; on builds without the panel kernel the
eager step multiplies more than ``SMALL_M`` float32 rows as they are, after expanding every
weight (Zen 3 before the panels, default model, a prompt and its first token: 4 tokens 27 -> 16
ms, 16 tokens 45 -> 34 ms, 32 tokens 172 -> 62 ms, 64 tokens 227 -> 129 ms; at 96 both take 0.2
s, at 128 the fused layers 1.1x the eager step's time). Builds that multiply in panels take
``PANEL_STEP_ROWS``."""

PANEL_STEP_ROWS = 128
"""``FUSED_STEP_ROWS`` of a float32 model where the kernel library has the panel kernel (every
AVX2 build): both steps multiply more than ``SMALL_M`` rows in panels (``kernels/panel.c``) and
the fused step stayed ahead at every size measured (``benchmarks/short_prompts.py``, eager /
fused; Zen 3: the default model 1.26-1.49x at 24-64 tokens, 1.16-1.29x at 96-128, 1.11-1.19x
at 256-1,024; a 1B model 1.09-1.20x at 16-64, 1.02-1.05x at 512; Xeon, 512-bit panels: the
default model 1.12-1.29x at 16-256). Longer steps, a long prompt's chunks, stay on the eager
path, whose prompt attention the tests hold against transformers'. A bfloat16 model keeps
``FUSED_STEP_ROWS``: its products of many rows take the bfloat16 and AMX kernels, and on an AMX
Xeon the fused step fell behind the eager one past 64 tokens after a cached prefix (0.76x at
128)."""


def fused_step_rows(dtype: torch.dtype) -> int:
    """The most new tokens of a step that runs whole through the fused layers, for a model in
    ``dtype``: ``PANEL_STEP_ROWS`` for float32 where the kernel library multiplies in panels,
    else ``FUSED_STEP_ROWS``."""
    lib = quant_kernels.kernels()
    panels = dtype == torch.float32 and lib is not None and lib.panel_rows() > 0
    return PANEL_STEP_ROWS if panels else FUSED_STEP_ROWS


@dataclass
class SeqBatchInput:
    """One sequence's work in a step.

    ``token_ids`` are the new tokens to compute (at least one); ``start_pos`` is how many of the
    sequence's tokens are already in the KV cache (the position of ``token_ids[0]``);
    ``block_table[i]`` is the block holding positions ``[i * block_size, (i + 1) * block_size)``
    and must cover every position up to ``start_pos + len(token_ids) - 1``.
    ``need_prompt_logits`` asks for the logits of every new token, not only the last.
    ``verify`` marks a decoding sequence's next token followed by drafts (n-gram speculation):
    a few tokens that go through the fused decode layers as rows of their own, each at its
    position, where a prompt chunk would take the torch modules; it needs
    ``need_prompt_logits``, whose logits say which drafts the model agrees with.

    ``seq_id`` (optional, unique within a step) names the sequence across steps, so that the
    runner keeps its block table in a tensor and copies only the blocks appended since its
    previous step. Its ``block_table`` must then be one list that only grows at its end; a
    different list (a sequence that was preempted and resumed, say) is copied whole again.
    Without ``seq_id`` the table is copied whole at every step.

    A model with several KV cache groups (:mod:`prefixserve.model.kv_layout`: sliding-window
    and full layers) needs one table per group: ``block_table`` is group 0's and
    ``extra_block_tables`` those of groups 1, 2, ... (a window group's table may hold any block,
    the null block say, before the blocks its window reaches: those are never read).
    ``lora_slot`` (None: the base model) is the LoRA adapter slot the sequence runs under; it
    needs a runner with ``lora`` set (see :mod:`prefixserve.model.arch.lora`).
    ``embeds`` replaces the embeddings of some new tokens (image placeholders): each entry is
    ``(first, rows)``, ``rows`` (``[k, hidden]``) being the first layer's input at
    ``token_ids[first:first + k]``. A sequence with embeds runs through the torch modules.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_prompt_logits: bool = False
    seq_id: Hashable | None = None
    extra_block_tables: tuple[list[int], ...] = ()
    lora_slot: int | None = None
    verify: bool = False
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()


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


def _check_runner_args(model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                       kv_dtype: torch.dtype, device: torch.device | str,
                       deterministic: bool) -> None:
    """A ValueError for a pool, cache dtype or mode the runner cannot run with."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError("num_blocks and block_size must be positive")
    if model.norm.weight.dtype != dtype:
        raise ValueError(
            f"model activations are {model.norm.weight.dtype}, the cache would be {dtype}"
        )
    if deterministic:
        _check_deterministic(dtype, torch.device(device))
        if kv_dtype != dtype:
            raise ValueError("the deterministic mode needs the KV cache in the "
                             f"activations' dtype ({dtype}), not {kv_dtype}")


class ModelRunner:
    """Runs a :class:`CausalLM` over a preallocated paged KV cache.

    The cache is one tensor ``[group_size, 2, num_blocks * block_size, kv_heads, head_dim]``
    (zero-initialised; ``group_size`` is the number of layers of a KV cache group, all of them
    for a model with one attention kind, see :mod:`prefixserve.model.kv_layout`). Block ids
    are plain ints in ``[0, num_blocks)`` chosen by the caller;
    the runner never allocates or frees blocks. Blocks may be shared between sequences, and a
    sequence may read in a step a block that another sequence of the same step writes.

    ``deterministic`` switches the model to the batch-invariant kernels (in place; see
    :mod:`prefixserve.model.attention.batch_invariant`): a sequence's logits then do not depend on
    the
    other sequences of a step, nor on how its tokens were split between steps and the cache.

    Steps where every sequence adds one token run the decoder layers through
    :class:`~prefixserve.model.attention.fused_decode.FusedDecode` where it applies (see
    :func:`~prefixserve.model.attention.fused_decode.unsupported`; ``fused_decode_reason`` says why
    not),
    LoRA adapters included, unless ``enforce_eager`` is set or the model runs deterministically.
    """

    def __init__(
        self,
        config: ModelConfig,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        deterministic: bool = False,
        enforce_eager: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        kv_dtype = kv_cache_dtype or dtype
        _check_runner_args(model, num_blocks, block_size, dtype, kv_dtype, device, deterministic)
        self.deterministic = deterministic
        if deterministic:
            batch_invariant.make_batch_invariant(model)
        self.config = config
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.layout = kv_layout(config)
        self.kv_cache = zeroed_pool(
            (self.layout.group_size, 2, num_blocks * block_size, config.num_key_value_heads,
             config.head_dim), kv_dtype, self.device)
        self.block_tables = [BlockTables(num_blocks, self.device) for _ in self.layout.groups]
        self.lora: LoRAModel | None = None
        """The adapter slots of the model (``install_lora``), or None without LoRA."""
        self.enforce_eager = enforce_eager
        self.prompts_in_kernel = not (dtype == torch.bfloat16 and self.device.type == "cpu"
                                      and cpu_has_amx())
        """Whether steps that compute prompt positions attend through the C kernel where it
        applies (``_prompt_kernel``), or through torch (gather and SDPA): a bfloat16 model on a
        CPU with AMX tiles, where SDPA's products run on the tiles: the mixed steps of a
        16-client replay took 0.7x the kernel's time (benchmarks/RESULTS.md), and Gemma 3's
        cold 2,000-token prompt 0.73x with its sliding-window groups through SDPA too. Steps
        of one position per sequence (a dense model's decodes) keep the kernel either way."""
        self._fused: fused_decode.FusedDecode | None = None
        self._prompt_attention: prompt_attention.PromptAttention | None = None
        self._group_kernels: dict[int, prompt_attention.PromptAttention | None] = {}
        self._attention_checked = False
        """Whether the kernel's attention was considered for a model the fused layers do not
        take (dense projections)."""
        self.fused_decode_reason: str | None = None
        """Why decode steps run eagerly (None: they are fused, or no decode step ran yet)."""
        self.fused_step_rows = FUSED_STEP_ROWS
        """The most new tokens of a step that runs whole through the fused layers (set by
        :func:`fused_step_rows` when they are built; ``benchmarks/short_prompts.py`` changes
        it to compare)."""
        self.model_seconds = 0.0
        """Seconds spent in the model (forward pass and logits) by ``execute`` since the runner
        was made: the rest of a step is the engine's own work. (Host time: on an accelerator,
        the time to queue the work, not to run it.)"""

    @staticmethod
    def num_blocks_for_memory(
        config: ModelConfig, dtype: torch.dtype, block_size: int, kv_cache_memory_bytes: int
    ) -> int:
        """How many blocks of ``block_size`` tokens fit in ``kv_cache_memory_bytes`` (a block
        holds one KV cache group's layers)."""
        return kv_cache_memory_bytes // kv_block_bytes(config, dtype, block_size)

    def _check(self, seq: SeqBatchInput) -> int:
        """Raises ``ValueError`` for a malformed input; returns how many blocks it uses. (Block
        ids are checked as ``BlockTables`` copies them.)"""
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
        if len(seq.extra_block_tables) != len(self.layout.groups) - 1:
            raise ValueError(f"the model has {len(self.layout.groups)} KV cache groups: give "
                             f"{len(self.layout.groups) - 1} extra block tables, got "
                             f"{len(seq.extra_block_tables)}")
        for table in seq.extra_block_tables:
            if len(table) < needed:
                raise ValueError(f"a group's block table of {len(table)} blocks does not "
                                 f"cover position {last_pos}")
        if last_pos >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {last_pos} exceeds the model's {self.config.max_position_embeddings}"
            )
        for first, rows in seq.embeds:
            if first < 0 or first + rows.shape[0] > len(seq.token_ids) or \
                    rows.shape[1:] != (self.config.hidden_size,):
                raise ValueError(f"embeds of shape {tuple(rows.shape)} at {first} do not fit "
                                 f"{len(seq.token_ids)} new tokens of {self.config.hidden_size}")
        return needed

    def warm_up_positions(self) -> int:
        """KV positions ``warm_up`` writes: a prompt of half a block (at least one token) and
        one decoded token."""
        return max(1, self.block_size // 2) + 1

    @torch.inference_mode()
    def warm_up(self, table: list[int]) -> None:
        """A short prompt and one decode step (``warm_up_positions``) in the blocks of
        ``table``, which no one reads (the caller's to give), before any request: what a
        model's first steps build or load (the fused decode layers, the C kernels' first calls,
        torch's first operator calls) is then ready, and the first request takes a request's
        time. ``model_seconds`` starts after it. In inference mode, as ``execute``: the buffers
        that steps grow serve later steps, and a buffer made in that mode takes no in-place
        update outside it (a warm-up after steps, in another thread)."""
        tables = (table,) * (len(self.layout.groups) - 1)
        tokens = list(range(1, self.warm_up_positions()))
        prompt = SeqBatchInput(tokens, 0, table, extra_block_tables=tables)
        # through the torch modules, which a prompt this short would skip (FUSED_STEP_ROWS)
        self._eager_step([prompt], [self._check(prompt)])
        self.execute([SeqBatchInput([1], len(tokens), table, extra_block_tables=tables)])
        self.model_seconds = 0.0

    @torch.inference_mode()
    def execute(self, seqs: list[SeqBatchInput]) -> ExecuteOutput:
        """Compute the new tokens of all ``seqs`` in one forward pass.

        Writes their K/V into the cache at their slots and returns logits (see
        :class:`ExecuteOutput`).
        """
        if not seqs:
            raise ValueError("execute needs at least one sequence")
        needed = [self._check(seq) for seq in seqs]
        decoding = self._fused_rows(seqs)
        if not decoding:
            return self._eager_step(seqs, needed)
        rows = [self.block_tables[g].update(seqs, needed, self._group_tables(seqs, g))
                for g in range(len(self.layout.groups))]
        if len(decoding) == len(seqs):
            return self._fused_step(seqs, rows)
        return self._split_step(seqs, needed, rows, decoding)

    @staticmethod
    def _group_tables(seqs: list[SeqBatchInput], group: int) -> list[list[int]]:
        """The sequences' block tables of KV cache group ``group``."""
        return [s.block_table if group == 0 else s.extra_block_tables[group - 1] for s in seqs]

    def _eager_step(self, seqs: list[SeqBatchInput], needed: list[int],
                    rows: list[list[int]] | None = None) -> ExecuteOutput:
        """The step through the torch modules: one forward pass over all new tokens. ``rows``:
        the sequences' rows of each group's block tables when already updated."""
        meta = self._metadata(seqs, needed, rows)
        token_ids: list[int] = []
        positions: list[int] = []
        for seq in seqs:
            token_ids += seq.token_ids
            positions += range(seq.start_pos, seq.start_pos + len(seq.token_ids))
        ids_t = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        self._prepare_lora(seqs)
        start = time.perf_counter()
        out = self._forward(ids_t, pos_t, meta, seqs, self._embeddings(ids_t, seqs))
        self.model_seconds += time.perf_counter() - start
        return out

    def _embeddings(self, ids_t: torch.Tensor, seqs: list[SeqBatchInput]
                    ) -> torch.Tensor | None:
        """The first layer's input with the sequences' ``embeds`` in place (None when no
        sequence has any: the model embeds the ids itself)."""
        if not any(seq.embeds for seq in seqs):
            return None
        x = self.model.embed(ids_t)
        base = 0
        for seq in seqs:
            for first, rows in seq.embeds:
                x[base + first:base + first + rows.shape[0]] = rows.to(x.device, x.dtype)
            base += len(seq.token_ids)
        return x

    def _fused_rows(self, seqs: list[SeqBatchInput]) -> list[int]:
        """The sequences of this step that go through the fused decode layers: all of them in
        a step of at most ``fused_step_rows`` new tokens without image embeds; else every one
        that adds one token (and wants no prompt logits) when all of them do, or when their
        contexts add up to ``MIN_SPLIT_CONTEXT`` tokens; none if the fused step does not
        apply."""
        if sum(len(s.token_ids) for s in seqs) <= self.fused_step_rows and self._fused_ready() \
                and not any(s.embeds or (s.need_prompt_logits and not s.verify) for s in seqs):
            return list(range(len(seqs)))
        decoding = [i for i, s in enumerate(seqs) if not s.embeds and
                    (s.verify or (len(s.token_ids) == 1 and not s.need_prompt_logits))]
        if not decoding or not self._fused_ready():
            return []
        if len(decoding) < len(seqs) and \
                sum(seqs[i].start_pos + 1 for i in decoding) < MIN_SPLIT_CONTEXT:
            return []
        return decoding

    def _fused_ready(self) -> bool:
        """Whether the fused decode layers apply to this runner (built at the first call, and
        again when adapters were installed after that)."""
        if self._fused is not None and self.lora is not None and not self._fused.has_lora:
            self._fused = None  # it reads the projections under the adapters' wrappers
        if self._fused is None and self.fused_decode_reason is None:
            reason = ("enforce_eager" if self.enforce_eager else
                      "deterministic mode" if self.deterministic else
                      fused_decode.unsupported(self.model, self.kv_cache))
            if reason is None:
                assert isinstance(self.model, CausalLM)
                self._fused = fused_decode.FusedDecode(self.model, self.kv_cache,
                                                       self.block_size)
                self.fused_step_rows = fused_step_rows(self.dtype)
                self._prompt_attention = self._new_prompt_attention()
            self.fused_decode_reason = reason
        return self._fused is not None

    def _prompt_kernel(self) -> prompt_attention.PromptAttention | None:
        """The C kernel's attention for this step's eager rows: where the fused layers apply,
        and where only the projections keep them off (dense weights: they change the
        projections, not the attention); built at the first such step, not in the eager or
        the deterministic mode."""
        if self._fused_ready():
            return self._prompt_attention
        if self.enforce_eager or self.deterministic:
            return None
        if not self._attention_checked:
            self._attention_checked = True
            if self._prompt_attention is None and \
                    fused_decode.unsupported_attention(self.model, self.kv_cache) is None:
                self._prompt_attention = self._new_prompt_attention()
        return self._prompt_attention

    def _group_kernel(self, group: int) -> prompt_attention.PromptAttention | None:
        """The C kernel's attention for KV cache group ``group``'s layers in the eager steps
        (``_prompt_kernel``'s for group 0; each other group has its own, whose plan lives
        beside group 0's through the step)."""
        kernel = self._prompt_kernel()
        if kernel is None or group == 0:
            return kernel
        if group not in self._group_kernels:
            self._group_kernels[group] = self._new_prompt_attention()
        return self._group_kernels[group]

    def _new_prompt_attention(self) -> prompt_attention.PromptAttention | None:
        """The C kernel's attention for the eager steps, where the fused layers apply, the
        kernel has its fast form for the head size (``prompt_attention.available``) and the
        model is one it attends for (``unsupported_attention``)."""
        config = self.model.config
        if not prompt_attention.available(config.head_dim) or \
                fused_decode.unsupported_attention(self.model, self.kv_cache) is not None:
            return None
        return prompt_attention.PromptAttention(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            self.block_size, self.kv_cache, bf16_queries=self.dtype == torch.bfloat16)

    def _fused_step(self, seqs: list[SeqBatchInput], rows: list[list[int]]) -> ExecuteOutput:
        """Sequences of one new token each, a few to verify or a short prompt chunk (each
        token a row), through :class:`FusedDecode`
        (``rows``: theirs of each KV cache group's block tables, already updated): embeddings,
        the fused layers, logits. A sequence's tokens are rows of their own, at consecutive
        positions, on one block table row (of each group): each layer writes every row's K/V
        before attending, so a row sees the rows before it, and the kernel reads their shared
        context once for all of them."""
        assert self._fused is not None
        ids: list[int] = []
        positions: list[int] = []
        for seq in seqs:
            ids += seq.token_ids
            positions += range(seq.start_pos, seq.start_pos + len(seq.token_ids))
        # each token a row of its own, on its sequence's row of every group's tables
        table_rows = [[row for seq, row in zip(seqs, group, strict=True)
                       for _ in seq.token_ids] for group in rows]
        start = time.perf_counter()
        hidden = self.model.embed(torch.tensor(ids, dtype=torch.long))
        extra = [(self.block_tables[g].buffer, table_rows[g]) for g in range(1, len(rows))]
        slots = None
        if self.lora is not None and any(seq.lora_slot is not None for seq in seqs):
            slots = [-1 if seq.lora_slot is None else seq.lora_slot
                     for seq in seqs for _ in seq.token_ids]
        elif any(seq.lora_slot is not None for seq in seqs):
            raise ValueError("a sequence asks for a LoRA slot, but the model has no adapters")
        hidden = self._fused.run(hidden, positions, self.block_tables[0].buffer, table_rows[0],
                                 extra, lora_slots=slots)
        if len(ids) == len(seqs):
            out = ExecuteOutput(self.model.compute_logits(hidden), [None] * len(seqs))
        else:
            out = self._all_logits(hidden, seqs)
        self.model_seconds += time.perf_counter() - start
        return out

    def _split_step(self, seqs: list[SeqBatchInput], needed: list[int], rows: list[list[int]],
                    decoding: list[int]) -> ExecuteOutput:
        """A step of prefills and decodes: the prefills through the torch modules, the decodes
        through the fused layers (they write different slots and read no slot the other part
        writes: a decoding sequence's context is computed already)."""
        chosen = set(decoding)
        others = [i for i in range(len(seqs)) if i not in chosen]
        eager = self._eager_step([seqs[i] for i in others], [needed[i] for i in others],
                                 [[group[i] for i in others] for group in rows])
        fused = self._fused_step([seqs[i] for i in decoding],
                                 [[group[i] for i in decoding] for group in rows])
        logits = eager.logits.new_empty((len(seqs), eager.logits.shape[1]))
        logits[others] = eager.logits
        logits[decoding] = fused.logits
        prompt_logits: list[torch.Tensor | None] = [None] * len(seqs)
        for j, i in enumerate(others):
            prompt_logits[i] = eager.prompt_logits[j]
        for j, i in enumerate(decoding):
            prompt_logits[i] = fused.prompt_logits[j]
        return ExecuteOutput(logits, prompt_logits)

    def _metadata(self, seqs: list[SeqBatchInput], needed: list[int],
                  updated: list[list[int]] | None = None) -> list[AttentionMetadata]:
        """One metadata per KV cache group, from each group's tables (window groups with the
        window's masks). ``updated``: the sequences' rows of each group's tables when already
        updated."""
        seq_lens = [(s.start_pos, len(s.token_ids)) for s in seqs]
        prompts = any(n > 1 for _, n in seq_lens)
        metas = []
        for g, group in enumerate(self.layout.groups):
            tables = self._group_tables(seqs, g)
            keeper = self.block_tables[g]
            rows = updated[g] if updated is not None else keeper.update(seqs, needed, tables)
            table_rows = TableRows(keeper.buffer, rows)
            in_kernel = self.prompts_in_kernel or not prompts
            kernel = self._group_kernel(g) if in_kernel else None
            if group.window is None:
                metas.append(build_metadata(seq_lens, tables, self.block_size, self.device,
                                            self.dtype, table_rows, self.deterministic, kernel))
            else:
                metas.append(build_window_metadata(seq_lens, tables, self.block_size,
                                                   group.window, self.device, self.dtype,
                                                   table_rows, kernel, self.deterministic))
        return metas


    def _prepare_lora(self, seqs: list[SeqBatchInput]) -> None:
        """Tells the LoRA modules which rows run under which adapter slot in this step."""
        if self.lora is not None:
            self.lora.prepare([s.lora_slot for s in seqs], [len(s.token_ids) for s in seqs])
        elif any(s.lora_slot is not None for s in seqs):
            raise ValueError("a sequence asks for a LoRA slot, but the model has no adapters")

    def _forward(self, ids_t: torch.Tensor, pos_t: torch.Tensor, meta: list[AttentionMetadata],
                 seqs: list[SeqBatchInput], embeds: torch.Tensor | None = None
                 ) -> ExecuteOutput:
        """The model over the step's tokens (``embeds``: their first layer's input, when not
        the ids' embeddings), and the logits asked for."""
        hidden = self.model(ids_t, pos_t, self.kv_cache, meta, self.block_size, embeds)
        if any(seq.need_prompt_logits for seq in seqs):
            return self._all_logits(hidden, seqs)
        if len(seqs) == 1:
            last_hidden = hidden[-1:]
        elif meta[0].num_tokens == len(seqs):  # one new token each: every row is a last row
            last_hidden = hidden
        else:
            ends = list(accumulate(len(seq.token_ids) for seq in seqs))
            last_rows = torch.tensor([e - 1 for e in ends], dtype=torch.long, device=self.device)
            last_hidden = hidden.index_select(0, last_rows)
        return ExecuteOutput(self.model.compute_logits(last_hidden), [None] * len(seqs))

    def _all_logits(self, hidden: torch.Tensor, seqs: list[SeqBatchInput]) -> ExecuteOutput:
        """The logits of every row of the sequences that ask for them and of the last row of
        the others, in one product with the output head (drafts of many sequences in a step:
        one pass over the head's weights, not one per sequence)."""
        rows: list[int] = []
        spans: list[tuple[int, int]] = []
        end = 0
        for seq in seqs:
            first = end if seq.need_prompt_logits else end + len(seq.token_ids) - 1
            end += len(seq.token_ids)
            spans.append((len(rows), len(rows) + end - first))
            rows.extend(range(first, end))
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        every = self.model.compute_logits(hidden.index_select(0, index))
        last = torch.tensor([hi - 1 for _, hi in spans], dtype=torch.long, device=self.device)
        prompt_logits: list[torch.Tensor | None] = [
            every[lo:hi] if seq.need_prompt_logits else None
            for seq, (lo, hi) in zip(seqs, spans, strict=True)]
        return ExecuteOutput(every.index_select(0, last), prompt_logits)


def _check_deterministic(dtype: torch.dtype, device: torch.device) -> None:
    """Raises ``ValueError`` where the deterministic mode cannot run."""
    if device.type != "cpu":
        raise ValueError("the deterministic mode runs on CPU only")
    if dtype not in batch_invariant.SUPPORTED_DTYPES:
        raise ValueError(f"the deterministic mode needs float32 or bfloat16, not {dtype}")
    error = batch_invariant.attention_kernel_error()
    if error is not None:
        raise ValueError(f"the deterministic attention kernel cannot be built: {error}")


@dataclass(slots=True)
class _TableRow:
    """A sequence's row of ``BlockTables.buffer``: its first ``written`` entries are the first
    blocks of ``source``, the rest zeros."""

    slot: int
    source: list[int] | None
    written: int


class BlockTables:
    """The block tables of the sequences of the latest step, kept in one long tensor
    (``buffer``, one row per sequence, zeros after each table) between steps, so that a step
    copies only the blocks that sequences appended since their previous step: a decoding
    sequence copies one block id every ``block_size`` steps, not its whole table at every step.
    A sequence absent from a step loses its row (it is copied whole if it comes back). The
    tensor grows (rows, columns) as needed and is never shrunk."""

    def __init__(self, num_blocks: int, device: torch.device, rows: int = 16, width: int = 64
                 ) -> None:
        self.num_blocks = num_blocks
        self.buffer = torch.zeros((rows, width), dtype=torch.long, device=device)
        self._rows: dict[Hashable, _TableRow] = {}
        self._free = list(range(rows - 1, -1, -1))

    def update(self, seqs: list[SeqBatchInput], needed: list[int],
               tables: list[list[int]] | None = None) -> list[int]:
        """Copies what is new of each sequence's table (``tables[i]``, default its
        ``block_table``), up to its first ``needed[i]`` blocks, and returns each sequence's row.
        Raises ``ValueError`` for a block id out of range."""
        keys = [seq.seq_id if seq.seq_id is not None else object() for seq in seqs]
        live = set(keys)
        if len(live) != len(keys):
            raise ValueError("seq_id must be unique within a step")
        for key in self._rows.keys() - live:
            self._release(key)
        if tables is None:
            tables = [seq.block_table for seq in seqs]
        return [self._copy(key, table, n)
                for key, table, n in zip(keys, tables, needed, strict=True)]

    def _copy(self, key: Hashable, table: list[int], needed: int) -> int:
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _TableRow(self._take_slot(), None, 0)
        if row.source is not table or row.written > needed:  # another table: start again
            if row.written:
                self.buffer[row.slot, : row.written].zero_()
            row.source, row.written = table, 0
        if needed > row.written:
            new = table[row.written : needed]
            if min(new) < 0 or max(new) >= self.num_blocks:
                raise ValueError(f"block id out of range [0, {self.num_blocks})")
            if needed > self.buffer.shape[1]:
                self._grow(self.buffer.shape[0], max(needed, 2 * self.buffer.shape[1]))
            self.buffer[row.slot, row.written : needed] = torch.tensor(new, dtype=torch.long)
            row.written = needed
        return row.slot

    def _release(self, key: Hashable) -> None:
        row = self._rows.pop(key)
        self.buffer[row.slot, : row.written].zero_()
        self._free.append(row.slot)

    def _take_slot(self) -> int:
        if not self._free:
            rows = self.buffer.shape[0]
            self._grow(2 * rows, self.buffer.shape[1])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def _grow(self, rows: int, width: int) -> None:
        old = self.buffer
        self.buffer = old.new_zeros((rows, width))
        self.buffer[: old.shape[0], : old.shape[1]] = old
