"""The image side of a LLaVA-style model directory: its encoder's weights, its processor, and
the split of the checkpoint's tensors between the encoder and the decoder.

Checkpoints name the parts differently (transformers 4 wrote ``language_model.model.*``,
``vision_tower.vision_model.*``; transformers 5 reads ``model.language_model.*``,
``model.vision_tower.*``): each part's prefix is found from one tensor every checkpoint of
that part holds, and the rest of each name is transformers' own. The decoder is loaded by
:func:`prefixserve.model.weights.loader.load_model` through :func:`decoder_names`; this module
loads the vision tower (the layers the features need; the tower's final norm and SigLIP's
pooling head are not used) and the projector.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch

from prefixserve.model.arch.config import resolve_model_path
from prefixserve.model.arch.vision_config import LlavaConfig, read_llava_config
from prefixserve.model.vision.encoder import ImageEncoder
from prefixserve.model.vision.processor import ImageProcessor
from prefixserve.model.weights.safetensors_dir import safetensors_owners

_PATCH = "embeddings.patch_embedding.weight"
_PROJECTOR = "multi_modal_projector.linear_1.weight"
_EMBED = "embed_tokens.weight"


@dataclass
class VisionModel:
    """What turns images into decoder embeddings: the config, the processor and the encoder
    (in eval mode, without gradients)."""

    config: LlavaConfig
    processor: ImageProcessor
    encoder: ImageEncoder


def decoder_names(names: dict[str, str], available: set[str]) -> tuple[dict[str, str], set[str]]:
    """The decoder's tensor names (``names``, spelt as a text model's ``model.*`` and
    ``lm_head.weight``) as the checkpoint holding ``available`` spells them, and the tensors
    that are not the decoder's (the image encoder's: empty for a text model)."""
    if names["embed"] in available:
        return names, set()
    embeds = sorted(n for n in available if n.endswith(_EMBED))
    if not embeds:
        return names, set()
    prefix = embeds[0][: -len(_EMBED)]
    head = next((n for n in ("lm_head.weight", "language_model.lm_head.weight")
                 if n in available), "lm_head.weight")
    renamed = {key: head if key == "lm_head" else prefix + name.removeprefix("model.")
               for key, name in names.items()}
    others = {n for n in available if not n.startswith(prefix) and n != head}
    return renamed, others


def load_vision_model(model: str | None, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> VisionModel | None:
    """The image side of ``model`` (see :func:`prefixserve.model.weights.loader.load_model`
    for the names it takes), with activations in ``dtype`` on ``device``; None for a model
    that takes no images. Raises ValueError for a checkpoint whose encoder tensors are
    missing or do not fit the config."""
    path = resolve_model_path(model)
    config = read_llava_config(path)
    if config is None:
        return None
    with torch.device("meta"):
        encoder = ImageEncoder(config)
    state = _encoder_state(path, encoder, dtype, torch.device(device))
    encoder.load_state_dict(state, strict=True, assign=True)
    encoder.requires_grad_(False)
    encoder.eval()
    return VisionModel(config, ImageProcessor.from_dir(path, config.vision), encoder)


def _encoder_state(path: str, encoder: ImageEncoder, dtype: torch.dtype,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """The encoder's state dict from the directory's safetensors files."""
    with ExitStack() as stack:
        owner = safetensors_owners(path, stack)
        sources = _source_names(path, set(owner), list(encoder.state_dict()))
        state = {}
        for ours, theirs in sources.items():
            tensor = owner[theirs].get_tensor(theirs)
            expected = encoder.get_parameter(ours).shape
            if tensor.shape != expected:
                raise ValueError(f"{path}: tensor {theirs!r} has shape {tuple(tensor.shape)}, "
                                 f"the config makes it {tuple(expected)}")
            state[ours] = tensor.to(device=device, dtype=dtype)
    return state


def _source_names(path: str, available: set[str], wanted: list[str]) -> dict[str, str]:
    """The checkpoint's name of each of the encoder's ``wanted`` parameters."""
    towers = sorted(n[: -len(_PATCH)] for n in available if n.endswith(_PATCH))
    projectors = sorted(n[: -len(_PROJECTOR)] for n in available if n.endswith(_PROJECTOR))
    if not towers or not projectors:
        raise ValueError(f"{path}: a LLaVA config, but the weights lack the vision tower or "
                         f"the projector (no tensor named *{_PATCH} or *{_PROJECTOR})")
    tower, projector = towers[0], projectors[0]
    sources = {}
    for name in wanted:
        part, _, rest = name.partition(".")
        theirs = (tower + rest if part == "vision_tower"
                  else projector + "multi_modal_projector." + rest)
        if theirs not in available:
            raise ValueError(f"{path}: weights lack tensor {theirs!r}")
        sources[name] = theirs
    return sources
