"""Load a model (config + weights) from a GGUF file or an HF safetensors directory.

``weights`` chooses how matmul weights are held (:data:`WEIGHT_MODES`): ``auto`` keeps a GGUF
file's quantized tensors packed in memory (see :mod:`prefixserve.model.weights.quant`) and
everything
else dense; ``int8`` / ``int4`` pack every matmul weight as Q8_0 / Q4_1 (safetensors weights are
quantized at load); ``bf16`` dequantizes everything to dense tensors of the model's ``dtype``
(the pre-quantization path; on a CPU without native bfloat16 that dtype is float32). Off the CPU
(CUDA) every mode loads dense weights, the kernels being CPU code; on a CPU where the kernels
cannot be built, ``auto`` falls back to dense weights and ``int8`` / ``int4`` fail. Dense
GGUF tensors are dequantised to float32 with ``gguf.quants.dequantize`` and then cast to the
requested dtype. llama.cpp's converter reorders the rows of the Q and K projections of
``llama``-architecture models (it interleaves the two rotary halves of each head for its rope
kernel); :func:`_unpermute_into` undoes that so the model can use HF's "rotate half" rope.
Qwen2/Qwen3 GGUF files are not permuted.

Q/K/V and gate/up weights are fused at load (see :mod:`prefixserve.model.arch.llama`); parts of
formats that do not convert exactly into one another stay side by side (:class:`PackedParts`).

A GGUF file is memory-mapped (:class:`GGUFFile`), not read into memory. A packed weight kept as
the file holds it, neither fused nor permuted (o_proj, down_proj, the embedding and the head,
when their type is kept byte for byte) is a tensor viewing the file's pages: they count as
mapped file pages, not anonymous memory, and the page cache shares them between processes that
load the file. Fused and unpermuted weights are built from the map in one copy (a part that is
converted or requantized first, in two); once such a weight, or a dequantized one, is built,
the pages it was read from leave the process's resident set (:func:`_page_releaser`), and so
do the header's once it is parsed. With ``layout="stream"`` (the default) Q4_0 weights that fit
it are moved into the stream layout (:func:`quant.stream_layout`), copies too, whose pages are
released once the model is built (:func:`_release_unviewed`).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from typing import cast

import numpy as np
import torch
from torch import nn

from prefixserve.model.arch.config import (
    WEIGHT_MODES,
    ModelConfig,
    default_model_path,
    resolve_model_path,
)
from prefixserve.model.arch.gemma3 import model_class
from prefixserve.model.arch.llama import CausalLM
from prefixserve.model.pages import base_page_area
from prefixserve.model.vision.loader import decoder_names
from prefixserve.model.weights import quant_kernels
from prefixserve.model.weights.gguf_file import GGUFFile
from prefixserve.model.weights.quant import (
    FMT_Q4_0,
    FMT_Q4_1,
    FMT_Q8_0,
    PackedParts,
    PackedWeight,
    QuantEmbedding,
    QuantLinear,
    SplitQuantLinear,
    WeightArena,
    dequantize_packed,
    pack_float,
    pack_gguf,
    q4_0_to_q4_1,
    share_amx_rows,
)
from prefixserve.model.weights.safetensors_dir import safetensors_owners

__all__ = ["WEIGHT_MODES", "default_model_path", "load_model"]

logger = logging.getLogger("prefixserve.model")

_TARGETS = {"auto": None, "int8": FMT_Q8_0, "int4": FMT_Q4_1}

#: A file's tensor as the loader reads it: dense, or packed.
Part = torch.Tensor | PackedWeight
#: An entry of the state dict: a part, or a fused projection of packed parts in several formats.
Weight = Part | PackedParts
TensorSource = Callable[[str], torch.Tensor]
WeightSource = Callable[[str], Part]


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    weights: str = "auto",
    gguf: GGUFFile | None = None,
    layout: str = "stream",
) -> tuple[ModelConfig, CausalLM]:
    """Load ``model`` (a ``.gguf`` path, an HF directory, or None for the default model;
    ``gguf``: its GGUF file already opened).

    Returns the config and a :class:`CausalLM` in eval mode with activations in ``dtype`` on
    ``device`` and matmul weights held as ``weights`` says (see the module docstring), packed
    Q4_0 ones in the stream layout where ``layout`` is ``stream`` and they fit it. Raises
    ValueError for an unsupported architecture, an unknown ``weights`` mode or a weight set
    that does not match the config (missing or unexpected tensors), RuntimeError when
    ``int8``/``int4`` is asked for and the kernels cannot be built.
    """
    path = resolve_model_path(model)
    device = torch.device(device)
    packing = _packing_mode(weights, device)
    arena = WeightArena()
    if path.endswith(".gguf"):
        gguf = gguf or GGUFFile(path)
        config, state, freq_factors = _gguf_state(gguf, dtype, device, packing, arena)
    else:
        config, state = _hf_state(path, dtype, device, packing, arena)
        freq_factors = None
    with torch.device("meta"):
        net = model_class(config)(config)
    _install_packed(net, state, dtype, arena, stream=layout == "stream")
    share_amx_rows(net.layers)
    net.load_state_dict(state, strict=True, assign=True)
    net.to(device)
    if gguf is not None:  # the stream layout copied after the state was built
        _release_unviewed(gguf, gguf.tensors, (*net.parameters(), *net.buffers()))
    if freq_factors is not None:
        net.set_rope_freq_factors(freq_factors)
    net.requires_grad_(False)
    net.eval()
    return config, net


def _packing_mode(weights: str, device: torch.device) -> str | None:
    """``weights`` resolved for this device: None (dense), ``auto``, ``int8`` or ``int4``."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    if weights == "bf16" or device.type != "cpu":
        return None
    if quant_kernels.kernels() is None:
        if weights == "auto":
            return None
        raise RuntimeError(f"--weights {weights} needs the quantized kernels, which could not "
                           f"be built: {quant_kernels.build_error()}")
    return weights


