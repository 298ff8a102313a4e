"""The tensors of a Hugging Face model directory's ``*.safetensors`` files, by name."""

from __future__ import annotations

import glob
import os
from contextlib import ExitStack
from typing import Any


def safetensors_owners(path: str, stack: ExitStack) -> dict[str, Any]:
    """Every tensor name of the directory ``path``'s ``*.safetensors`` files, mapped to the open
    file that holds it (closed with ``stack``); FileNotFoundError when there are none."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    owner: dict[str, Any] = {}
    for file in files:
        handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
        owner.update(dict.fromkeys(handle.keys(), handle))
    return owner
