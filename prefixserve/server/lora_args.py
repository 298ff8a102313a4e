"""The LoRA flags of ``prefixserve serve`` (vLLM's names): ``--enable-lora``,
``--lora-modules NAME=PATH ...``, ``--max-loras N``, ``--max-lora-rank R``. Imports nothing of
the engine, so that building the parser stays cheap."""

from __future__ import annotations

import argparse
from typing import Any

#: vLLM's defaults: one adapter slot, rank up to 16.
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16


def add_lora_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--enable-lora", action="store_true",
                       help="give the model LoRA adapter slots, so that adapters can be loaded "
                       "(implied by --lora-modules); requests pick one with 'model': NAME")
    group.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                       help="adapters to load at start: a PEFT directory (adapter_config.json, "
                       "adapter_model.safetensors) or a llama.cpp GGUF LoRA file, each served "
                       "as model NAME")
    group.add_argument("--max-loras", type=int, metavar="N", default=DEFAULT_MAX_LORAS,
                       help="adapters that can run in one batch (slots; more loaded adapters "
                       "wait for a free slot and swap in, without holding back other requests; "
                       f"default {DEFAULT_MAX_LORAS})")
    group.add_argument("--max-lora-rank", type=int, metavar="R", default=DEFAULT_MAX_LORA_RANK,
                       help="largest adapter rank accepted (memory per slot grows with it; "
                       f"default {DEFAULT_MAX_LORA_RANK})")


def parse_lora_modules(values: list[str] | None) -> dict[str, str]:
    """``NAME=PATH`` values as a dict; ValueError for a malformed or repeated name."""
    modules: dict[str, str] = {}
    for value in values or ():
        name, sep, path = value.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {value!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def lora_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields of the LoRA flags."""
    modules = parse_lora_modules(args.lora_modules)
    return {"enable_lora": bool(args.enable_lora or modules), "max_loras": args.max_loras,
            "max_lora_rank": args.max_lora_rank, "lora_modules": modules or None}


def check_lora_names(args: argparse.Namespace, served_names: tuple[str, ...]) -> None:
    """ValueError for an adapter named like the base model."""
    taken = sorted(set(parse_lora_modules(args.lora_modules)) & set(served_names))
    if taken:
        raise ValueError(f"--lora-modules: {', '.join(taken)} is the base model's name; give "
                         "the adapter another")