def _install_packed(net: CausalLM, state: dict[str, Weight], dtype: torch.dtype,
                    arena: WeightArena, stream: bool = True) -> None:
    """Swap the modules whose weight in ``state`` is packed for quantized ones (in place), Q4_0
    ones that fit it in the stream layout where ``stream`` (:func:`quant.stream_layout`); the
    weights that are copies (that layout's, fused Q4_0 stacks) into the model's ``arena``
    (:class:`~prefixserve.model.weights.quant.WeightArena`: huge pages), where the other
    stacks were built.

    The packed entries leave ``state``; a bias stays there for ``load_state_dict``.
    """
    for key in [k for k, v in state.items() if isinstance(v, (PackedWeight, PackedParts))]:
        packed = state.pop(key)
        parent_name, _, attr = key.removesuffix(".weight").rpartition(".")
        parent = net.get_submodule(parent_name) if parent_name else net
        old = getattr(parent, attr)
        new: nn.Module
        if isinstance(packed, PackedParts):
            new = SplitQuantLinear(packed, bias=old.bias is not None, stream=stream,
                                   arena=arena)
        elif isinstance(old, nn.Embedding):
            new = QuantEmbedding(cast(PackedWeight, packed), dtype, stream=stream, arena=arena)
        else:
            new = QuantLinear(cast(PackedWeight, packed), bias=old.bias is not None,
                              stream=stream, arena=arena)
        setattr(parent, attr, new)


def _cat(parts: list[Part], heads: Sequence[int | None] = (),
         arena: WeightArena | None = None) -> Weight:
    """Fuse projections row-wise into one new weight, each part copied once (:func:`_stack`);
    part ``j`` is unpermuted (:func:`_unpermute_into`) for ``heads[j]`` heads where that is
    given and not None; packed stacks in ``arena`` where :func:`_stack_packed` says.

    Q4_0 parts beside Q4_1 ones become Q4_1 (exactly); packed parts of other different formats
    stay as they are, side by side (:class:`PackedParts`: neighbours of one format stacked, a
    lone part that needs no unpermuting left where it lies); a mix of packed and dense parts
    becomes dense.
    """
    if all(isinstance(p, torch.Tensor) for p in parts):
        return _stack([p for p in parts if isinstance(p, torch.Tensor)], heads)
    if any(isinstance(p, torch.Tensor) for p in parts):
        dense = [p if isinstance(p, torch.Tensor) else dequantize_packed(p) for p in parts]
        dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
        return _stack(dense, heads, dtype)
    packed = [p for p in parts if isinstance(p, PackedWeight)]
    if {p.fmt for p in packed} == {FMT_Q4_0, FMT_Q4_1}:  # Q4_0 is Q4_1 exactly
        packed = [q4_0_to_q4_1(p.data.numpy(), p.cols) if p.fmt == FMT_Q4_0 else p
                  for p in packed]
    if any(p.cols != packed[0].cols for p in packed):
        raise ValueError("cannot fuse packed weights of different widths")
    runs: list[list[int]] = []  # indices of neighbouring parts of one format
    for j, part in enumerate(packed):
        if runs and packed[runs[-1][0]].fmt == part.fmt:
            runs[-1].append(j)
        else:
            runs.append([j])
    stacked = [_stack_packed([packed[j] for j in run],
                             [heads[j] if j < len(heads) else None for j in run], arena)
               for run in runs]
    return stacked[0] if len(stacked) == 1 else PackedParts(stacked)


