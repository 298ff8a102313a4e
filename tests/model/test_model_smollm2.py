"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) vs transformers loading the same file.

transformers' ``from_pretrained(..., gguf_file=...)`` needs ``accelerate``; without it the
reference is built from transformers' own GGUF reader (``load_gguf_checkpoint``, which also
dequantises and undoes llama.cpp's Q/K permutation itself) into a ``LlamaForCausalLM``.
Float32; logits agree to ``atol = 1e-3`` (they are O(10)) and greedy continuations are equal.
"""

from __future__ import annotations

import os

import pytest
import torch
from isa_helpers import panel_build
from reference_cache import cached_reference

from prefixserve.model.arch.config import default_model_path
from prefixserve.model.runner import ModelRunner, SeqBatchInput
from prefixserve.model.text.tokenizer import load_tokenizer
from prefixserve.model.weights.loader import load_model

pytestmark = pytest.mark.slow
NEW_TOKENS = 16


def _convert(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(folder, gguf_file=name), dtype=torch.float32
    )
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def hf_model():
    """transformers' conversion of the GGUF file, kept once per machine
    (``tests/reference_cache.py``)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = cached_reference(
        "smollm2-model", path, lambda: _convert(path),
        lambda folder: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


def test_logits_and_greedy_match_transformers(hf_model) -> None:
    tok = load_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}])
    config, model = load_model(None, torch.float32)
    runner = ModelRunner(config, model, 16, 16, torch.float32, "cpu")
    table = list(range(16))
    out = runner.execute([SeqBatchInput(prompt, 0, table, need_prompt_logits=True)])
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    # The expand path's float32 GEMM of the same weights gives transformers' values; the panel
    # kernel rounds activations to 16 bits as every decode step does (measured 2.4e-4 of the
    # largest logit), and no prompt position's argmax moves.
    tol = 5e-4 * float(ref.abs().max()) if panel_build() else 1e-3
    torch.testing.assert_close(out.prompt_logits[0], ref, atol=tol, rtol=1e-4)
    assert torch.equal(out.prompt_logits[0].argmax(-1), ref.argmax(-1))

    ours, pos = [int(out.logits[0].argmax())], len(prompt)
    for _ in range(NEW_TOKENS - 1):
        step = runner.execute([SeqBatchInput([ours[-1]], pos, table)])
        ours.append(int(step.logits[0].argmax()))
        pos += 1
    theirs: list[int] = []
    with torch.no_grad():
        step = hf_model(torch.tensor([prompt]), use_cache=True)
        for _ in range(NEW_TOKENS):
            theirs.append(int(step.logits[0, -1].argmax()))
            step = hf_model(torch.tensor([theirs[-1:]]), cache=step.cache, use_cache=True)
    assert ours == theirs
    assert tok.decode(ours).strip()
