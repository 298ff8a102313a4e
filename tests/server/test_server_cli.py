"""``prefixserve serve`` without a model: the command line, the engine settings it makes, API key
files, refusals before any model is loaded, and the wording of validation errors."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from prefixserve.cli import build_parser
from prefixserve.server.errors import describe_validation_errors
from prefixserve.server.launch import engine_config, read_api_keys, run_server, server_config

pytestmark = pytest.mark.fast


def torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_help_lists_the_options() -> None:
    result = subprocess.run([sys.executable, "-m", "prefixserve", "serve", "--help"],
                            capture_output=True, text=True, check=True)
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--prefix-caching-hash-algo", "--block-size", "--kv-cache-memory",
                 "--num-blocks", "--max-num-seqs", "--max-num-batched-tokens",
                 "--max-model-len", "--dtype", "--served-model-name", "--api-key",
                 "--share-cache-across-keys", "--admin-key", "--metrics-key",
                 "--metrics-prefix", "--max-waiting-requests", "--max-n",
                 "--max-prompts-per-request", "--max-sequences-per-request",
                 "--max-request-body-size", "--request-read-timeout", "--log-stats-interval"):
        assert flag in result.stdout
    top = subprocess.run([sys.executable, "-m", "prefixserve", "--help"], capture_output=True,
                         text=True, check=True)
    assert "serve" in top.stdout


def test_help_states_the_engine_defaults() -> None:
    """The parser module imports no engine code (it must stay cheap to build), so its help
    repeats the defaults; this keeps them in step."""
    from prefixserve.engine.config import EngineConfig

    commands = next(action for action in build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    helps = {action.dest: action.help for action in serve._actions}
    defaults = EngineConfig()
    for name in ("dtype", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        assert f"default {getattr(defaults, name)}" in helps[name], name
    assert f"default {defaults.hash_algo}" in helps["prefix_caching_hash_algo"]
    assert f"default {defaults.kv_disk_size}" in helps["kv_disk_size"]
    assert f"default {defaults.kv_tier_min_prefix_tokens}" in helps["kv_tier_min_prefix_tokens"]
    assert f"default {defaults.kv_tier_write_policy}" in helps["kv_tier_write_policy"]
    assert f"default {defaults.kv_tier_write_queue}" in helps["kv_tier_write_queue"]


def test_tier_flags_reach_the_engine_config() -> None:
    config = engine_config(parse("--kv-disk-dir", "/d", "--kv-disk-size", "1GiB",
                                 "--kv-redis-url", "redis://h:1/0", "--kv-redis-ttl", "60",
                                 "--kv-tier-write-policy", "back", "--kv-tier-min-prefix-tokens",
                                 "32", "--kv-tier-timeout", "2", "--kv-tier-retry-after", "3",
                                 "--kv-tier-write-queue", "64MiB"))
    assert (config.kv_disk_dir, config.kv_disk_size, config.kv_redis_url) == (
        "/d", "1GiB", "redis://h:1/0")
    assert (config.kv_redis_ttl, config.kv_tier_write_policy, config.kv_tier_min_prefix_tokens,
            config.kv_tier_timeout, config.kv_tier_retry_after, config.kv_tier_write_queue) == (
        60, "back", 32, 2, 3, "64MiB")
    assert config.hash_algo == "sha256"


def test_the_weight_layout_flag_reaches_the_engine_config_and_is_checked() -> None:
    """``--weight-layout`` (default: the engine's ``stream``) reaches EngineConfig; a layout
    the engine does not know is refused by the parser, and by EngineConfig itself."""
    from prefixserve.engine.config import EngineConfig

    assert engine_config(parse()).weight_layout == "stream"
    assert engine_config(parse("--weight-layout", "file")).weight_layout == "file"
    with pytest.raises(SystemExit):
        parse("--weight-layout", "mapped")
    with pytest.raises(ValueError, match="weight_layout must be one of stream, file"):
        EngineConfig(weight_layout="mapped")


def test_defaults_leave_the_engine_defaults() -> None:
    args = parse()
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)
    config = engine_config(args)
    assert config.enable_prefix_caching is None and config.prefix_caching
    assert config.block_size == 16 and config.max_waiting_requests == 1024
    server = server_config(args)
    assert server.api_keys == () and not server.salt_by_api_key
    assert not server.admin_protected and server.metrics_keys == ()
    assert (server.max_n, server.max_prompts_per_request, server.max_sequences_per_request,
            server.max_request_body_size, server.request_read_timeout) == (
        128, 256, 256, 32 << 20, 30.0)


def test_with_api_keys_each_key_has_its_own_cache_and_admin_needs_its_own_key() -> None:
    server = server_config(parse("--api-key", "a", "--api-key", "b"))
    assert server.salt_by_api_key and server.admin_protected and server.admin_keys == ()
    shared = server_config(parse("--api-key", "a", "--share-cache-across-keys",
                                 "--admin-key", "root", "--metrics-key", "scraper"))
    assert not shared.salt_by_api_key
    assert (shared.admin_keys, shared.metrics_keys) == (("root",), ("scraper",))
    assert server_config(parse("--admin-key", "root")).admin_protected
    assert server_config(parse("--metrics-key", "scraper")).admin_protected  # any key at all


def test_the_default_served_name_reveals_no_server_path() -> None:
    assert server_config(parse("/srv/models/smol-q4.gguf")).served_model_names == (
        "smol-q4.gguf",)
    assert server_config(parse("/srv/models/qwen3-hf/")).served_model_names == ("qwen3-hf",)
    assert server_config(parse()).served_model_names == ("SmolLM2-135M-Instruct",)


def test_limit_flags_reach_the_server_config() -> None:
    server = server_config(parse("--max-n", "4", "--max-prompts-per-request", "8",
                                 "--max-sequences-per-request", "16", "--max-request-body-size",
                                 "1KiB", "--request-read-timeout", "2.5", "--metrics-prefix",
                                 "vllm"))
    assert (server.max_n, server.max_prompts_per_request, server.max_sequences_per_request,
            server.max_request_body_size, server.request_read_timeout,
            server.metrics_prefix) == (4, 8, 16, 1024, 2.5, "vllm")


def test_the_console_page_is_on_unless_no_ui_and_the_request_log_has_a_flag() -> None:
    assert server_config(parse()).console is True
    assert server_config(parse("--no-ui")).console is False
    assert engine_config(parse()).request_log_size == 10_000
    assert engine_config(parse("--request-log-size", "0")).request_log_size == 0


def test_engine_flags_reach_the_engine_config() -> None:
    args = parse("model.gguf", "--no-enable-prefix-caching", "--prefix-caching-hash-algo",
                 "sha256", "--block-size", "32", "--num-blocks", "100", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "512", "--max-model-len", "256", "--dtype",
                 "bfloat16", "--max-waiting-requests", "8", "--no-enable-chunked-prefill")
    config = engine_config(args)
    assert config.model == "model.gguf"
    assert config.enable_prefix_caching is False
    assert (config.prefix_caching_hash_algo, config.block_size, config.num_blocks) == (
        "sha256", 32, 100)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (
        4, 512, 256)
    assert (config.dtype, config.max_waiting_requests) == ("bfloat16", 8)
    assert config.enable_chunked_prefill is False
    assert engine_config(parse("--enable-prefix-caching", "--kv-cache-memory",
                               "64MiB")).kv_cache_memory == "64MiB"


def test_the_device_defaults_to_a_gpu_where_torch_sees_one_else_the_cpu() -> None:
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert engine_config(parse()).device == expected
    assert engine_config(parse("--device", "auto")).device == expected
    assert engine_config(parse("--device", "cpu")).device == "cpu"


@pytest.mark.skipif(torch_sees_cuda(), reason="this machine has a GPU: cuda is valid here")
def test_a_cuda_device_without_a_gpu_stops_before_loading_the_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert run_server(parse("--device", "cuda")) == 2
    assert "torch sees no CUDA GPU" in capsys.readouterr().err


def test_speculation_flags_reach_the_engine_config() -> None:
    config = engine_config(parse("--num-speculative-tokens", "3", "--prompt-lookup-min", "1",
                                 "--prompt-lookup-max", "5"))
    assert (config.num_speculative_tokens, config.prompt_lookup_min,
            config.prompt_lookup_max) == (3, 1, 5)
    assert engine_config(parse()).num_speculative_tokens == 0  # off unless asked for


def test_image_flags_reach_the_engine_and_server_configs() -> None:
    """The flags, and the defaults the help states (the parser imports no engine code)."""
    args = parse("--limit-mm-per-prompt", "2", "--max-image-pixels", "1000",
                 "--encoder-cache-size", "64", "--allowed-media-domains", "img.example", "cdn")
    config, server = engine_config(args), server_config(args)
    assert (config.limit_mm_per_prompt, config.max_image_pixels,
            config.encoder_cache_size) == (2, 1000, 64)
    assert (server.max_image_pixels, server.allowed_media_domains) == (
        1000, ("img.example", "cdn"))
    defaults, plain = engine_config(parse()), server_config(parse())
    assert plain.allowed_media_domains == () and plain.max_image_pixels == \
        defaults.max_image_pixels
    commands = next(action for action in build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction))
    helps = {action.dest: action.help for action in commands.choices["serve"]._actions}
    for name in ("limit_mm_per_prompt", "max_image_pixels", "encoder_cache_size"):
        assert f"default {getattr(defaults, name)}" in helps[name], name


@pytest.mark.parametrize("argv", [
    ("--block-size", "7"),
    ("--num-blocks", "10", "--kv-cache-memory", "1GiB"),
    ("--prefix-caching-hash-algo", "md5"),
    ("--dtype", "int8"),
])
def test_bad_flags_are_refused_by_the_parser(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as caught:
        parse(*argv)
    assert caught.value.code == 2


@pytest.mark.parametrize(("argv", "message"), [
    (("--share-cache-across-keys",), "needs at least one --api-key"),
    (("--max-n", "0"), "max_n must be positive"),
    (("--max-n", "129"), "max_n"),
    (("--max-request-body-size", "huge"), "memory size"),
    (("--max-num-seqs", "0"), "max_num_seqs"),
    (("--kv-cache-memory", "lots"), "memory size"),
    (("--num-speculative-tokens", "-1"), "num_speculative_tokens"),
    (("--api-key", "@/no/such/file"), "No such file"),
    (("--device", "gpu"), "device must be auto, cpu, cuda or cuda:N"),
    (("--limit-mm-per-prompt", "-1"), "limit_mm_per_prompt must not be negative"),
    (("--max-image-pixels", "0"), "max_image_pixels must be positive"),
])
def test_bad_settings_stop_before_loading_the_model(argv: tuple[str, ...], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert run_server(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_api_keys_from_values_and_files(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# comment\nkey-b\n\n  key-c  \nkey-a\n")
    assert read_api_keys(["key-a", f"@{keys}"]) == ("key-a", "key-b", "key-c")
    with pytest.raises(ValueError, match="empty"):
        read_api_keys([" "])


def test_validation_errors_name_the_field_without_echoing_input() -> None:
    message, param = describe_validation_errors([
        {"type": "less_than_equal", "loc": ("body", "temperature"),
         "msg": "Input should be less than or equal to 2", "input": 99},
        {"type": "missing", "loc": ("body", "prompt"), "msg": "Field required"}])
    assert message == "temperature: Input should be less than or equal to 2 (and 1 more problem)"
    assert param == "temperature"
    message, param = describe_validation_errors([
        {"type": "int_type", "loc": ("body", "prompt", "token_ids", 3),
         "msg": "Input should be a valid integer", "input": "secret"}])
    assert message == "prompt.token_ids[3]: Input should be a valid integer"
    assert "secret" not in message and param == "prompt"
    message, param = describe_validation_errors([
        {"type": "extra_forbidden", "loc": ("body", "best_of"), "msg": "Extra inputs"}])
    assert message == "unrecognized request argument: best_of" and param == "best_of"
    message, param = describe_validation_errors([
        {"type": "json_invalid", "loc": ("body", 5), "msg": "JSON decode error",
         "ctx": {"error": "Expecting value"}}])
    assert message == "the request body is not valid JSON (Expecting value)" and param is None
