"""LoRA adapters: loading (PEFT and GGUF), validation against the base model, batched deltas.

An adapter changes a projection ``y = x W^T`` into ``y = x W^T + scale * (x A^T) B^T`` with
``A`` ``[r, in]`` and ``B`` ``[out, r]`` of a small rank ``r``. Two file formats load:

* **PEFT** (a directory): ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
  optional ``use_rslora``, ``rank_pattern``, ``alpha_pattern``) and
  ``adapter_model.safetensors`` with ``...layers.{i}.self_attn.q_proj.lora_A.weight`` and
  ``...lora_B.weight``. ``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), per module.
* **GGUF** (llama.cpp's ``convert_lora_to_gguf.py``): ``general.type = adapter``,
  ``adapter.type = lora``, ``adapter.lora.alpha``, tensors ``blk.{i}.attn_q.weight.lora_a``
  (``[r, in]``) and ``.lora_b`` (``[out, r]``). ``scale = alpha / r`` (1 when alpha is 0, as
  llama.cpp). For ``llama``-architecture files the converter permuted the rows of ``lora_b``
  of Q and K as it did the base's; they are put back as the loader does for the base.

Targets are the seven projections of the attention and the MLP (q, k, v, o, gate, up, down);
an adapter of anything else (embeddings, the LM head, DoRA, trained biases) is refused with a
:class:`LoRAError` naming it. :func:`validate_adapter` checks an adapter against the base model
(architecture where the file names one, layer count, every ``A``/``B`` shape, the rank limit).

The **id** of an adapter (:attr:`LoRAAdapter.lora_id`) is a SHA-256 over its effective deltas
(module names, shapes, ``A`` and ``scale * B`` in float32): the same weights give the same id
in every process and on every replica, whatever the file or the served name is called, so KV
cached under it may be shared across them (tiers, replicas); different weights never share an
id. (It hashes the weights as the file stores them: a GGUF and a PEFT copy of one adapter,
whose Q/K rows differ in order, get different ids.)

**Serving many at once** (:class:`LoRAModel`): :func:`install_lora` wraps the four fused
projections of every layer (QKV, O, gate/up, down) in :class:`LoRALinear`, which holds the
adapters of ``max_loras`` slots in stacked buffers in the activation dtype. A forward pass
runs the base projection once over the whole batch (dense or packed quantized weights alike),
then, for each slot present in the step, the low-rank delta over that slot's rows only
(``index_select`` of the rows, two small matmuls, ``index_add_`` back). The rows of each slot
are computed once per step (:meth:`LoRAModel.prepare`), not per layer; no Python loop runs over
sequences inside the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.attention.batch_invariant import tiled_linear

__all__ = ["LoRAAdapter", "LoRAError", "LoRALinear", "LoRAModel", "install_lora",
           "load_adapter", "validate_adapter"]

#: Projection parts an adapter may target, by the fused module that holds them.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "attn.qkv_proj": ("q", "k", "v"),
    "attn.o_proj": ("o",),
    "mlp.gate_up_proj": ("gate", "up"),
    "mlp.down_proj": ("down",),
}
_PART_MODULE = {part: (module, index) for module, parts in FUSED_PARTS.items()
                for index, part in enumerate(parts)}
_PEFT_PARTS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
               "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_GGUF_PARTS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
               "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                       r"(?:\.\w+)?\.weight")
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


class LoRAError(ValueError):
    """An adapter that cannot be used: unreadable, of an unsupported kind, or not made for
    this base model. The message says what is wrong and never names a server path."""


@dataclass
class LoRAAdapter:
    """One adapter's effective weights: ``deltas[(layer, part)] = (A, scale * B)`` in float32.

    ``rank`` is the largest rank of its modules; ``architecture`` the base architecture the
    file names (GGUF), or None where the format does not say (PEFT). ``lora_id`` is the content
    id of the module docstring (computed from the deltas as read, before any permutation).
    """

    name: str
    deltas: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    rank: int
    architecture: str | None = None
    permuted_qk: bool = False
    """Q/K ``B`` rows still in llama.cpp's interleaved order (GGUF adapters of ``llama``
    models until :func:`validate_adapter` puts them back)."""
    lora_id: str = field(init=False)

    def __post_init__(self) -> None:
        if not self.deltas:
            raise LoRAError(f"adapter {self.name!r} has no LoRA weights")
        self.lora_id = _content_id(self.deltas)

    @property
    def num_layers(self) -> int:
        return 1 + max(layer for layer, _ in self.deltas)


def _content_id(deltas: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for (layer, part), (a, b) in sorted(deltas.items()):
        digest.update(f"{layer}.{part}:{tuple(a.shape)}:{tuple(b.shape)};".encode())
        digest.update(a.float().contiguous().numpy().tobytes())
        digest.update(b.float().contiguous().numpy().tobytes())
    return "lora-" + digest.hexdigest()[:32]


# ---------------------------------------------------------------------------- loading
def load_adapter(path: str, name: str) -> LoRAAdapter:
    """Read the adapter at ``path``: a PEFT directory or a GGUF LoRA file."""
    if os.path.isdir(path):
        return _load_peft(path, name)
    if path.endswith(".gguf") and os.path.isfile(path):
        return _load_gguf(path, name)
    raise LoRAError(f"adapter {name!r}: expected a PEFT directory (with {PEFT_CONFIG}) or a "
                    "GGUF LoRA file (.gguf), and found neither")


def _peft_config(path: str, name: str) -> dict[str, object]:
    try:
        with open(os.path.join(path, PEFT_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"adapter {name!r}: cannot read {PEFT_CONFIG} "
                        f"({type(exc).__name__})") from exc
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {name!r}: {PEFT_CONFIG} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    refusals = {
        f"peft_type is {peft_type}, only LORA adapters are supported": peft_type != "LORA",
        "DoRA adapters (use_dora) are not supported": bool(config.get("use_dora")),
        "trained biases (bias != 'none') are not supported":
            config.get("bias", "none") not in ("none", None),
        "modules_to_save (fully trained modules) are not supported":
            bool(config.get("modules_to_save")),
        "fan_in_fan_out weights are not supported": bool(config.get("fan_in_fan_out")),
    }
    for message, refused in refusals.items():
        if refused:
            raise LoRAError(f"adapter {name!r}: {message}")
    return config


def _pattern_value(patterns: object, module: str, default: float) -> float:
    """PEFT's ``rank_pattern``/``alpha_pattern``: the value of the first pattern that matches
    the end of the module's name, else ``default``."""
    if isinstance(patterns, dict):
        for pattern, value in patterns.items():
            if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", module):
                return float(value)
    return default


