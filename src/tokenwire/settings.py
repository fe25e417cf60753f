"""Server settings: parsed once from flags and ``TOKENWIRE_*`` variables into one typed object.

Everything below the CLI receives a ``Settings`` (or the part of it it needs); nothing reads flags
or the environment on its own.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from tokenwire.engine.factory import DEFAULT_PREFIX_CACHE_BYTES, ENGINE_KINDS, EngineKind
from tokenwire.parsers import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES

if TYPE_CHECKING:
    from tokenwire.media.policy import MediaPolicy
    from tokenwire.text.chat_template import TemplateLimits

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class Settings:
    model: str = DEFAULT_MODEL
    served_model_name: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int | None = None
    chat_template: Path | None = None
    api_key: str | None = None
    trust_request_chat_template: bool = False
    request_template_workers: int = 2
    request_template_timeout_s: float = 5.0
    request_template_max_chars: int = 4 * 2**20
    request_template_memory_bytes: int = 2**30
    max_request_bytes: int = 64 * 2**20
    request_read_timeout_s: float = 60.0
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    max_num_seqs: int = 64
    max_n: int = 16
    max_logprobs: int = 20
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    allowed_media_domains: tuple[str, ...] | None = None
    allow_private_media_networks: bool = False
    media_allow_redirects: bool = False
    max_media_bytes: int = 20 * 2**20
    media_timeout_s: float = 10.0
    allowed_local_media_path: Path | None = None
    media_cache_bytes: int = 512 * 2**20
    max_images_per_request: int = 8
    max_image_pixels_per_request: int = 48 * 2**20
    device: str | None = None
    enable_rl_control: bool = False
    max_held_requests: int = 1024
    engine: EngineKind = "hf"
    dtype: str = "auto"
    # vLLM engine flags tokenwire does not know, passed through as given (``--engine vllm``).
    engine_args: tuple[str, ...] = ()

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names clients may use; the first is reported as the model's name."""
        if self.served_model_name:
            return self.served_model_name
        return (self.model,)

    def media_policy(self) -> MediaPolicy:
        """The ``--*media*`` flags as the media connector's policy, resolved once at start-up."""
        from tokenwire.media.policy import MediaPolicy  # httpx: only servers need it

        allowed = self.allowed_media_domains
        return MediaPolicy(
            allowed_domains=frozenset(allowed) if allowed is not None else None,
            allow_private_networks=self.allow_private_media_networks,
            allow_redirects=self.media_allow_redirects,
            max_bytes=self.max_media_bytes,
            timeout_s=self.media_timeout_s,
            allowed_local_path=self.allowed_local_media_path,
            max_images_per_request=self.max_images_per_request,
            max_image_pixels_per_request=self.max_image_pixels_per_request,
        )

    def request_template_limits(self) -> TemplateLimits:
        """The ``--request-template-*`` flags as the template workers' limits."""
        from tokenwire.text.chat_template import TemplateLimits

        return TemplateLimits(
            workers=self.request_template_workers,
            timeout_s=self.request_template_timeout_s,
            max_chars=self.request_template_max_chars,
            memory_bytes=self.request_template_memory_bytes,
        )


