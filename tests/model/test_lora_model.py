"""LoRA adapters in the model layer: loading, validation and the batched delta.

References are the ``peft`` library's own forward pass over the HF model (the adapter active,
which is the base with ``W + scale * B A``), or our own model with the adapter merged into its
weights. Every comparison is float32 with ``atol = rtol = 1e-4`` (logits are O(1)-O(10)).
Tiny random-weight Llama / Qwen3 models, as in ``test_model_loader.py``, whose builders and GGUF
writer are reused here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from model_helpers import build, llama_cpp_permute, write_gguf
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.llama import CausalLM
from prefixserve.model.arch.lora import (
    FUSED_PARTS,
    LoRAAdapter,
    LoRAError,
    install_lora,
    load_adapter,
    merged_weight,
    validate_adapter,
)
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.weights.loader import load_model

TOL = {"atol": 1e-4, "rtol": 1e-4}
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_TO_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                "down_proj": "ffn_down"}


def make_peft(hf: PreTrainedModel, path: Path, seed: int, **config: object) -> PreTrainedModel:
    """Saves a PEFT adapter of ``hf`` with random A and B (PEFT starts B at zero) to ``path``
    and returns the PEFT model (on a copy of ``hf``) with it active."""
    settings: dict[str, object] = {"r": 4, "lora_alpha": 8, "target_modules": ALL_TARGETS}
    settings.update(config)
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(**settings))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(str(path))
    return peft_model.eval()


def logits_of(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def run(runner: ModelRunner, seqs: list[tuple[list[int], int | None]]) -> list[torch.Tensor]:
    """Prompt logits of each ``(ids, lora_slot)`` in one step; blocks laid out one after
    another."""
    per = 64 // runner.block_size
    batch = [SeqBatchInput(ids, 0, list(range(i * per, (i + 1) * per)), need_prompt_logits=True,
                           lora_slot=slot) for i, (ids, slot) in enumerate(seqs)]
    out = runner.execute(batch).prompt_logits
    return [t for t in out if t is not None]


class Setup(NamedTuple):
    hf: PreTrainedModel
    config: ModelConfig
    model: CausalLM
    runner: ModelRunner
    peft_a: PreTrainedModel
    peft_b: PreTrainedModel
    adapter_a: LoRAAdapter
    adapter_b: LoRAAdapter
    dirs: tuple[Path, Path]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """A tiny llama (safetensors), two PEFT adapters (plain; rsLoRA with an alpha pattern and
    fewer targets), our model with 3 slots and both adapters in slots 0 and 2."""
    root = tmp_path_factory.mktemp("lora")
    hf = build("llama", seed=3)
    hf.save_pretrained(root / "base")
    peft_a = make_peft(hf, root / "a", seed=4)
    peft_b = make_peft(hf, root / "b", seed=5, r=8, lora_alpha=4, use_rslora=True,
                       target_modules=["q_proj", "v_proj", "down_proj", "up_proj"],
                       alpha_pattern={"down_proj": 16})
    config, model = load_model(str(root / "base"), torch.float32)
    lora = install_lora(model, config, max_loras=3, max_rank=8)
    runner = ModelRunner(config, model, 64, 4, torch.float32, "cpu")
    runner.lora = lora
    adapters = []
    for name, slot in (("a", 0), ("b", 2)):
        adapter = load_adapter(str(root / name), name)
        validate_adapter(adapter, config, max_rank=8)
        lora.load_slot(slot, adapter)
        adapters.append(adapter)
    return Setup(hf, config, model, runner, peft_a, peft_b, adapters[0], adapters[1],
                 (root / "a", root / "b"))


IDS_1 = [5, 17, 99, 3, 42, 8, 77, 12, 1, 64, 33]
IDS_2 = [9, 9, 120, 4, 56, 71, 2]
IDS_3 = [100, 3, 27, 88, 6]


def test_peft_adapter_matches_peft(setup: Setup) -> None:
    """Kills: a wrong scale (alpha / r), A and B swapped or transposed, a fused part put in the
    wrong rows (q's delta on k), the delta left out of one projection."""
    [ours] = run(setup.runner, [(IDS_1, 0)])
    torch.testing.assert_close(ours, logits_of(setup.peft_a, IDS_1), **TOL)
    assert not torch.allclose(ours, logits_of(setup.hf, IDS_1), atol=1e-2)


def test_rslora_and_alpha_pattern_match_peft(setup: Setup) -> None:
    """Kills: rsLoRA's alpha / sqrt(r) read as alpha / r, an alpha_pattern ignored, untargeted
    parts given a delta."""
    [ours] = run(setup.runner, [(IDS_2, 2)])
    torch.testing.assert_close(ours, logits_of(setup.peft_b, IDS_2), **TOL)


def test_two_adapters_and_base_in_one_batch(setup: Setup) -> None:
    """Each sequence of one step gets its own adapter's delta, on its rows only. Kills: the
    delta of one slot added to every row, rows of a group mis-indexed, the base rows touched."""
    ours = run(setup.runner, [(IDS_1, 0), (IDS_2, None), (IDS_3, 2), (IDS_2, 0)])
    refs = [logits_of(setup.peft_a, IDS_1), logits_of(setup.hf, IDS_2),
            logits_of(setup.peft_b, IDS_3), logits_of(setup.peft_a, IDS_2)]
    for got, want in zip(ours, refs, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_matches_our_own_merged_weights(setup: Setup) -> None:
    """The batched delta equals our model with ``W + scale * B A`` put into its weights."""
    config, merged = load_model(str(setup.dirs[0].parent / "base"), torch.float32)
    with torch.no_grad():
        for index, layer in enumerate(merged.layers):
            for fused in FUSED_PARTS:
                linear = layer.get_submodule(fused)
                linear.weight.copy_(
                    merged_weight(linear.weight, setup.adapter_a, config, index, fused))
    merged_runner = ModelRunner(config, merged, 64, 4, torch.float32, "cpu")
    [want] = run(merged_runner, [(IDS_3, None)])
    [got] = run(setup.runner, [(IDS_3, 0)])
    torch.testing.assert_close(got, want, **TOL)


def test_content_id_is_stable_and_distinct(setup: Setup, tmp_path: Path) -> None:
    """The id depends on the weights only: a copy under another name and path has the same
    id; other weights another. Kills: an id from a counter, the name or the path."""
    a_dir = setup.dirs[0]
    copy_dir = tmp_path / "renamed"
    copy_dir.mkdir()
    for file in a_dir.iterdir():
        (copy_dir / file.name).write_bytes(file.read_bytes())
    again = load_adapter(str(copy_dir), "other-name")
    assert again.lora_id == setup.adapter_a.lora_id
    assert setup.adapter_a.lora_id != setup.adapter_b.lora_id
    assert setup.adapter_a.lora_id.startswith("lora-")


def write_gguf_lora(peft_dir: Path, path: Path, arch: str, heads: int, kv_heads: int,
                    alpha: float) -> None:
    """The PEFT adapter as llama.cpp's converter writes it: ``lora_a`` [r, in], ``lora_b``
    [out, r] with Q/K rows permuted for llama models."""
    tensors = load_file(str(peft_dir / "adapter_model.safetensors"))
    writer = GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for key, value in sorted(tensors.items()):
        layer = int(key.split("layers.")[1].split(".")[0])
        module = next(m for m in PEFT_TO_GGUF if f".{m}." in key)
        kind = "a" if ".lora_A." in key else "b"
        array = value.float().numpy()
        if kind == "b" and arch == "llama" and module in ("q_proj", "k_proj"):
            array = llama_cpp_permute(array, heads if module == "q_proj" else kv_heads)
        name = f"blk.{layer}.{PEFT_TO_GGUF[module]}.weight.lora_{kind}"
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_lora_on_gguf_llama_matches_peft(setup: Setup, tmp_path: Path) -> None:
    """A llama.cpp GGUF adapter on a GGUF llama base (both with Q/K rows permuted) gives
    peft's logits. Kills: lora_b of Q/K left permuted, alpha / r not applied."""
    hf = copy.deepcopy(setup.hf)
    write_gguf(hf, "llama", tmp_path / "base.gguf")  # HF's embedding is Q8_0-rounded in place
    cfg = hf.config
    write_gguf_lora(setup.dirs[0], tmp_path / "a.gguf", "llama", cfg.num_attention_heads,
                    cfg.num_key_value_heads, alpha=8.0)
    config, model = load_model(str(tmp_path / "base.gguf"), torch.float32, weights="bf16")
    lora = install_lora(model, config, max_loras=1, max_rank=8)
    adapter = load_adapter(str(tmp_path / "a.gguf"), "a")
    validate_adapter(adapter, config, max_rank=8)
    lora.load_slot(0, adapter)
    runner = ModelRunner(config, model, 64, 4, torch.float32, "cpu")
    runner.lora = lora
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=ALL_TARGETS))
    peft_model.load_state_dict(
        {k.replace(".lora_A.weight", ".lora_A.default.weight")
          .replace(".lora_B.weight", ".lora_B.default.weight"): v
         for k, v in load_file(str(setup.dirs[0] / "adapter_model.safetensors")).items()},
        strict=False)
    [ours] = run(runner, [(IDS_1, 0)])
    torch.testing.assert_close(ours, logits_of(peft_model.eval(), IDS_1), **TOL)


