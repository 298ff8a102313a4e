"""Loading GGUF files and configs: tiny GGUF files written here vs HF transformers.

The GGUF files are written the way llama.cpp's converter writes them: Q and K rows of the
``llama`` architecture permuted for llama.cpp's rope, Qwen2/Qwen3 left as they are, an
embedding quantised to Q8_0, and Llama 3 rope scaling stored as a ``rope_freqs`` tensor.
Logits must match HF (float32, ``atol = rtol = 1e-4``) once HF gets the same dequantised
embedding.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from isa_helpers import kernels_or_skip
from model_helpers import COMMON, HF_CONFIGS, build, write_gguf
from transformers import (
    Qwen2Config,
)

from prefixserve.model.arch.config import ModelConfig, kv_cache_bytes_per_token
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.weights.loader import load_model
from prefixserve.model.weights.quant import FMT_Q4_0, FMT_Q4_0S, QuantEmbedding

TOL = {"atol": 1e-4, "rtol": 1e-4}
@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_gguf_matches_hf(arch: str, tmp_path: Path) -> None:
    hf = build(arch, seed=3)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(hf, arch, path)
    config, model = load_model(str(path), torch.float32)
    assert config.architecture == arch
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    ids = [int(i) for i in torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(4))]
    runner = ModelRunner(config, model, 24, 4, torch.float32, "cpu")
    out = runner.execute([SeqBatchInput(ids, 0, list(range(18)), need_prompt_logits=True)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(out.prompt_logits[0], ref, **TOL)


def test_gguf_unexpected_tensor_is_an_error(tmp_path: Path) -> None:
    hf = build("qwen2", seed=5)
    path = tmp_path / "extra.gguf"
    write_gguf(hf, "qwen2", path, extra_tensor=True)
    with pytest.raises(ValueError, match="unexpected tensors"):
        load_model(str(path), torch.float32)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'falcon'"):
        load_model(str(path), torch.float32)


def test_hf_unsupported_architecture() -> None:
    with pytest.raises(ValueError, match="'gemma2'"):
        ModelConfig.from_hf_config({"model_type": "gemma2"})


def test_hf_sliding_window_per_layer() -> None:
    """Qwen2 slides from ``max_window_layers`` on (issue 12 replaced the old refusal)."""
    cfg = Qwen2Config(
        **COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=64,
        max_window_layers=1,
    ).to_dict()
    config = ModelConfig.from_hf_config(cfg)
    assert config.layer_windows == (None, 64)


def test_hf_config_v4_spelling() -> None:
    """transformers-4 configs spell rope as ``rope_theta`` + ``rope_scaling``."""
    cfg = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
        "eos_token_id": [5, 6],
    }
    config = ModelConfig.from_hf_config(cfg, {"eos_token_id": [6, 7]})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    assert config.eos_token_ids == (5, 6, 7)
    assert config.head_dim == 4


def test_kv_cache_sizing() -> None:
    config = ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
    )
    per_token = 2 * 30 * 3 * 64
    assert kv_cache_bytes_per_token(config, torch.float32) == per_token * 4
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == per_token * 2
    budget = 10 * 16 * per_token * 2 + 5
    assert ModelRunner.num_blocks_for_memory(config, torch.bfloat16, 16, budget) == 10


# ---------------------------------------------------------------------------------------------
# GGUF weights mapped, not copied

#: A llama GGUF of Q8_0 weights with a large tied embedding (35.7 MB: an allocation that size
#: always takes fresh pages from the OS, so a copy of it would show in RssAnon) and MLPs large
#: enough (gate and up, fused at load: 2.2 MB a layer) that their pages are measurable.
BIG = {"vocab": 131072, "hidden": 256, "inter": 4096, "heads": 4, "kv_heads": 2, "layers": 2}


def q8_0_bytes(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q8_0 blocks ``[rows, cols / 32 * 34]``: an fp16 scale of 0.01 and 32 int8."""
    blocks = rng.integers(0, 256, (rows, cols // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.array([0.01], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_big_embedding_gguf(path: Path) -> dict[str, int]:
    """A GGUF file of :data:`BIG`'s shapes; returns its weights' bytes by kind: ``embed`` and
    ``kept`` (o_proj and down_proj), views of the file once loaded, and ``fused`` (Q/K/V and
    gate/up), copied at load."""
    hidden, inter, heads, kv_heads = BIG["hidden"], BIG["inter"], BIG["heads"], BIG["kv_heads"]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(BIG["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(BIG["vocab"])
    sizes = {"embed": 0, "fused": 0, "kept": 0}

    def add(name: str, rows: int, cols: int, kind: str) -> None:
        data = q8_0_bytes(rng, rows, cols)
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType.Q8_0)
        sizes[kind] += data.nbytes

    add("token_embd.weight", BIG["vocab"], hidden, "embed")
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    shapes = {"attn_q": (hidden, hidden, "fused"), "attn_k": (kv_heads * head_dim, hidden, "fused"),
              "attn_v": (kv_heads * head_dim, hidden, "fused"),
              "attn_output": (hidden, hidden, "kept"), "ffn_gate": (inter, hidden, "fused"),
              "ffn_up": (inter, hidden, "fused"), "ffn_down": (hidden, inter, "kept")}
    for i in range(BIG["layers"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for part, (rows, cols, kind) in shapes.items():
            add(f"blk.{i}.{part}.weight", rows, cols, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sizes


def rss_anon() -> int:
    """This process's anonymous resident bytes (``RssAnon`` of ``/proc/self/status``)."""
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def mapped_file(path: Path) -> dict[str, int]:
    """Summed ``Rss`` and ``Anonymous`` bytes (``/proc/self/smaps``) of this process's mappings
    of ``path``; ``maps`` counts them."""
    target = os.path.realpath(path)
    out = {"maps": 0, "Rss": 0, "Anonymous": 0}
    current = False
    with open("/proc/self/smaps", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):
                current = len(fields) >= 6 and line.split(maxsplit=5)[5].rstrip("\n") == target
                out["maps"] += current
            elif current and fields[0].rstrip(":") in ("Rss", "Anonymous"):
                out[fields[0].rstrip(":")] += int(fields[1]) * 1024
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_gguf_weights_map_the_file(tmp_path: Path) -> None:
    """Loading a GGUF file copies only what it must. Packed weights kept as the file holds
    them (here the 35.7 MB embedding and head, o_proj, down_proj) add no anonymous memory:
    RssAnon grows by far less than the embedding alone. The pages read to build the fused
    Q/K/V and gate/up weights leave the process once those are copied: the file's mapping
    holds far fewer resident bytes than they span. A product with the head then reads the
    embedding in place: its pages are the file's (resident in the mapping, none of them
    private copies), and RssAnon still does not grow by them."""
    kernels_or_skip()
    path = tmp_path / "big.gguf"
    sizes = write_big_embedding_gguf(path)
    load_model(str(path), torch.float32, weights="auto")  # imports, kernels: warm
    before = rss_anon()
    config, model = load_model(str(path), torch.float32, weights="auto")
    grown = rss_anon() - before
    assert config.tie_word_embeddings and isinstance(model.embed_tokens, QuantEmbedding)
    assert grown < sizes["embed"] / 4, f"RssAnon grew {grown / 2**20:.1f} MiB at load"
    mapped = mapped_file(path)
    assert mapped["maps"] >= 1 and mapped["Anonymous"] == 0
    assert mapped["Rss"] < sizes["fused"] / 4, f"{mapped['Rss'] / 2**20:.1f} MiB still mapped"
    logits = model.embed_tokens.logits(torch.ones(1, BIG["hidden"]))
    assert logits.shape == (1, BIG["vocab"]) and torch.isfinite(logits).all()
    mapped = mapped_file(path)
    assert mapped["Anonymous"] == 0 and mapped["Rss"] >= sizes["embed"]
    assert rss_anon() - before < sizes["embed"] / 4


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="no transparent huge pages on this system")
def test_packed_copies_sit_side_by_side_in_huge_pages_and_kept_weights_stay_the_files(
        tmp_path: Path) -> None:
    """Every packed weight that loading copies (the fused Q/K/V and gate/up stacks; a Q4_0
    one in the stream layout) lies in the model's ``WeightArena``: a mapping advised for
    transparent huge pages (``hg`` in its ``VmFlags``), the copies side by side in load
    order, each on a 64-byte boundary. The weights kept as the file holds them (O, down,
    the embedding) stay views of the file's mapping (no ``hg``). The file is Q8_0, whose
    stacks ``_stack_packed`` builds in the arena. Kills: no arena for the stacks (each left in
    a mapping of base-size pages of its own), or the kept weights copied into it. (Planted:
    ``_stack_packed`` and ``_install_packed`` both without the arena: fails; ``_stack_packed``
    alone: its own test, ``test_a_stack_is_built_in_the_arena_unless_...``.)"""
    kernels_or_skip()
    path = tmp_path / "big.gguf"
    write_big_embedding_gguf(path)
    _, model = load_model(str(path), torch.float32, weights="auto")
    layers = model.layers
    copied = [m.qweight for layer in layers for m in (layer.attn.qkv_proj, layer.mlp.gate_up_proj)]
    kept = [m.qweight for layer in layers for m in (layer.attn.o_proj, layer.mlp.down_proj)]
    kept.append(model.embed_tokens.head.qweight)
    starts = [w.data_ptr() for w in copied]
    assert all(start % 64 == 0 and "hg" in _vm_flags(start) for start in starts)
    for before, after in itertools.pairwise(copied):  # side by side, in load order
        assert after.data_ptr() == -(-(before.data_ptr() + before.numel()) // 64) * 64
    gguf_map = _mapping_start(kept[0].data_ptr())
    assert all(_mapping_start(w.data_ptr()) == gguf_map for w in kept)
    assert "hg" not in _vm_flags(kept[0].data_ptr())


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="no transparent huge pages on this system")
def test_the_weight_arena_advises_whole_huge_pages_and_maps_anew_when_one_is_full() -> None:
    """``huge_page_area`` advises only whole huge pages: of 3 MiB the first 2 MiB (``hg``),
    not the last one, and nothing of 4 KiB. ``WeightArena`` hands out pieces from a huge-page
    boundary, side by side on 64-byte boundaries, each a storage of its own (``module_bytes``
    counts the piece, not the mapping); a piece that does not fit the rest of its mapping
    starts a new one. A Q4_0 weight's stream layout taken from an arena multiplies as the one
    from the heap, bit for bit. (Planted: the advice over the whole mapping: the tail check
    fails.)"""
    import ctypes

    from prefixserve.model.pages import HUGE_PAGE, huge_page_area
    from prefixserve.model.weights.quant import QuantLinear, WeightArena, pack_float

    area, start = huge_page_area(3 << 20)
    first = ctypes.c_char.from_buffer(area)
    base = ctypes.addressof(first) + start
    del first
    assert base % HUGE_PAGE == 0 and "hg" in _vm_flags(base)
    assert "hg" not in _vm_flags(base + HUGE_PAGE)
    small, at = huge_page_area(4096)
    head = ctypes.c_char.from_buffer(small)
    assert "hg" not in _vm_flags(ctypes.addressof(head) + at)
    del head
    arena = WeightArena(chunk=4 << 20)
    a, b, c = arena.take(1000), arena.take(3 << 20), arena.take(2 << 20)
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() == a.data_ptr() + 1024
    assert c.data_ptr() % HUGE_PAGE == 0 and c.data_ptr() != b.data_ptr() + (3 << 20)
    assert a.untyped_storage().nbytes() == 1000 and c.numel() == 2 << 20
    assert arena.take(0).numel() == 0
    kernels_or_skip()
    weight = pack_float(np.random.default_rng(3).standard_normal((64, 1024)).astype(np.float32),
                        FMT_Q4_0)
    heap, mapped = QuantLinear(weight), QuantLinear(weight, arena=arena)
    assert heap.fmt == mapped.fmt == FMT_Q4_0S and "hg" in _vm_flags(mapped.qweight.data_ptr())
    x = torch.randn(3, 1024)
    assert torch.equal(heap(x[:1]), mapped(x[:1])) and torch.equal(heap(x), mapped(x))


def _mapping_start(address: int) -> int:
    """Where this process's mapping that holds ``address`` begins (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(v, 16) for v in line.split()[0].split("-"))
            if low <= address < high:
                return low
    raise AssertionError(f"no mapping holds {address:#x}")


def _q8_0_file(path: Path, shapes: dict[str, tuple[int, ...]]) -> str:
    """A GGUF file of random Q8_0 tensors of ``shapes``, with scales of both signs, subnormal
    and large."""
    rng = np.random.default_rng(7)
    writer = GGUFWriter(str(path), "llama")
    for name, shape in shapes.items():
        blocks = rng.integers(0, 256, (int(np.prod(shape)) // 32, 34), dtype=np.uint8)
        scales = rng.choice(np.array([0.01, -3.5, 6e-8, 60000.0, -1e-5], np.float16),
                            blocks.shape[0])
        blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
        writer.add_tensor(name, blocks.reshape(*shape[:-1], -1),
                          raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_stack_is_built_in_the_arena_unless_it_may_take_the_stream_layout() -> None:
    """Loading stacks fused projections (``_cat``) straight into the model's ``WeightArena``:
    a Q8_0 (or any non-Q4_0) stack is built there, in order, and stays (not ``copied``: no
    second copy at install); a Q4_0 stack, which may be repacked into the stream layout, is
    built in base-size pages of its own and ``copied``. Each stack holds its parts' rows.
    (Planted: ``_stack_packed`` ignoring the arena: the Q8_0 stack is ``copied``; fails.)"""
    from prefixserve.model.weights.loader import _cat
    from prefixserve.model.weights.quant import FMT_Q8_0, WeightArena, pack_float

    rng = np.random.default_rng(3)
    arena = WeightArena()
    first = arena.take(64)
    for fmt in (FMT_Q8_0, FMT_Q4_0):
        parts = [pack_float(rng.standard_normal((rows, 256)).astype(np.float32), fmt)
                 for rows in (8, 4)]
        stack = _cat(list(parts), arena=arena)
        assert not isinstance(stack, torch.Tensor) and stack.fmt == fmt
        assert torch.equal(stack.data, torch.cat([p.data for p in parts]))
        in_arena = stack.data.data_ptr() == first.data_ptr() + 64
        assert (in_arena, stack.copied) == ((True, False) if fmt == FMT_Q8_0 else (False, True))


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(v, 16) for v in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_q8_0_values_are_written_to_base_size_pages(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q8_0 tensor's float32 values (Gemma 3's embedding: 671 MB) go to a mapping advised
    against transparent huge pages (``nh`` in its ``VmFlags``), not to numpy's own array, which
    asks for them: where the kernel compacts memory at such a first touch, Gemma 3's dense load
    took twice as long. A kernel that refuses the advice still gives the values. (Planted:
    ``np.empty`` again: the flag check fails.)"""
    import mmap

    from prefixserve.model.weights.gguf_file import GGUFFile

    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip("no transparent huge pages on this system")
    shapes = {"big": (1024, 1024)}
    gguf = GGUFFile(_q8_0_file(tmp_path / "q8.gguf", shapes))
    values = gguf.read_tensor("big")
    assert "nh" in _vm_flags(values.ctypes.data)

    class Refusing(mmap.mmap):
        def madvise(self, *args: int) -> None:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    assert np.array_equal(gguf.read_tensor("big"), values)


def test_q8_0_tensors_read_as_ggufs_own_dequantize_bit_for_bit(tmp_path: Path) -> None:
    """``GGUFFile.read_tensor`` dequantizes Q8_0 itself (gguf's ``dequantize`` took 11.8 s over
    Gemma 3's embedding): every value must be the same float32, over more blocks than one
    chunk, with scales of both signs, subnormal and large, and a 3-D tensor's shape."""
    from gguf.quants import dequantize

    from prefixserve.model.weights.gguf_file import _Q8_0_CHUNK, GGUFFile

    shapes = {"big": (_Q8_0_CHUNK // 4 + 3, 160), "cube": (3, 5, 64)}
    gguf = GGUFFile(_q8_0_file(tmp_path / "q8.gguf", shapes))
    for name, shape in shapes.items():
        ours = gguf.read_tensor(name)
        theirs = dequantize(gguf.read_raw(name), GGMLQuantizationType.Q8_0).reshape(shape)
        assert ours.dtype == np.float32 and ours.shape == shape
        assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))
