"""The LoRA flags of ``prefixserve serve`` without a model: what reaches the engine config, and
refusals before any model is loaded."""

from __future__ import annotations

import pytest

from prefixserve.cli import build_parser
from prefixserve.server.launch import engine_config, run_server


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_lora_flags_reach_the_engine_config() -> None:
    config = engine_config(parse("--lora-modules", "sql=/a/sql", "chat=/b/chat.gguf",
                                 "--max-loras", "4", "--max-lora-rank", "64"))
    assert config.enable_lora  # implied by --lora-modules
    assert config.lora_modules == {"sql": "/a/sql", "chat": "/b/chat.gguf"}
    assert (config.max_loras, config.max_lora_rank) == (4, 64)
    plain = engine_config(parse())
    assert not plain.enable_lora and plain.lora_modules is None
    assert (plain.max_loras, plain.max_lora_rank) == (1, 16)  # vLLM's defaults
    assert engine_config(parse("--enable-lora")).enable_lora


@pytest.mark.parametrize(("argv", "message"), [
    (("--lora-modules", "nameonly"), "takes NAME=PATH"),
    (("--lora-modules", "a=/x", "a=/y"), "names 'a' twice"),
    (("--lora-modules", "smol=/x", "--served-model-name", "smol"), "the base model's name"),
    (("--enable-lora", "--max-loras", "0"), "max_loras must be positive"),
    (("--enable-lora", "--max-lora-rank", "0"), "max_lora_rank must be positive"),
])
def test_bad_lora_flags_stop_before_loading_the_model(argv: tuple[str, ...], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert run_server(parse(*argv)) == 2
    assert message in capsys.readouterr().err