def test_delta_on_packed_quantized_weights(setup: Setup, tmp_path: Path) -> None:
    """With int8 packed base weights the adapter's delta is added to the packed product, in
    the activation dtype: every projection's output is the base's plus exactly the delta, for
    decode-sized (kernel) and prefill-sized (expand) inputs."""
    config, model = load_model(str(setup.dirs[0].parent / "base"), torch.float32,
                               weights="int8")
    lora = install_lora(model, config, max_loras=2, max_rank=8)
    lora.load_slot(1, setup.adapter_a)
    module = lora.modules[(1, "attn.qkv_proj")]
    pair_q, pair_k, pair_v = (setup.adapter_a.deltas[(1, p)] for p in "qkv")
    for rows in (3, 40):
        x = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
        base = module.base(x)
        lora.prepare([1, None], [rows - 1, 1])
        got = module(x)
        delta = torch.cat([x @ a.t() @ b.t() for a, b in (pair_q, pair_k, pair_v)], dim=1)
        torch.testing.assert_close(got[:-1], base[:-1] + delta[:-1], **TOL)
        torch.testing.assert_close(got[-1:], base[-1:], atol=0, rtol=0)
    lora.clear_batch()


def test_rank_above_limit_is_refused(setup: Setup) -> None:
    with pytest.raises(LoRAError, match=r"rank 8, above the limit of 4 \(--max-lora-rank\)"):
        validate_adapter(setup.adapter_b, setup.config, max_rank=4)


