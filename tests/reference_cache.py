"""transformers' references for a GGUF file, converted once per machine and read back after.

transformers reads a GGUF file with its own reader: it dequantises every tensor in numpy and
parses the whole vocabulary, which takes over a minute for Gemma 3 270M on 2 cores (its model)
and half a minute more for its tokenizer. What is kept is still transformers' own conversion of
the same file, saved with ``save_pretrained`` under
``~/.cache/prefixserve/test-references/<kind>-<key>/`` (``PREFIXSERVE_CACHE_DIR`` moves it) and
read back with ``from_pretrained`` in seconds. The key names the file's bytes (SHA-256) and
transformers' version, so a new file or a new transformers converts again. Delete the folder
to force a conversion.

What a reference computes from fixed inputs (a tokenizer's ids, a model's logits) is kept the
same way by :func:`cached_outputs`, keyed also by the inputs, so that a test whose inputs did not
change loads no reference at all.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def cache_root() -> Path:
    root = os.environ.get("PREFIXSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "prefixserve")
    return Path(root) / "test-references"


@functools.cache
def _digest(gguf_path: str, size: int, mtime_ns: int) -> str:
    with open(gguf_path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _key(kind: str, gguf_path: str, inputs: object = None) -> str:
    """The file's SHA-256 (not its path: every clone installs the default model into its own
    .venv; hashed once per process, about a second for either model), transformers' version
    and, for outputs, the inputs' ``repr``."""
    import transformers

    stat = os.stat(gguf_path)
    digest = _digest(os.path.realpath(gguf_path), stat.st_size, stat.st_mtime_ns)
    text = "\0".join((kind, digest, transformers.__version__, repr(inputs)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save_weights(model: Any, folder: str) -> None:
    """A transformers model's config and weights, for a model that ``save_pretrained``
    refuses (one loaded with ``gguf_file=`` counts as quantized); tied weights once."""
    from safetensors.torch import save_file

    model.config.to_json_file(os.path.join(folder, "config.json"))
    state = model.state_dict()
    kept: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name in sorted(state, key=lambda n: (n.startswith("lm_head"), n)):  # the head is tied
        tensor = state[name]
        kept.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                         tuple(tensor.shape)), name)
    save_file({name: state[name].contiguous() for name in kept.values()},
              os.path.join(folder, "weights.safetensors"))


def load_weights(folder: str, dtype: Any) -> Any:
    """The model :func:`save_weights` wrote, weights tied again."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(folder)
    with no_init_weights():  # every weight is loaded below: no random values drawn first
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # (buffers made here)
    result = model.load_state_dict(load_file(os.path.join(folder, "weights.safetensors")),
                                   strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    model.tie_weights()
    assert set(result.missing_keys) <= {"lm_head.weight"}, result.missing_keys
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


def cached_reference(kind: str, gguf_path: str, build: Callable[[], Any],
                     load: Callable[[str], Any],
                     save: Callable[[Any, str], None] | None = None) -> Any:
    """``load(folder)`` of a folder that ``build()``'s result was saved to (by ``save``, else
    its ``save_pretrained``), building and saving it on the first call for this file. The
    folder appears by one rename, so another test process converting at the same time never
    reads half of it."""
    folder = cache_root() / f"{kind}-{_key(kind, gguf_path)}"
    if folder.is_dir():
        return load(str(folder))
    built = build()
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=folder.parent))
    try:
        if save is None:
            built.save_pretrained(partial)
        else:
            save(built, str(partial))
        os.replace(partial, folder)
    except OSError:  # another process saved it first
        pass
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return built


def cached_outputs(kind: str, gguf_path: str, inputs: object, compute: Callable[[], T]) -> T:
    """``compute()``'s result (tensors, lists, strings: what ``torch.save`` keeps) for these
    ``inputs`` of a reference of this file, computed on the first call and read back after. The
    caller's ``compute`` must depend on nothing but the file, transformers and ``inputs``."""
    import torch

    path = cache_root() / f"{kind}-{_key(kind, gguf_path, inputs)}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)  # type: ignore[no-any-return]
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{kind}-", dir=path.parent)
    with os.fdopen(handle, "wb") as file:
        torch.save(result, file)
    os.replace(partial, path)  # whole or absent, whoever writes it last
    return result
