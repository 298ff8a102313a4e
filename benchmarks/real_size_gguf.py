"""Writes random-weight GGUF files of real model shapes, for the real-size benchmarks.

    .venv/bin/python benchmarks/real_size_gguf.py llama-1b OUT.gguf [--type Q4_0|Q8_0|F16]

Shapes (``SHAPES``): Llama 3.2 1B (hidden 2048, 16 layers, FFN 8192, 32 query / 8 KV heads),
Qwen2.5 1.5B (hidden 1536, 28 layers, FFN 8960, 12 / 2 heads, head dim 128, q/k/v biases) and
Llama 3.2 3B (hidden 3072, 28 layers, FFN 8192, 24 / 8 heads). Every shape takes the default
model's tokenizer and its 49,152-token vocabulary (its metadata is copied), with a tied
embedding in Q8_0, so one tokenizer serves every file. Weights are normal(0, 0.02), norms 1.
The matmul weights are written in ``--type`` (quantized with the ``gguf`` package); K-quant
files are made from an F16 or Q8_0 one with llama.cpp's ``llama-quantize`` (built by
``benchmarks/build_llamacpp.sh``), e.g. ``llama-quantize --allow-requantize IN.gguf OUT.gguf
Q4_K_M``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from prefixserve.model.arch.config import default_model_path
from prefixserve.model.weights.gguf_file import GGUFFile


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    rope_base: float = 500000.0


SHAPES = {
    "llama-1b": Shape("llama", 2048, 16, 8192, 32, 8, 64),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 8960, 12, 2, 128, qkv_bias=True,
                          rope_base=1000000.0),
    "llama-3b": Shape("llama", 3072, 28, 8192, 24, 8, 128),
}

_TYPES = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q8_0": gguf.GGMLQuantizationType.Q8_0,
          "F16": gguf.GGMLQuantizationType.F16}


def _add_tokenizer(writer: gguf.GGUFWriter, metadata: dict[str, Any]) -> None:
    """The source's ``tokenizer.*`` fields, typed as llama.cpp's converter types them: arrays
    by their items (strings; token types int32), token ids uint32, flags bool, the rest
    strings. (Read with prefixserve's header parser: ``gguf.GGUFReader`` took 6 s over the
    vocabulary.)"""
    for name, value in metadata.items():
        if not name.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_string(name, value)


def _add_metadata(writer: gguf.GGUFWriter, s: Shape, vocab: int) -> None:
    a = s.arch
    writer.add_uint32(f"{a}.context_length", 8192)
    writer.add_uint32(f"{a}.embedding_length", s.hidden)
    writer.add_uint32(f"{a}.block_count", s.layers)
    writer.add_uint32(f"{a}.feed_forward_length", s.ffn)
    writer.add_uint32(f"{a}.attention.head_count", s.heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", s.kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", s.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", s.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{a}.rope.freq_base", s.rope_base)
    writer.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    writer.add_uint32(f"{a}.vocab_size", vocab)


def _tensor(writer: gguf.GGUFWriter, name: str, values: np.ndarray,
            qtype: gguf.GGMLQuantizationType) -> None:
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, values.astype(np.float32))
        return
    data = gguf.quants.quantize(values.astype(np.float32), qtype)
    writer.add_tensor(name, data, raw_dtype=qtype)


def write(shape_name: str, out: str, type_name: str, seed: int) -> None:
    s = SHAPES[shape_name]
    source = GGUFFile(default_model_path()).metadata
    vocab = len(source["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(out, s.arch)
    writer.add_name(f"random {shape_name}")
    _add_metadata(writer, s, vocab)
    _add_tokenizer(writer, source)
    rng = np.random.default_rng(seed)
    qtype = _TYPES[type_name]
    f32 = gguf.GGMLQuantizationType.F32

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    _tensor(writer, "token_embd.weight", normal(vocab, s.hidden), gguf.GGMLQuantizationType.Q8_0)
    _tensor(writer, "output_norm.weight", np.ones(s.hidden, np.float32), f32)
    q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        p = f"blk.{i}."
        _tensor(writer, p + "attn_norm.weight", np.ones(s.hidden, np.float32), f32)
        _tensor(writer, p + "ffn_norm.weight", np.ones(s.hidden, np.float32), f32)
        for part, rows in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            _tensor(writer, p + f"attn_{part}.weight", normal(rows, s.hidden), qtype)
            if s.qkv_bias:
                _tensor(writer, p + f"attn_{part}.bias", normal(rows), f32)
        _tensor(writer, p + "attn_output.weight", normal(s.hidden, q_out), qtype)
        _tensor(writer, p + "ffn_gate.weight", normal(s.ffn, s.hidden), qtype)
        _tensor(writer, p + "ffn_up.weight", normal(s.ffn, s.hidden), qtype)
        _tensor(writer, p + "ffn_down.weight", normal(s.hidden, s.ffn), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out")
    parser.add_argument("--type", default="Q4_0", choices=sorted(_TYPES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.shape, args.out, args.type, args.seed)


if __name__ == "__main__":
    main()
