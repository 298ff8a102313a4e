"""Gemma 3 text models: ``ModelConfig`` fields from GGUF metadata or an HF ``config.json``.

Facts of the architecture (the Gemma 3 technical report and its reference implementation):
five sliding-window layers then one global layer, repeated (layer i is global when
``(i + 1) % 6 == 0``; GGUF files do not store the pattern); rope base 10,000 for the local
layers and ``rope.freq_base`` (1e6) for the global ones; attention scaled by
``query_pre_attn_scalar ** -0.5`` (256 for every released size, which GGUF does not store);
GeGLU MLP with the tanh approximation of GELU; tied output head.

Imports no torch.
"""

from __future__ import annotations

from typing import Any

SLIDING_PATTERN = 6
"""Every sixth layer attends globally, the others through the sliding window."""
LOCAL_ROPE_THETA = 10_000.0
GLOBAL_ROPE_THETA = 1_000_000.0
QUERY_PRE_ATTN_SCALAR = 256.0


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """``"sliding"`` for five layers of six, ``"full"`` for every sixth."""
    return tuple("full" if (i + 1) % SLIDING_PATTERN == 0 else "sliding"
                 for i in range(num_layers))


def gemma3_from_gguf_metadata(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Keyword arguments of ``ModelConfig`` for a ``gemma3`` GGUF file."""

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"gemma3.{name}", default)

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    layers = key("block_count")
    eos: tuple[int, ...] = ()
    for name in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = meta.get(name)
        if value is not None and value not in eos:
            eos += (value,)
    if key("rope.scaling.type", "none") not in ("none", None):
        raise ValueError("gemma3: rope scaling in a GGUF file is not supported")
    return dict(
        architecture="gemma3",
        vocab_size=key("vocab_size") or len(tokens or ()),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length") or hidden // heads,
        rope_theta=float(key("rope.freq_base", GLOBAL_ROPE_THETA)),
        rope_local_theta=LOCAL_ROPE_THETA,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qk_norm=True,
        max_position_embeddings=key("context_length", 32768),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
        sliding_window=key("attention.sliding_window"),
        layer_types=default_layer_types(layers),
        query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR,
        hidden_act="gelu_tanh",
    )


def gemma3_from_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``ModelConfig`` for a ``gemma3_text`` ``config.json``."""
    cfg = cfg.get("text_config", cfg)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"gemma3: unsupported activation {act!r}")
    if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
        raise ValueError("gemma3: logit soft-capping is not supported")
    layers = cfg["num_hidden_layers"]
    given = cfg.get("layer_types")
    if given:
        layer_types = tuple("sliding" if t == "sliding_attention" else "full" for t in given)
    else:
        pattern = cfg.get("sliding_window_pattern", SLIDING_PATTERN)
        layer_types = tuple("full" if (i + 1) % pattern == 0 else "sliding"
                            for i in range(layers))
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
    for rope in (full, local):
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"gemma3: unsupported rope scaling {rope.get('rope_type')!r}")
    if cfg.get("rope_scaling"):
        raise ValueError("gemma3: rope scaling is not supported")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id", 1)
    return dict(
        architecture="gemma3",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", GLOBAL_ROPE_THETA))),
        rope_local_theta=float(local.get("rope_theta",
                                         cfg.get("rope_local_base_freq", LOCAL_ROPE_THETA))),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        attention_out_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        sliding_window=cfg.get("sliding_window"),
        layer_types=layer_types,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", QUERY_PRE_ATTN_SCALAR)),
        hidden_act="gelu_tanh",
    )