def _load_peft(path: str, name: str) -> LoRAAdapter:
    from safetensors import SafetensorError, safe_open

    config = _peft_config(path, name)
    alpha = float(config.get("lora_alpha", 8))  # type: ignore[arg-type]
    rslora = bool(config.get("use_rslora"))
    weights = os.path.join(path, PEFT_WEIGHTS)
    if not os.path.isfile(weights):
        raise LoRAError(f"adapter {name!r}: the directory has no {PEFT_WEIGHTS}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[int, str], str] = {}
    try:
        with safe_open(weights, framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle)
                match = _PEFT_KEY.fullmatch(key)
                if match is None or match.group(2) not in _PEFT_PARTS:
                    raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of "
                                    "an attention or MLP projection (q, k, v, o, gate, up, "
                                    "down); other targets are not supported")
                slot = (int(match.group(1)), _PEFT_PARTS[match.group(2)])
                pairs.setdefault(slot, {})[match.group(3)] = handle.get_tensor(key).float()
                modules[slot] = key[: key.index(".lora_")]
    except SafetensorError as exc:
        raise LoRAError(f"adapter {name!r}: cannot read {PEFT_WEIGHTS}: {exc}") from exc
    deltas = {}
    for slot, pair in pairs.items():
        a, b = _pair(pair, "A", "B", slot, name)
        module_alpha = _pattern_value(config.get("alpha_pattern"), modules[slot], alpha)
        rank = a.shape[0]
        scale = module_alpha / (math.sqrt(rank) if rslora else rank)
        deltas[slot] = (a, b * scale)
    return LoRAAdapter(name, deltas, _max_rank(deltas))


