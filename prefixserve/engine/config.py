"""Engine settings, with the names of vLLM's engine arguments where one exists."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from prefixserve.core import ALLOWED_BLOCK_SIZES, HASH_ALGOS
from prefixserve.model.arch.config import WEIGHT_LAYOUTS, WEIGHT_MODES
from prefixserve.model.arch.vision_config import (
    DEFAULT_LIMIT_IMAGES_PER_PROMPT,
    DEFAULT_MAX_IMAGE_PIXELS,
)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

DEFAULT_KV_CACHE_MEMORY = 1 << 30
KV_TIER_WRITE_POLICIES = ("through", "back")
MAX_SPECULATIVE_TOKENS = 16
"""Bound of ``num_speculative_tokens`` and ``prompt_lookup_max``."""


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"4GiB"``, ``"2GB"`` or ``"1000"``."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {value!r}; use e.g. 512MiB, 4GiB or 2GB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return size


def resolve_device(device: str) -> str:
    """``device`` made concrete: ``auto`` becomes ``cuda`` where torch sees a GPU, else ``cpu``.
    Raises ValueError for an unknown device, or CUDA asked for where torch sees none."""
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device == "cpu":
        return device
    import torch

    available = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if available else "cpu"
    if not available:
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU here (torch "
                         f"{torch.__version__}); use --device cpu")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: torch sees {torch.cuda.device_count()} GPU(s)")
    return device


@dataclass
class EngineConfig:
    """What the engine runs and how.

    ``enable_prefix_caching`` is three-valued, as users give it: None (unset) means on;
    ``prefix_caching`` is the resolved bool, the only form the engine and the core see. The KV
    cache is sized by ``num_blocks`` when given, else by ``kv_cache_memory`` (bytes or a string
    like ``"2GiB"``, default 1 GiB). ``max_model_len`` defaults to the model's context length,
    capped by the KV cache. ``max_num_batched_tokens`` is the token budget of one step; with
    ``enable_chunked_prefill`` a prompt longer than what is left of it is computed in chunks,
    without it a prompt longer than the whole budget is refused (it could never run).
    ``long_prefill_token_threshold``: while requests wait, a running prefill's chunk is at most
    this many tokens and the running prefills leave this many of the budget to the waiting
    requests, so that one long prompt does not hold a short request back until its prefill
    ends (None: a quarter of ``max_num_batched_tokens``; 0: off; without chunked prefill, off).
    ``shared_prefix_wait_tokens``: a waiting request whose next this many uncached prompt
    tokens are blocks a running prefill is still computing waits for them and hits them,
    instead of computing them beside it (0: off; ``engine/scheduler.py``).
    ``max_waiting_requests`` bounds the queue in sequences (a request of ``n`` takes ``n``;
    None: unbounded); a request that does not fit the room left is refused.
    ``request_log_size``: the sequences the cache board remembers for the console's what-if
    (block hash ids and lengths, no text; ``engine/cache_board.py``; 0: none).
    ``dtype`` defaults to ``"auto"``: bfloat16 where the CPU computes it natively (AVX512-BF16 or
    AMX), float32 elsewhere; float32 gives bit-stable results across batch shapes.
    ``kv_cache_dtype`` is the KV cache's (default ``"auto"``: ``dtype``'s); float16 or bfloat16
    beside float32 activations halve the cache's memory and what attention reads.
    ``weights`` says how matmul weights are held: ``auto`` keeps a GGUF file's quantized
    tensors packed in memory, ``int8`` / ``int4`` pack every matmul weight, ``bf16`` keeps them
    dense in ``dtype`` (see :mod:`prefixserve.model.weights.loader`). ``weight_layout``:
    ``stream`` (the default) moves packed Q4_0 weights (width a multiple of 128) into the layout the
    one-row product streams at the memory's speed (a copy in memory, docs/kernels.md);
    ``file`` keeps them in the file's layout, as views of the mapped file where it allows.
    ``max_pinned_fraction`` bounds the blocks pins may hold (``pin_prefix``), a share of the pool.
    ``device`` is ``"auto"`` (the default: the first CUDA GPU where torch sees one, else the
    CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``"auto"`` is resolved here, so the engine only
    ever sees a concrete device. The C kernels (packed weights, the fused decode step, the
    prompt attention kernel, the deterministic mode) are CPU code; on CUDA the model runs
    dense weights through torch.

    ``enable_lora`` gives the model ``max_loras`` adapter slots of rank up to ``max_lora_rank``
    (vLLM's names and defaults, 1 and 16); ``lora_modules`` maps served names to adapter paths
    (PEFT directories or GGUF LoRA files) loaded at start (see ``engine/lora_registry.py``).
    ``prefix_caching_hash_algo`` None means builtin, or sha256 when a cache tier is configured.
    The ``kv_disk_*``, ``kv_redis_*`` and ``kv_tier_*`` settings configure the cache tiers below
    the pool (docs/tiers.md): a disk directory and its size budget, a Redis URL with
    the TTL of its values and an optional memory budget, the write policy (``through``: a block
    is written once full and computed; ``back``: when evicted from the pool, and at shutdown),
    the shortest prompt whose blocks are written, the timeout of one tier call, how long a
    failed tier stays marked down, and the bytes of KV the writer thread may hold.
    ``deterministic`` runs the batch-invariant kernels: a request's output depends only on its
    own tokens, sampling parameters and seed, not on the batch, the chunking of its prompt or
    the prefix cache (CPU, float32 or bfloat16; see
    :mod:`prefixserve.model.attention.batch_invariant`).
    ``enforce_eager`` runs decode steps through the torch modules layer by layer instead of
    the fused decode kernel (:mod:`prefixserve.model.attention.fused_decode`; for comparisons and
    debugging).
    ``num_speculative_tokens`` (0: off) turns on n-gram speculation: a plain request that
    decodes computes up to this many draft tokens, found by prompt lookup with n-grams of
    ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens, beside its next token in each step
    (``engine/ngram_proposer.py``; vLLM's ``ngram`` method and names).
    ``limit_mm_per_prompt`` is the most images one prompt may hold, ``max_image_pixels`` the
    most pixels one image may have (``LLM.chat`` decodes images under it; the server has the
    same flag), and ``encoder_cache_size`` the image embedding rows the encoder cache keeps
    (``engine/multimodal.py``; a model that takes no images ignores all three).
    """

    model: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    weights: str = "auto"
    weight_layout: str = "stream"
    device: str = "auto"
    enable_prefix_caching: bool | None = None
    prefix_caching_hash_algo: str | None = None
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    shared_prefix_wait_tokens: int = 32
    max_waiting_requests: int | None = None
    request_log_size: int = 10_000
    num_threads: int | None = None
    max_pinned_fraction: float = 0.5

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: dict[str, str] | None = None
    kv_disk_dir: str | None = None
    kv_disk_size: int | str = "20GiB"
    kv_redis_url: str | None = None
    kv_redis_ttl: float = 86400.0
    kv_redis_max_memory: int | str | None = None
    kv_tier_write_policy: str = "through"
    kv_tier_min_prefix_tokens: int = 256
    kv_tier_timeout: float = 1.0
    kv_tier_retry_after: float = 10.0
    kv_tier_write_queue: int | str = "512MiB"
    deterministic: bool = False
    enforce_eager: bool = False
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    limit_mm_per_prompt: int = DEFAULT_LIMIT_IMAGES_PER_PROMPT
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    encoder_cache_size: int = 8192

    @property
    def prefill_threshold(self) -> int:
        """``long_prefill_token_threshold`` resolved: its default, and 0 without chunking."""
        if not self.enable_chunked_prefill:
            return 0
        if self.long_prefill_token_threshold is None:
            return self.max_num_batched_tokens // 4
        return self.long_prefill_token_threshold

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], "
                             f"got {self.max_pinned_fraction}")
        if self.block_size not in ALLOWED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {ALLOWED_BLOCK_SIZES}, "
                             f"got {self.block_size}")
        if self.prefix_caching_hash_algo not in (*HASH_ALGOS, None):
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        self._check_dtypes()
        self.device = resolve_device(self.device)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and not 0 <= threshold < self.max_num_batched_tokens:
            raise ValueError(f"long_prefill_token_threshold must be in [0, "
                             f"max_num_batched_tokens = {self.max_num_batched_tokens}), got "
                             f"{threshold}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {self.num_blocks}")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        self._check_queue()
        self._check_lora()
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        self._check_tiers()
        self._check_speculation()
        self._check_images()

    def _check_queue(self) -> None:
        for name in ("request_log_size", "shared_prefix_wait_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be positive, got "
                             f"{self.max_waiting_requests}")

    def _check_images(self) -> None:
        for name in ("limit_mm_per_prompt", "max_image_pixels", "encoder_cache_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

    def _check_speculation(self) -> None:
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.prompt_lookup_max > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"prompt_lookup_max must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.prompt_lookup_max}")

    def _check_dtypes(self) -> None:
        """``dtype``, ``kv_cache_dtype`` and ``weights``."""
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in ("auto", "float32", "bfloat16", "float16"):
                raise ValueError(f"{name} must be auto, float32, bfloat16 or float16, got "
                                 f"{getattr(self, name)!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, "
                             f"got {self.weights!r}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be one of {', '.join(WEIGHT_LAYOUTS)}, "
                             f"got {self.weight_layout!r}")

    def _check_tiers(self) -> None:
        """The cache tiers' settings (docs/tiers.md)."""
        if not self.has_tiers:
            return
        if not self.prefix_caching:
            raise ValueError("the KV cache tiers (--kv-disk-dir, --kv-redis-url) need prefix "
                             "caching on")
        if self.hash_algo == "builtin" and "PYTHONHASHSEED" not in os.environ:
            raise ValueError(
                "a persistent or shared KV tier needs block hashes that are the same in every "
                "process, but the builtin hash chains from a random per-process root unless "
                "PYTHONHASHSEED is set: use --prefix-caching-hash-algo sha256 (the default with "
                "a tier) or xxhash, or set PYTHONHASHSEED")
        if self.kv_tier_write_policy not in KV_TIER_WRITE_POLICIES:
            raise ValueError(f"kv_tier_write_policy must be one of {KV_TIER_WRITE_POLICIES}, "
                             f"got {self.kv_tier_write_policy!r}")
        for name in ("kv_redis_ttl", "kv_tier_timeout", "kv_tier_retry_after"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_tier_min_prefix_tokens < 0:
            raise ValueError("kv_tier_min_prefix_tokens must not be negative")
        parse_memory(self.kv_disk_size)
        parse_memory(self.kv_tier_write_queue)
        if self.kv_redis_max_memory is not None:
            parse_memory(self.kv_redis_max_memory)

    @property
    def has_tiers(self) -> bool:
        """Whether a cache tier (disk or Redis) is configured."""
        return bool(self.kv_disk_dir or self.kv_redis_url)

    @property
    def hash_algo(self) -> str:
        """``prefix_caching_hash_algo`` resolved: as given, else sha256 with a cache tier (a
        hash stable across processes) and builtin without."""
        if self.prefix_caching_hash_algo is not None:
            return self.prefix_caching_hash_algo
        return "sha256" if self.has_tiers else "builtin"

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora=True")

    @property
    def prefix_caching(self) -> bool:
        """``enable_prefix_caching`` resolved: on unless it is False."""
        return self.enable_prefix_caching is not False
