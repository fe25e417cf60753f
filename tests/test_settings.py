"""Every ``serve`` flag parses from argv and from its ``TOKENWIRE_*`` variable, with its default.

Model-free. The expected values are written out here, not derived from the flag table, so a
change to a flag's name, variable, type or default shows up as a failure.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from tokenwire import cli
from tokenwire.settings import Settings, parse_serve_args

DEFAULTS = Settings(
    model="smollm2-135m-instruct",
    served_model_name=(),
    host="127.0.0.1",
    port=8000,
    max_model_len=None,
    chat_template=None,
    api_key=(),
    trust_request_chat_template=False,
    request_template_workers=2,
    request_template_timeout_s=5.0,
    request_template_max_chars=4194304,
    request_template_memory_bytes=1073741824,
    max_request_bytes=67108864,
    request_read_timeout_s=60.0,
    shutdown_timeout_s=30.0,
    log_level="info",
    max_num_seqs=64,
    max_n=16,
    prefix_cache_bytes=1073741824,
    max_num_batched_tokens=None,
    reasoning_parser=None,
    tool_call_parser=None,
    enable_auto_tool_choice=False,
    allowed_media_domains=None,
    allow_private_media_networks=False,
    media_allow_redirects=False,
    max_media_bytes=20971520,
    media_timeout_s=10.0,
    allowed_local_media_path=None,
    media_cache_bytes=536870912,
    max_images_per_request=8,
    max_image_pixels_per_request=50331648,
    device=None,
    engine_threads=None,
    enable_rl_control=False,
    engine="hf",
    dtype="auto",
    engine_args=(),
)

# Every flag away from its default: (flag, its values on the command line, its variable's text).
FLAGS: list[tuple[str, list[str], str]] = [
    ("--model", ["m"], "m"),
    ("--served-model-name", ["a", "b"], "a,b"),
    ("--host", ["0.0.0.0"], "0.0.0.0"),
    ("--port", ["9"], "9"),
    ("--max-model-len", ["77"], "77"),
    ("--chat-template", ["t.jinja"], "t.jinja"),
    ("--api-key", ["k"], "k"),
    ("--trust-request-chat-template", [], "1"),
    ("--request-template-workers", ["3"], "3"),
    ("--request-template-timeout-s", ["1.5"], "1.5"),
    ("--request-template-max-chars", ["10"], "10"),
    ("--request-template-memory-bytes", ["11"], "11"),
    ("--max-request-bytes", ["12"], "12"),
    ("--request-read-timeout-s", ["2"], "2"),
    ("--shutdown-timeout", ["3"], "3"),
    ("--log-level", ["debug"], "debug"),
    ("--max-num-seqs", ["4"], "4"),
    ("--max-n", ["5"], "5"),
    ("--prefix-cache-bytes", ["0"], "0"),
    ("--max-num-batched-tokens", ["64"], "64"),
    ("--reasoning-parser", ["qwen3"], "qwen3"),
    ("--tool-call-parser", ["hermes"], "hermes"),
    ("--enable-auto-tool-choice", [], "true"),
    ("--allowed-media-domains", ["x.org", "y.org"], "x.org,y.org"),
    ("--allow-private-media-networks", [], "yes"),
    ("--media-allow-redirects", [], "ON"),
    ("--max-media-bytes", ["13"], "13"),
    ("--media-timeout-s", ["4"], "4"),
    ("--allowed-local-media-path", ["/srv"], "/srv"),
    ("--media-cache-bytes", ["14"], "14"),
    ("--max-images-per-request", ["6"], "6"),
    ("--max-image-pixels-per-request", ["15"], "15"),
    ("--device", ["cpu"], "cpu"),
    ("--engine-threads", ["3"], "3"),
    ("--enable-rl-control", [], "1"),
    ("--engine", ["vllm"], "vllm"),
    ("--dtype", ["float16"], "float16"),
]

CHANGED = Settings(
    model="m",
    served_model_name=("a", "b"),
    host="0.0.0.0",
    port=9,
    max_model_len=77,
    chat_template=Path("t.jinja"),
    api_key=("k",),
    trust_request_chat_template=True,
    request_template_workers=3,
    request_template_timeout_s=1.5,
    request_template_max_chars=10,
    request_template_memory_bytes=11,
    max_request_bytes=12,
    request_read_timeout_s=2.0,
    shutdown_timeout_s=3.0,
    log_level="debug",
    max_num_seqs=4,
    max_n=5,
    prefix_cache_bytes=0,
    max_num_batched_tokens=64,
    reasoning_parser="qwen3",
    tool_call_parser="hermes",
    enable_auto_tool_choice=True,
    allowed_media_domains=("x.org", "y.org"),
    allow_private_media_networks=True,
    media_allow_redirects=True,
    max_media_bytes=13,
    media_timeout_s=4.0,
    allowed_local_media_path=Path("/srv"),
    media_cache_bytes=14,
    max_images_per_request=6,
    max_image_pixels_per_request=15,
    device="cpu",
    engine_threads=3,
    enable_rl_control=True,
    engine="vllm",
    dtype="float16",
    engine_args=(),
)


def env_var(flag: str) -> str:
    return "TOKENWIRE_" + flag.removeprefix("--").replace("-", "_").upper()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("TOKENWIRE_")]:
        monkeypatch.delenv(name)


def test_defaults() -> None:
    assert parse_serve_args([]) == DEFAULTS == Settings()


def test_every_flag_from_argv() -> None:
    argv = [arg for flag, values, _ in FLAGS for arg in (flag, *values)]
    assert parse_serve_args(argv) == CHANGED


def test_every_flag_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for flag, _, text in FLAGS:
        monkeypatch.setenv(env_var(flag), text)
    assert parse_serve_args([]) == CHANGED


def test_argv_beats_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWIRE_PORT", "9")
    monkeypatch.setenv("TOKENWIRE_SERVED_MODEL_NAME", "a,b")
    settings = parse_serve_args(["--port", "10", "--served-model-name", "c"])
    assert (settings.port, settings.served_model_name) == (10, ("c",))


@pytest.mark.parametrize("text", ["0", "false", "no", "off", ""])
def test_a_switch_variable_is_off_unless_it_says_on(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv("TOKENWIRE_ENABLE_RL_CONTROL", text)
    assert parse_serve_args([]).enable_rl_control is False


def test_empty_list_variables_keep_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWIRE_SERVED_MODEL_NAME", "")
    monkeypatch.setenv("TOKENWIRE_ALLOWED_MEDIA_DOMAINS", "")
    settings = parse_serve_args([])
    assert (settings.served_model_name, settings.allowed_media_domains) == ((), None)


def test_unknown_flags_pass_to_vllm() -> None:
    settings = parse_serve_args(["--engine", "vllm", "--tensor-parallel-size", "2", "--x"])
    assert settings.engine_args == ("--tensor-parallel-size", "2", "--x")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--tensor-parallel-size", "2"], {}, "(vLLM flags need --engine vllm)"),
        (["--prefix-cache-bytes", "-1"], {}, "--prefix-cache-bytes must be >= 0"),
        ([], {"TOKENWIRE_PREFIX_CACHE_BYTES": "-1"}, "--prefix-cache-bytes must be >= 0"),
        (["--max-num-batched-tokens", "0"], {}, "--max-num-batched-tokens must be >= 1"),
        (["--engine-threads", "0"], {}, "--engine-threads must be >= 1"),
        (
            ["--engine", "vllm", "--enable-return-routed-experts"],
            {},
            "--enable-return-routed-experts is not served with --engine vllm yet",
        ),
        ([], {"TOKENWIRE_PORT": "x"}, "argument --port: invalid int value: 'x'"),
        (["--log-level", "loud"], {}, "argument --log-level: invalid choice: 'loud'"),
        (["--api-key", "a", "b"], {}, "several --api-key keys need a --control-api-key"),
        (["--api-key", "a", "--router-api-key", "a"], {}, "--router-api-key must differ"),
        (["--session-max-bytes", "0"], {}, "--session-max-bytes must be between 1 and"),
        (
            ["--session-store-bytes", "10", "--session-max-bytes", "11"],
            {},
            "--session-max-bytes must be between 1 and --session-store-bytes",
        ),
    ],
)
def test_bad_values_are_refused(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        parse_serve_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_cli_parses_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[Settings] = []
    monkeypatch.setattr(cli, "_serve", lambda settings: served.append(settings) or 0)
    argv = [arg for flag, values, _ in FLAGS for arg in (flag, *values)]
    assert cli.main(["serve", *argv, "--enforce-eager"]) == 0
    assert served == [replace(CHANGED, engine_args=("--enforce-eager",))]