def _stack_packed(parts: list[PackedWeight], heads: list[int | None],
                  arena: WeightArena | None = None) -> PackedWeight:
    """Packed parts of one format stacked (:func:`_stack`), or a lone part that needs no
    unpermuting as it is. A stack is built in ``arena`` (the model's huge pages, where it
    stays), except a Q4_0 one or one without an arena: that stack is ``copied``, in a mapping
    of its own, and :class:`QuantLinear` moves it (or its stream layout, which a Q4_0 stack
    may take) into the arena; the mapping is unmapped when it is freed (the heap would keep
    its pages)."""
    if len(parts) == 1 and not heads[0]:
        return parts[0]
    data = [p.data for p in parts]
    if arena is not None and parts[0].fmt != FMT_Q4_0 and data[0].device.type == "cpu":
        rows = sum(p.shape[0] for p in data)
        out = arena.take(rows * data[0].shape[1]).view(rows, data[0].shape[1])
        return PackedWeight(parts[0].fmt, _stack(data, heads, out=out), parts[0].cols)
    stacked = _stack(data, heads, mapped=True)
    return PackedWeight(parts[0].fmt, stacked, parts[0].cols, copied=True)


def _stack(parts: list[torch.Tensor], heads: Sequence[int | None] = (),
           dtype: torch.dtype | None = None, mapped: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``parts`` (dense values, or packed rows) stacked along rows in a new tensor of ``dtype``
    (default: the first part's), each copied once, straight from where it lies (a view of the
    file's pages, say): part ``j`` unpermuted for ``heads[j]`` heads where given. ``mapped``:
    the tensor in a mapping of base-size pages of its own (CPU tensors; ``pages.py``); ``out``:
    in that tensor (of the stack's shape and dtype)."""
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    dtype = dtype or parts[0].dtype
    if out is not None:
        assert out.shape == shape and out.dtype == dtype
    elif mapped and parts[0].device.type == "cpu":
        nbytes = math.prod(shape) * dtype.itemsize
        area = base_page_area(nbytes)
        out = torch.frombuffer(area, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    else:
        out = torch.empty(shape, dtype=dtype, device=parts[0].device)
    first = 0
    for j, part in enumerate(parts):
        dest = out[first:first + part.shape[0]]
        num_heads = heads[j] if j < len(heads) else None
        if num_heads:
            _unpermute_into(dest, part, num_heads)
        else:
            dest.copy_(part)
        first += part.shape[0]
    return out


def _unpermute_into(dest: torch.Tensor, weight: torch.Tensor, num_heads: int) -> None:
    """Copy ``weight`` (rows first) into ``dest`` undoing llama.cpp's Q/K row permutation.

    Within each head, HF row ``half * head_dim / 2 + j`` was stored at row ``2 * j + half``.
    Packed weights move whole packed rows.
    """
    half = weight.shape[0] // num_heads // 2
    rest = weight.shape[1:]
    stored = weight.reshape(num_heads, half, 2, *rest).transpose(1, 2)
    dest.view(num_heads, 2, half, *rest).copy_(stored)


def _assemble(
    config: ModelConfig,
    get: TensorSource,
    names: dict[str, str],
    unpermute: bool,
    get_weight: WeightSource | None = None,
    settle: Callable[[dict[str, Weight]], None] | None = None,
    arena: WeightArena | None = None,
) -> dict[str, Weight]:
    """Our state dict from a source of tensors, given the source's naming of each part.

    ``names`` maps part keys (``embed``, ``norm``, ``lm_head``, and per-layer ``q``, ``k``,
    ``v``, ``o``, ``q_bias``, ``k_bias``, ``v_bias``, ``o_bias``, ``q_norm``, ``k_norm``,
    ``input_norm``, ``post_norm``, ``gate``, ``up``, ``down`` with ``{i}`` for the layer, plus
    ``gate_bias``, ``up_bias``, ``down_bias``) to source tensor names. ``get_weight`` (default
    ``get``) reads the matmul weights, which may come back packed. ``settle`` (if given) is
    called with each group of entries once it is built: the embedding, norm and head, then
    each layer's. Packed stacks are built in ``arena`` where given (:func:`_stack_packed`).
    """
    weight = get_weight or get
    state: dict[str, Weight] = {
        "embed_tokens.weight": weight(names["embed"]),
        "norm.weight": get(names["norm"]),
    }
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = weight(names["lm_head"])
    if settle is not None:
        settle(state)
    for i in range(config.num_hidden_layers):
        layer = _layer_state(config, i, names, get, weight, unpermute, arena)
        if settle is not None:
            settle(layer)
        state.update(layer)
    return state


def _layer_state(config: ModelConfig, i: int, names: dict[str, str], get: TensorSource,
                 weight: WeightSource | TensorSource, unpermute: bool,
                 arena: WeightArena | None = None) -> dict[str, Weight]:
    """Layer ``i``'s entries of the state dict (see :func:`_assemble`)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def part(key: str) -> torch.Tensor:
        return get(names[key].format(i=i))

    def matrix(key: str) -> Part:
        return weight(names[key].format(i=i))

    def qkv(suffix: str) -> Weight:
        read = matrix if suffix == "" else part
        parts = [read("q" + suffix), read("k" + suffix), read("v" + suffix)]
        return _cat(parts, (heads, kv_heads) if unpermute else (), arena)

    prefix = f"layers.{i}."
    state: dict[str, Weight] = {
        prefix + "input_norm.weight": part("input_norm"),
        prefix + "post_attn_norm.weight": part("post_norm"),
        prefix + "attn.qkv_proj.weight": qkv(""),
        prefix + "attn.o_proj.weight": matrix("o"),
        prefix + "mlp.gate_up_proj.weight": _cat([matrix("gate"), matrix("up")], arena=arena),
        prefix + "mlp.down_proj.weight": matrix("down"),
    }
    if config.attention_bias:
        state[prefix + "attn.qkv_proj.bias"] = qkv("_bias")  # biases are never packed
    if config.attention_out_bias:
        state[prefix + "attn.o_proj.bias"] = part("o_bias")
    if config.mlp_bias:
        state[prefix + "mlp.gate_up_proj.bias"] = torch.cat((part("gate_bias"), part("up_bias")))
        state[prefix + "mlp.down_proj.bias"] = part("down_bias")
    if config.qk_norm:
        state[prefix + "attn.q_norm.weight"] = part("q_norm")
        state[prefix + "attn.k_norm.weight"] = part("k_norm")
    if config.architecture == "gemma3":
        state[prefix + "post_attn_out_norm.weight"] = part("post_attn_out_norm")
        state[prefix + "post_mlp_norm.weight"] = part("post_mlp_norm")
    return state


# Gemma 3: four norms per layer; "post_norm" is the one before the MLP.
_GEMMA3_GGUF_NAMES = {
    "post_attn_out_norm": "blk.{i}.post_attention_norm.weight",
    "post_mlp_norm": "blk.{i}.post_ffw_norm.weight",
}
_GEMMA3_HF_NAMES = {
    "post_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_attn_out_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "post_mlp_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}


def _names(config: ModelConfig, base: dict[str, str], gemma: dict[str, str]) -> dict[str, str]:
    return {**base, **gemma} if config.architecture == "gemma3" else base


_GGUF_NAMES = {
    "embed": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "o_bias": "blk.{i}.attn_output.bias",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "input_norm": "blk.{i}.attn_norm.weight",
    "post_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "gate_bias": "blk.{i}.ffn_gate.bias",
    "up_bias": "blk.{i}.ffn_up.bias",
    "down_bias": "blk.{i}.ffn_down.bias",
}

_HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "o_bias": "model.layers.{i}.self_attn.o_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "gate_bias": "model.layers.{i}.mlp.gate_proj.bias",
    "up_bias": "model.layers.{i}.mlp.up_proj.bias",
    "down_bias": "model.layers.{i}.mlp.down_proj.bias",
}


def _tracking_source(
    available: set[str],
    read: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[TensorSource, set[str]]:
    """A tensor getter that casts to ``dtype``/``device`` and records which names it served."""
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        if name not in available:
            raise ValueError(f"weights lack tensor {name!r}")
        used.add(name)
        return read(name).to(device=device, dtype=dtype)

    return get, used


def _check_all_used(available: set[str], used: set[str], ignorable: set[str], path: str) -> None:
    unexpected = sorted(available - used - ignorable)
    if unexpected:
        shown = ", ".join(unexpected[:5])
        raise ValueError(f"{path}: {len(unexpected)} unexpected tensors, e.g. {shown}")


def _tensors_of(weight: Weight) -> list[torch.Tensor]:
    """The tensors that hold ``weight``'s values or packed bytes."""
    if isinstance(weight, PackedParts):
        return [part.data for part in weight.parts]
    return [weight.data if isinstance(weight, PackedWeight) else weight]


def _page_releaser(gguf: GGUFFile, used: set[str]) -> Callable[[dict[str, Weight]], None]:
    """A ``settle`` callback for :func:`_assemble`: given the entries built since its last
    call, it releases (:meth:`GGUFFile.release`) the pages of every tensor read since then
    that none of them views, i.e. that was copied (fused, unpermuted, converted, requantized
    or dequantized), so that only the pages of weights kept as views of the file stay
    mapped into this process once they are read."""
    settled: set[str] = set()

    def settle(entries: dict[str, Weight]) -> None:
        _release_unviewed(gguf, used - settled,
                          [t for w in entries.values() for t in _tensors_of(w)])
        settled.update(used)

    return settle


def _release_unviewed(gguf: GGUFFile, names: Iterable[str],
                      tensors: Iterable[torch.Tensor]) -> None:
    """Releases (:meth:`GGUFFile.release`) the pages of each of the file's tensors ``names``
    that none of ``tensors`` views (it was copied, or not used)."""
    starts = [t.data_ptr() for t in tensors]
    for name in names:
        raw = gguf.read_raw(name)
        low = raw.ctypes.data
        if not any(low <= start < low + raw.nbytes for start in starts):
            gguf.release(*gguf.span(name))


def _gguf_state(
    gguf: GGUFFile, dtype: torch.dtype, device: torch.device, packing: str | None,
    arena: WeightArena | None = None,
) -> tuple[ModelConfig, dict[str, Weight], torch.Tensor | None]:
    available = set(gguf.tensors)
    config = ModelConfig.from_gguf_metadata(gguf.metadata, available)
    gguf.release(0, gguf.data_start)  # the header: parsed

    def read(name: str) -> torch.Tensor:
        return torch.from_numpy(gguf.read_tensor(name))

    get, used = _tracking_source(available, read, dtype, device)

    requantized: Counter[str] = Counter()

    def get_weight(name: str) -> Part:
        info = gguf.tensors.get(name)
        if packing is None or info is None or len(info.shape) != 2:
            return get(name)

        def values() -> np.ndarray:
            from gguf.constants import GGMLQuantizationType

            requantized[GGMLQuantizationType(info.ggml_type).name] += 1
            return gguf.read_tensor(name)

        packed = pack_gguf(gguf.read_raw(name), info.ggml_type, info.shape[1], values,
                           _TARGETS[packing])
        if packed is None:
            return get(name)
        used.add(name)
        return packed

    names = _names(config, _GGUF_NAMES, _GEMMA3_GGUF_NAMES)
    state = _assemble(config, get, names, config.architecture == "llama", get_weight,
                      _page_releaser(gguf, used), arena)
    why = "no kernel for the type" if packing in (None, "auto") else f"--weights {packing}"
    for type_name, count in sorted(requantized.items()):
        logger.info("%d %s tensors requantized (%s)", count, type_name, why)
    freq_factors = read("rope_freqs.weight") if "rope_freqs.weight" in available else None
    _check_all_used(available, used, {"rope_freqs.weight"}, gguf.path)
    return config, state, freq_factors


def _hf_state(
    path: str, dtype: torch.dtype, device: torch.device, packing: str | None,
    arena: WeightArena | None = None,
) -> tuple[ModelConfig, dict[str, Weight]]:
    config = ModelConfig.from_hf_dir(path)
    with ExitStack() as stack:
        owner = safetensors_owners(path, stack)

        def read(name: str) -> torch.Tensor:
            return owner[name].get_tensor(name)

        available = set(owner)
        get, used = _tracking_source(available, read, dtype, device)
        target = _TARGETS.get(packing or "auto")

        def get_weight(name: str) -> Part:
            if target is None or name not in available:
                return get(name)
            tensor = read(name)
            if tensor.dim() != 2 or tensor.shape[1] % 32:
                return get(name)
            used.add(name)
            return pack_float(tensor.float().numpy(), target)

        names, encoder_tensors = decoder_names(_names(config, _HF_NAMES, _GEMMA3_HF_NAMES),
                                               available)  # a LLaVA model's decoder
        state = _assemble(config, get, names, False, get_weight, arena=arena)
        if config.architecture == "gemma3":  # HF stores w of Gemma's (1 + w) norms
            for key in [k for k in state if "norm" in k]:
                norm = state[key]
                assert isinstance(norm, torch.Tensor)
                state[key] = norm + 1
    ignorable = encoder_tensors | {n for n in available if n.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        ignorable.add("lm_head.weight")
    _check_all_used(available, used, ignorable, path)
    return config, state