def _pair(pair: dict[str, torch.Tensor], a_key: str, b_key: str, slot: tuple[int, str],
          name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if a_key not in pair or b_key not in pair:
        raise LoRAError(f"adapter {name!r}: layer {slot[0]} {slot[1]} has lora_{a_key} or "
                        f"lora_{b_key} but not both")
    a, b = pair[a_key], pair[b_key]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise LoRAError(f"adapter {name!r}: layer {slot[0]} {slot[1]}: A {tuple(a.shape)} and "
                        f"B {tuple(b.shape)} do not make a low-rank pair")
    return a.contiguous(), b.contiguous()


def _max_rank(deltas: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> int:
    return max(a.shape[0] for a, _ in deltas.values()) if deltas else 0


def _load_gguf(path: str, name: str) -> LoRAAdapter:
    from prefixserve.model.weights.gguf_file import GGUFFile

    try:
        gguf = GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"adapter {name!r}: not a readable GGUF file") from exc
    meta = gguf.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoRAError(f"adapter {name!r}: the GGUF file is not a LoRA adapter "
                        "(general.type must be 'adapter' and adapter.type 'lora')")
    architecture = meta.get("general.architecture")
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key in gguf.tensors:
        match = _GGUF_KEY.fullmatch(key)
        if match is None or match.group(2) not in _GGUF_PARTS:
            raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of an "
                            "attention or MLP projection; other targets are not supported")
        slot = (int(match.group(1)), _GGUF_PARTS[match.group(2)])
        pairs.setdefault(slot, {})[match.group(3)] = torch.from_numpy(gguf.read_tensor(key))
    deltas = {}
    for slot, pair in pairs.items():
        a, b = _pair(pair, "a", "b", slot, name)
        scale = alpha / a.shape[0] if alpha else 1.0
        deltas[slot] = (a, b * scale)
    return LoRAAdapter(name, deltas, _max_rank(deltas), architecture=architecture,
                       permuted_qk=architecture == "llama")


# ---------------------------------------------------------------------------- validation
def part_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each targetable projection of the base model."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q),
            "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}


def validate_adapter(adapter: LoRAAdapter, config: ModelConfig, max_rank: int) -> None:
    """Raises :class:`LoRAError` unless ``adapter`` fits the base model of ``config`` and the
    rank limit. A GGUF adapter of a ``llama`` base has its Q/K ``B`` rows put back in place
    here (once)."""
    name = adapter.name
    if adapter.architecture is not None and adapter.architecture != config.architecture:
        raise LoRAError(f"adapter {name!r} was made for a {adapter.architecture!r} model; "
                        f"this server's base model is {config.architecture!r}")
    if adapter.rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {adapter.rank}, above the limit of "
                        f"{max_rank} (--max-lora-rank)")
    if adapter.num_layers > config.num_hidden_layers:
        raise LoRAError(f"adapter {name!r} has weights for layer {adapter.num_layers - 1}; the "
                        f"base model has {config.num_hidden_layers} layers (another base?)")
    shapes = part_shapes(config)
    for (layer, part), (a, b) in adapter.deltas.items():
        out, inp = shapes[part]
        if a.shape[1] != inp or b.shape[0] != out:
            raise LoRAError(f"adapter {name!r}: layer {layer} {part} maps {a.shape[1]} to "
                            f"{b.shape[0]} features; the base model's maps {inp} to {out} "
                            "(an adapter of another base model?)")
    if adapter.permuted_qk:
        _unpermute_qk(adapter, config)