def test_adapter_of_another_base_is_refused(setup: Setup, tmp_path: Path) -> None:
    """A Qwen3 adapter (other head_dim) on the llama base: the shapes disagree."""
    qwen = build("qwen3", seed=6)
    make_peft(qwen, tmp_path / "q", seed=7)
    adapter = load_adapter(str(tmp_path / "q"), "q")
    with pytest.raises(LoRAError, match="another base model"):
        validate_adapter(adapter, setup.config, max_rank=8)


def test_gguf_adapter_of_another_architecture_is_refused(setup: Setup, tmp_path: Path) -> None:
    write_gguf_lora(setup.dirs[0], tmp_path / "x.gguf", "qwen2", 4, 2, alpha=8.0)
    adapter = load_adapter(str(tmp_path / "x.gguf"), "x")
    with pytest.raises(LoRAError, match="made for a 'qwen2' model"):
        validate_adapter(adapter, setup.config, max_rank=8)


def test_unsupported_adapters_are_refused(setup: Setup, tmp_path: Path) -> None:
    """Embedding targets, DoRA, a missing weights file, a plain model file: clear errors that
    name no path."""
    a_dir = setup.dirs[0]
    bad = tmp_path / "embed"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((a_dir / "adapter_config.json").read_text())
    tensors = load_file(str(a_dir / "adapter_model.safetensors"))
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 8)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="not a LoRA weight of an attention or MLP") as info:
        load_adapter(str(bad), "embed")
    assert str(tmp_path) not in str(info.value)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((a_dir / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAError, match="DoRA"):
        load_adapter(str(dora), "dora")
    (dora / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError, match=r"has no adapter_model\.safetensors"):
        load_adapter(str(dora), "dora")
    with pytest.raises(LoRAError, match="neither"):
        load_adapter(str(tmp_path / "nothing"), "nothing")