def asset_cache_dir() -> Path:
    """Root of the cached model assets: ``$TOKENWIRE_CACHE`` or ``~/.cache/tokenwire``."""
    env = os.environ.get("TOKENWIRE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenwire"


LLAMA_CPP_SDIST_ENV = "TOKENWIRE_LLAMA_CPP_SDIST"


def llama_cpp_sdist_override() -> Path | None:
    """A local llama-cpp-python sdist to use before the cache or ``pip download``."""
    env = os.environ.get(LLAMA_CPP_SDIST_ENV)
    return Path(env) if env else None


def _env(name: str) -> str | None:
    return os.environ.get(f"TOKENWIRE_{name.upper()}")


def _env_bool(name: str) -> bool:
    value = _env(name)
    return value is not None and value.strip().lower() in {"1", "true", "yes", "on"}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM-style flags; each default may come from ``TOKENWIRE_<FLAG>``."""
    d = Settings()
    add = parser.add_argument

    def env_or(name: str, default: object) -> object:
        value = _env(name)
        return default if value is None else value

    add("--model", default=env_or("model", d.model), help="HF dir, GGUF file or asset name")
    add("--served-model-name", nargs="+", default=_split(_env("served_model_name")))
    add("--host", default=env_or("host", d.host))
    add("--port", type=int, default=env_or("port", d.port))
    add("--max-model-len", type=int, default=env_or("max_model_len", None))
    add("--chat-template", type=Path, default=env_or("chat_template", None))
    add("--api-key", default=env_or("api_key", None))
    add(
        "--trust-request-chat-template",
        action="store_true",
        default=_env_bool("trust_request_chat_template"),
    )
    add(
        "--request-template-workers",
        type=int,
        default=env_or("request_template_workers", d.request_template_workers),
        help="processes rendering request templates; more requests wait",
    )
    add(
        "--request-template-timeout-s",
        type=float,
        default=env_or("request_template_timeout_s", d.request_template_timeout_s),
    )
    add(
        "--request-template-max-chars",
        type=int,
        default=env_or("request_template_max_chars", d.request_template_max_chars),
        help="rendered text and each filter result of a request template",
    )
    add(
        "--request-template-memory-bytes",
        type=int,
        default=env_or("request_template_memory_bytes", d.request_template_memory_bytes),
    )
    add("--max-request-bytes", type=int, default=env_or("max_request_bytes", d.max_request_bytes))
    add(
        "--request-read-timeout-s",
        type=float,
        default=env_or("request_read_timeout_s", d.request_read_timeout_s),
        help="a request body must arrive within this many seconds (else 408)",
    )
    add(
        "--shutdown-timeout",
        dest="shutdown_timeout_s",
        type=float,
        default=env_or("shutdown_timeout", d.shutdown_timeout_s),
        help="on SIGTERM, seconds running requests get to finish before they are aborted",
    )
    add(
        "--log-level",
        default=env_or("log_level", d.log_level),
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    add("--max-num-seqs", type=int, default=env_or("max_num_seqs", d.max_num_seqs))
    add("--max-n", type=int, default=env_or("max_n", d.max_n), help="largest n per request")
    add(
        "--max-logprobs",
        type=int,
        default=env_or("max_logprobs", d.max_logprobs),
        help="most logprobs, top_logprobs or prompt_logprobs a request may ask (-1: vocabulary)",
    )
    add(
        "--prefix-cache-bytes",
        type=int,
        default=env_or("prefix_cache_bytes", d.prefix_cache_bytes),
        help="KV the hf engine keeps to reuse repeated prompt prefixes (0: off)",
    )
    add(
        "--reasoning-parser",
        default=env_or("reasoning_parser", None),
        choices=REASONING_PARSER_NAMES,
    )
    add("--tool-call-parser", default=env_or("tool_call_parser", None), choices=TOOL_PARSER_NAMES)
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        default=_env_bool("enable_auto_tool_choice"),
    )
    add("--allowed-media-domains", nargs="+", default=_split(_env("allowed_media_domains")))
    add(
        "--allow-private-media-networks",
        action="store_true",
        default=_env_bool("allow_private_media_networks"),
    )
    add("--media-allow-redirects", action="store_true", default=_env_bool("media_allow_redirects"))
    add("--max-media-bytes", type=int, default=env_or("max_media_bytes", d.max_media_bytes))
    add("--media-timeout-s", type=float, default=env_or("media_timeout_s", d.media_timeout_s))
    add("--allowed-local-media-path", type=Path, default=env_or("allowed_local_media_path", None))
    add("--media-cache-bytes", type=int, default=env_or("media_cache_bytes", d.media_cache_bytes))
    add(
        "--max-images-per-request",
        type=int,
        default=env_or("max_images_per_request", d.max_images_per_request),
    )
    add(
        "--max-image-pixels-per-request",
        type=int,
        default=env_or("max_image_pixels_per_request", d.max_image_pixels_per_request),
        help="pixels one request may make the server decode (read from image headers first)",
    )
    add("--device", default=env_or("device", None), help="cpu or cuda (default: cuda if present)")
    add(
        "--enable-rl-control",
        action="store_true",
        default=_env_bool("enable_rl_control"),
        help="serve pause/resume, weight reload and weight version routes",
    )
    add(
        "--max-held-requests",
        type=int,
        default=env_or("max_held_requests", d.max_held_requests),
        help="requests that may wait out SGLang's /pause_generation at once; more get a 503",
    )
    add(
        "--engine",
        default=env_or("engine", d.engine),
        choices=ENGINE_KINDS,
        help="hf (transformers, CPU/CUDA) or vllm (vLLM's AsyncLLM; other vLLM flags pass through)",
    )
    add(
        "--dtype",
        default=env_or("dtype", d.dtype),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations (auto: the model's; vLLM's auto is bfloat16 on CPU)",
    )


def _split(value: str | None) -> list[str] | None:
    return value.split(",") if value else None


def settings_from_args(args: argparse.Namespace, engine_args: Sequence[str] = ()) -> Settings:
    """``engine_args``: the flags argparse did not know, for ``--engine vllm`` only."""
    values = {f.name: getattr(args, f.name) for f in fields(Settings) if hasattr(args, f.name)}
    if engine_args and values.get("engine") != "vllm":
        raise ValueError(f"unknown arguments {list(engine_args)} (vLLM flags need --engine vllm)")
    values["engine_args"] = tuple(engine_args)
    for name in ("served_model_name", "allowed_media_domains"):
        if values.get(name) is not None:
            values[name] = tuple(values[name])
    values["served_model_name"] = values.get("served_model_name") or ()
    for name in (
        "port",
        "max_model_len",
        "max_request_bytes",
        "max_num_seqs",
        "max_n",
        "max_logprobs",
        "max_held_requests",
        "prefix_cache_bytes",
        "max_media_bytes",
        "media_cache_bytes",
        "max_images_per_request",
        "max_image_pixels_per_request",
        "request_template_workers",
        "request_template_max_chars",
        "request_template_memory_bytes",
    ):
        if values.get(name) is not None:
            values[name] = int(values[name])
    for name in (
        "media_timeout_s",
        "request_template_timeout_s",
        "request_read_timeout_s",
        "shutdown_timeout_s",
    ):
        values[name] = float(values[name])
    if values.get("prefix_cache_bytes", 0) < 0:
        raise ValueError("--prefix-cache-bytes must be >= 0 (0 turns the prefix cache off)")
    if values.get("max_logprobs", 0) < -1:
        raise ValueError("--max-logprobs must be >= -1 (-1: the vocabulary size)")
    if values.get("max_held_requests", 0) < 0:
        raise ValueError("--max-held-requests must be >= 0")
    for name in ("chat_template", "allowed_local_media_path"):
        if values.get(name) is not None:
            values[name] = Path(values[name])
    return Settings(**values)


def parse_serve_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="tokenwire serve")
    add_serve_arguments(parser)
    args, unknown = parser.parse_known_args(argv)
    try:
        return settings_from_args(args, unknown)
    except ValueError as exc:
        parser.error(str(exc))