def _unpermute_qk(adapter: LoRAAdapter, config: ModelConfig) -> None:
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
    for (layer, part), (a, b) in list(adapter.deltas.items()):
        if part in heads:
            n = heads[part]
            rows = b.reshape(n, b.shape[0] // n // 2, 2, b.shape[1]).transpose(1, 2)
            adapter.deltas[(layer, part)] = (a, rows.reshape(b.shape).contiguous())
    adapter.permuted_qk = False


# ---------------------------------------------------------------------------- batched deltas
class LoRABatch:
    """The rows of each adapter slot in the current step, shared by every :class:`LoRALinear`
    of a model: ``groups`` is a list of ``(slot, rows)``, ``rows`` an index tensor of the
    flattened batch, or None when the slot covers every row."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []


class LoRALinear(nn.Module):
    """A projection (``nn.Linear`` or ``QuantLinear``) plus the LoRA deltas of its slots.

    ``lora_a[s]`` is ``[parts * max_rank, in]`` and ``lora_bt[s]`` ``[parts * max_rank, out]``
    (``scale * B`` transposed, zero outside each part's output columns): part p of an adapter
    of rank r occupies rows ``[p * r, p * r + r_p)`` of both, so one pair of matmuls computes
    the delta of a fused projection (QKV, gate/up). ``used[s]`` is how many rows slot s fills
    (0: the slot's adapter leaves this projection alone). With ``row_invariant`` (the
    deterministic mode) both products run in fixed row tiles (``batch_invariant.tiled_linear``),
    so a row's delta does not depend on how many rows share its slot in the step.

    The fused decode step (``kernels/decode.c``) reads the same slots in float32
    (:meth:`float_buffers`: the buffers themselves in a float32 model, copies kept in step
    by :meth:`set_slot` otherwise) and ``used_counts``, ``used`` as an int64 tensor.
    """

    lora_a: torch.Tensor
    lora_bt: torch.Tensor

    def __init__(self, base: nn.Module, in_features: int, part_sizes: tuple[int, ...],
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.part_sizes = part_sizes
        self.max_rank = max_rank
        self.batch = batch
        rows, out = len(part_sizes) * max_rank, sum(part_sizes)
        self.register_buffer("lora_a", torch.zeros(max_loras, rows, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_bt", torch.zeros(max_loras, rows, out, dtype=dtype,
                                                    device=device), persistent=False)
        self.used = [0] * max_loras
        self.used_counts = torch.zeros(max_loras, dtype=torch.int64)
        self.row_invariant = False
        self._float: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self.batch.groups:
            used = self.used[slot]
            if not used:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            if self.row_invariant:
                low = tiled_linear(xs, self.lora_a[slot, :used])
                delta = tiled_linear(low, self.lora_bt[slot, :used].t())
            else:
                delta = (xs @ self.lora_a[slot, :used].t()) @ self.lora_bt[slot, :used]
            if rows is None:
                y += delta
            else:
                y.index_add_(0, rows, delta)
        return y

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None],
                 rank: int) -> None:
        """Puts an adapter's pairs (one per part, None for a part it leaves alone) of rank at
        most ``rank`` into ``slot``; all None clears the slot."""
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()
        self._set_used(slot, 0)
        if all(pair is None for pair in parts):
            return
        col = 0
        for index, (size, pair) in enumerate(zip(self.part_sizes, parts, strict=True)):
            if pair is not None:
                a, b = pair
                first = index * rank
                self.lora_a[slot, first:first + a.shape[0]] = a
                self.lora_bt[slot, first:first + a.shape[0], col:col + size] = b.t()
            col += size
        self._set_used(slot, len(self.part_sizes) * rank)

    def _set_used(self, slot: int, rows: int) -> None:
        self.used[slot] = rows
        self.used_counts[slot] = rows
        if self._float is not None:  # the float32 copies of a model of another dtype
            self._float[0][slot] = self.lora_a[slot]
            self._float[1][slot] = self.lora_bt[slot]

    def float_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``lora_a`` and ``lora_bt`` in float32 (on the CPU), contiguous: the buffers
        themselves in a float32 model, else copies that :meth:`set_slot` keeps up to date
        from the first call on."""
        if self.lora_a.dtype == torch.float32:
            return self.lora_a, self.lora_bt
        if self._float is None:  # (normal tensors, even when asked in a step: set_slot
            with torch.inference_mode(False):  # writes into them outside inference mode)
                self._float = (self.lora_a.float().contiguous(),
                               self.lora_bt.float().contiguous())
        return self._float


class LoRAModel:
    """The :class:`LoRALinear` modules of one model and the slots they share."""

    def __init__(self, modules: dict[tuple[int, str], LoRALinear], batch: LoRABatch,
                 max_loras: int, max_rank: int, device: torch.device) -> None:
        self.modules = modules
        self.batch = batch
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device

    def load_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Copies ``adapter``'s weights into ``slot`` (None: empties it). The adapter must have
        passed :func:`validate_adapter`."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} out of range [0, {self.max_loras})")
        rank = adapter.rank if adapter is not None else 0
        for (layer, module_name), module in self.modules.items():
            parts = [None if adapter is None else adapter.deltas.get((layer, part))
                     for part in FUSED_PARTS[module_name]]
            module.set_slot(slot, parts, rank)

    def prepare(self, slots: list[int | None], lengths: list[int]) -> None:
        """Sets the step's row groups: sequence i has ``lengths[i]`` rows and runs under
        adapter ``slots[i]`` (None: the base model)."""
        present = {s for s in slots if s is not None}
        if not present:
            self.batch.groups = []
            return
        if len(present) == 1 and None not in slots:
            self.batch.groups = [(present.pop(), None)]
            return
        rows: dict[int, list[int]] = {s: [] for s in present}
        offset = 0
        for slot, length in zip(slots, lengths, strict=True):
            if slot is not None:
                rows[slot].extend(range(offset, offset + length))
            offset += length
        self.batch.groups = [(s, torch.tensor(r, dtype=torch.long, device=self.device))
                             for s, r in sorted(rows.items())]

    def clear_batch(self) -> None:
        self.batch.groups = []


def _fused_modules(model: nn.Module) -> Iterator[tuple[int, str, nn.Module, str, nn.Module]]:
    """``(layer index, fused name, parent module, attribute, projection)`` of each target."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise LoRAError("this model has no decoder layers to put adapters on")
    for index, layer in enumerate(layers):
        for fused in FUSED_PARTS:
            parent_name, _, attr = fused.rpartition(".")
            parent = layer.get_submodule(parent_name)
            yield index, fused, parent, attr, getattr(parent, attr)


def install_lora(model: nn.Module, config: ModelConfig, max_loras: int,
                 max_rank: int, row_invariant: bool = False) -> LoRAModel:
    """Wraps the fused projections of ``model`` in :class:`LoRALinear` (in place) with
    ``max_loras`` empty slots of rank up to ``max_rank``, in the activation dtype of the model
    (that of its final norm); ``row_invariant`` for the deterministic mode."""
    if max_loras < 1 or max_rank < 1:
        raise ValueError("max_loras and max_lora_rank must be positive")
    norm_weight = model.get_parameter("norm.weight")
    dtype, device = norm_weight.dtype, norm_weight.device
    shapes = part_shapes(config)
    batch = LoRABatch()
    modules: dict[tuple[int, str], LoRALinear] = {}
    for index, fused, parent, attr, base in _fused_modules(model):
        parts = FUSED_PARTS[fused]
        sizes = tuple(shapes[p][0] for p in parts)
        wrapped = LoRALinear(base, shapes[parts[0]][1], sizes, max_loras, max_rank, dtype,
                             device, batch)
        wrapped.row_invariant = row_invariant
        setattr(parent, attr, wrapped)
        modules[(index, fused)] = wrapped
    return LoRAModel(modules, batch, max_loras, max_rank, device)


def merged_weight(weight: torch.Tensor, adapter: LoRAAdapter, config: ModelConfig, layer: int,
                  fused: str) -> torch.Tensor:
    """``W + scale * B A`` for a dense fused weight ``[out, in]``: the adapter merged into the
    base, the reference the batched deltas are tested against."""
    shapes = part_shapes(config)
    merged = weight.clone()
    start = 0
    for part in FUSED_PARTS[fused]:
        size = shapes[part][0]
        pair = adapter.deltas.get((layer, part))
        if pair is not None:
            a, b = pair
            merged[start:start + size] += (b @ a).to(merged.dtype)
        start += size
    return merged
