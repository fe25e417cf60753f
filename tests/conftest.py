"""Session-wide fixtures: each model's real server starts once, on a free loopback port."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest

from tests.fast_app import FastApp, serve_fast
from tokenwire.engine.base import Engine
from tokenwire.engine.factory import create_engine

T = TypeVar("T")
API_KEY = "test-secret-key"
CONTROL_KEY = "test-control-key"  # control_server's: the trainer's, never the router's
ROUTER_KEY = "test-router-key"  # vllm-router's own --api-key (the servers' --router-api-key)
SERVER_START_TIMEOUT_S = 900  # the first run builds the model assets
# vLLM: float32 for parity with a transformers forward (its auto is bfloat16 on CPU). Default
# flags (--vllm-args): eager mode, as graph capture adds minutes to every start on two cores.
VLLM_TEST_DTYPE = "float32"
VLLM_TEST_ARGS = "--enforce-eager"
# Models vLLM cannot run on CPU: "Unsupported CPU attention configuration: head_dim=16".
VLLM_CPU_UNSUPPORTED = ("qwen3-tiny", "qwen2-vl-tiny", "qwen3-moe-tiny")
# A test that uses one of these (directly or through another fixture) runs a real model: it is
# marked ``model``, as are tests that load or build one themselves. The rest is the fast part:
# ``make test-fast`` runs ``-m "not model"``. The servers, then the in-process models of
# test_engine_hf and test_generate.
MODEL_FIXTURES = frozenset(
    {
        *("smollm2_server", "qwen3_server", "rl_server", "qwen2vl_server", "qwen2vl_strict_server"),
        *("control_server", "lora_server", "lora_adapters", "moe_server"),
        *("engine", "tiny_engine", "vl_engine", "ref_model", "vl_model", "smollm2_model"),
    }
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="the engine every test server and in-process engine runs on (make test-vllm: vllm)",
    )
    parser.addoption(
        "--vllm-args",
        default=VLLM_TEST_ARGS,
        help="vLLM engine flags for --engine vllm (a GPU run: --gpu-memory-utilization 0.2)",
    )


# The engine of this session's servers and its vLLM flags, set before any fixture runs.
SESSION_ENGINE: dict[str, Any] = {"kind": "hf", "vllm_args": []}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hf_only: tests of the hf engine's own internals")
    config.addinivalue_line("markers", "vllm_only: tests of vLLM's engine (make test-vllm)")
    config.addinivalue_line("markers", "model: runs or builds a real model (not in make test-fast)")
    config.addinivalue_line("markers", "bench: a benchmark's smoke run (not in make test-fast)")
    config.addinivalue_line(
        "markers", "bench_model: a model benchmark's smoke run (make bench-smoke, not make test)"
    )
    SESSION_ENGINE["kind"] = config.getoption("engine")
    SESSION_ENGINE["vllm_args"] = shlex.split(config.getoption("vllm_args"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
    other = "vllm_only" if config.getoption("engine") == "hf" else "hf_only"
    skip = pytest.mark.skip(reason=f"{other}: not this session's engine")
    for item in items:
        if other in item.keywords:
            item.add_marker(skip)


# Test servers end after the last test that uses them, not at their fixture's scope end: CI
# runs make test and make test-vllm at once on 24 GiB, and servers left idle until their suite
# ended were much of its peak. Still one server per fixture per session: none starts twice. A
# test's fixtures are known at collection (``item.fixturenames``: what it requests, directly or
# through other fixtures); a fixture only fetched by ``request.getfixturevalue`` never ends early.
LAST_USE: dict[str, int] = {}  # fixture name -> index of the last test that uses it
TEST_INDEX: dict[str, int] = {}  # node id -> index in the session's (selected) tests
EARLY_ENDS: dict[str, Callable[[], None]] = {}  # fixture name -> what ends its live resource


def pytest_collection_finish(session: pytest.Session) -> None:
    for index, item in enumerate(session.items):
        TEST_INDEX[item.nodeid] = index
        for name in getattr(item, "fixturenames", ()):
            LAST_USE[name] = index


def end_after_last_use(request: pytest.FixtureRequest, end: Callable[[], None]) -> None:
    """Call ``end`` once the last test using ``request``'s fixture has run (its own teardown
    still runs at the session's end: ``end`` may be called twice)."""
    if request.fixturename in LAST_USE:
        EARLY_ENDS[request.fixturename] = end


# glibc's malloc_trim, as tokenwire.engine.hf.host_memory has it (importing that package here
# would load the hf engine into every session); None where the C library has none.
try:
    MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
except (OSError, AttributeError):
    MALLOC_TRIM = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)  # the test's own and its finished modules' fixtures are torn down first
    finally:
        index = TEST_INDEX.get(item.nodeid, -1)
        for name in [name for name in EARLY_ENDS if LAST_USE[name] <= index]:
            EARLY_ENDS.pop(name)()
        if nextitem is None or nextitem.path != item.path:
            # A module's engines, apps and models are gone: hand their heap back (make test's
            # pytest held 0.3-0.4 GB less from its middle on, at the same modules).
            gc.collect()
            if MALLOC_TRIM is not None:
                MALLOC_TRIM(0)


# One event loop for every in-process engine call: vLLM's output handler lives on the loop of
# its first request, so each call cannot get a loop of its own (asyncio.run).
ENGINE_LOOP = asyncio.new_event_loop()


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    return ENGINE_LOOP.run_until_complete(coro)


def start_engine(model_dir: Path, *, max_num_seqs: int) -> Engine:
    """An in-process engine of this session's kind on the CPU, started."""
    kind = SESSION_ENGINE["kind"]
    engine_flags(kind, model_dir.name)  # skips what this engine cannot run
    vllm = kind == "vllm"
    engine = create_engine(
        kind,  # type: ignore[arg-type]
        model_dir,
        max_model_len=None,
        max_num_seqs=max_num_seqs,
        device="cpu",
        dtype=VLLM_TEST_DTYPE if vllm else None,
        extra_args=SESSION_ENGINE["vllm_args"] if vllm else (),
    )
    run_async(engine.start())
    return engine


def engine_flags(kind: str, model: str) -> list[str]:
    """Flags that put a test server on ``kind``; skips models that engine cannot run here."""
    if kind == "hf":
        return []
    if model in VLLM_CPU_UNSUPPORTED:
        pytest.skip(f"{model} does not run on vLLM's CPU engine (head_dim 16)")
    return ["--engine", kind, "--dtype", VLLM_TEST_DTYPE, *SESSION_ENGINE["vllm_args"]]


# The qwen3 test server's flags: Qwen3 tokenizer and template with parsers, trusted request
# templates (with tighter time and memory caps than the defaults, so the tests that hit them are
# quick and light). The fast tests' in-process qwen3 app takes the same flags.
QWEN3_SERVER_ARGS = [
    "--model",
    "qwen3-tiny",
    "--served-model-name",
    "qwen3-tiny",
    "qwen3-alias",
    "--trust-request-chat-template",
    "--request-template-timeout-s",
    # Wall time: the memory-cap template needs ~0.2 s of CPU, which took over 2 s on a
    # machine with a load average of 11.
    "5",
    "--request-template-memory-bytes",
    str(256 * 2**20),
    "--reasoning-parser",
    "qwen3",
    "--tool-call-parser",
    "hermes",
    "--enable-auto-tool-choice",
    "--max-request-bytes",
    str(4 * 2**20),
    "--max-model-len",
    "4096",
    "--request-read-timeout-s",
    "3",
]
RL_SERVER_ARGS = [
    *("--enable-rl-control", "--max-logprobs", "-1", "--max-held-requests", "2"),
    # behind vllm-router (tests/test_router.py) as README "Scale out" sets a fleet up
    *("--router-api-key", ROUTER_KEY),
    # weights from a trainer's group; a broken-off broadcast fails within 20 s
    *("--weight-transfer-config", '{"backend": "gloo", "timeout_s": 20}'),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A ``tokenwire serve`` subprocess; its log goes to a file shown when start-up fails."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        api_key: str | None = None,
        module: str = "tokenwire.cli",
    ) -> None:
        """``module``: what runs as ``python -m`` (a test's wrapper of ``tokenwire.cli``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        command = [sys.executable, "-m", module, "serve", "--port", str(self.port), *args]
        if api_key:
            command += ["--api-key", api_key]
        if "--session-store" not in args:
            # Its own store: the default one in the user's cache outlives the run (a store left
            # there by another checkout's schema made a session turn of the tour a 500).
            command += ["--session-store", str(log_path.parent / "sessions.sqlite3")]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log_path.read_text()[-5000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready in time:\n{self.log_path.read_text()[-5000:]}")

    def client(self, **kwargs: object) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, **kwargs)

    def stop(self) -> None:
        """End the server (again: nothing; an early end comes before the fixture's own)."""
        if self.log.closed:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def _start(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    args: list[str],
    api_key: str | None = None,
    request: pytest.FixtureRequest | None = None,
) -> Iterator[Server]:
    """``request``: a session fixture's, whose server then ends after its last test."""
    model = args[args.index("--model") + 1] if "--model" in args else "smollm2-135m-instruct"
    args = [*args, *engine_flags(SESSION_ENGINE["kind"], model)]
    server = Server(args, tmp_path_factory.mktemp(name) / "server.log", api_key=api_key)
    try:
        server.wait_ready()
        if request is not None:
            end_after_last_use(request, server.stop)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The embedded default model's directory (built on first use)."""
    from tokenwire.assets import prepare

    return Path(prepare("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tokenizer(smol_dir: Path) -> Any:
    """SmolLM2's transformers tokenizer (the reference the engine tests compare against)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def ref_model(smol_dir: Path) -> Any:
    """SmolLM2 in float32 as a trainer loads it: one forward is the parity reference."""
    return smollm2_float32(smol_dir)


@pytest.fixture(scope="session")
def smollm2_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The embedded default, started with no arguments but the port."""
    yield from _start(tmp_path_factory, "smollm2", [], request=request)


@pytest.fixture(scope="session")
def qwen3_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """Qwen3-tiny with ``QWEN3_SERVER_ARGS`` and an API key."""
    yield from _start(tmp_path_factory, "qwen3", QWEN3_SERVER_ARGS, API_KEY, request)


@pytest.fixture(scope="session")
def rl_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """SmolLM2 with the RL control routes, for tests that pause it and swap its weights; any
    logprob count is allowed (``--max-logprobs -1``, as TRL's docs start vLLM), and SGLang's
    pause holds at most two requests."""
    yield from _start(tmp_path_factory, "rl", RL_SERVER_ARGS, API_KEY, request)


@pytest.fixture(scope="session")
def control_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The RL server as README "Scale out" starts it behind a router: the router's key
    (``API_KEY``) and a control key the router does not hold."""
    args = [*RL_SERVER_ARGS, "--control-api-key", CONTROL_KEY]
    yield from _start(tmp_path_factory, "control", args, API_KEY, request)


# The MoE test server's: routing capture (hf engine only), checkpoint reloads, LoRA adapters and
# weights from a trainer's group; a prefill budget of 48 tokens, so test_moe's prompts prefill
# both batched (21 + 9) and in chunks (50).
MOE_SERVER_ARGS = [
    *("--model", "qwen3-moe-tiny", "--enable-return-routed-experts", "--enable-rl-control"),
    *("--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "48"),
    *("--enable-lora", "--max-lora-rank", "8"),
    *("--weight-transfer-config", '{"backend": "gloo", "timeout_s": 20}'),
]


@pytest.fixture(scope="session")
def moe_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """qwen3-moe-tiny capturing routed experts (``MOE_SERVER_ARGS``)."""
    if SESSION_ENGINE["kind"] != "hf":
        pytest.skip("routed-experts capture is served by the hf engine only")
    yield from _start(tmp_path_factory, "moe", MOE_SERVER_ARGS, request=request)


# The PEFT adapters of ``lora_adapters``: targets, and r = 4, 8, 12 (the last with rsLoRA).
LORA_TARGETS = (["q_proj", "v_proj"], ["q_proj", "k_proj", "o_proj"], ["gate_proj", "down_proj"])


def smollm2_float32(smol_dir: Path) -> Any:
    """A fresh SmolLM2 in float32 (PEFT wraps the model it is given: one per adapter)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> list[Path]:
    """Three PEFT adapters of SmolLM2 (random lora_B, so each changes the model), saved by
    PEFT into one directory."""
    import torch
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    paths = []
    for i, targets in enumerate(LORA_TARGETS):
        torch.manual_seed(i)
        config = LoraConfig(
            r=4 + 4 * i,
            lora_alpha=16,
            target_modules=targets,
            init_lora_weights=False,
            use_rslora=i == 2,
        )
        path = root / f"adapter{i}"
        get_peft_model(smollm2_float32(smol_dir), config).save_pretrained(path)
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def lora_server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    lora_adapters: list[Path],
) -> Iterator[Server]:
    """SmolLM2 with LoRA on: ``a0`` loaded at start-up, adapters from disk only under their
    directory, and from a trainer's group (gloo)."""
    allowed = lora_adapters[0].parent
    args = [
        *("--enable-rl-control", "--enable-lora", "--max-loras", "5", "--max-lora-rank", "16"),
        *("--lora-modules", f"a0={lora_adapters[0]}", "--allowed-lora-paths", str(allowed)),
        *("--max-logprobs", "-1", "--max-num-batched-tokens", "64"),
        *("--weight-transfer-config", '{"backend": "gloo", "timeout_s": 20}'),
    ]
    yield from _start(tmp_path_factory, "lora", args, API_KEY, request)


@pytest.fixture(scope="session")
def fast_smollm2_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastApp]:
    """``smollm2_server``'s app over a fake engine, in process (see ``tests.fast_app``)."""
    yield from serve_fast(tmp_path_factory, [])


@pytest.fixture(scope="session")
def fast_rl_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastApp]:
    """``rl_server``'s app (RL control routes, API key) over a fake engine."""
    yield from serve_fast(tmp_path_factory, RL_SERVER_ARGS, API_KEY)


@pytest.fixture(scope="session")
def fast_qwen3_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastApp]:
    """``qwen3_server``'s app (parsers, API key, request templates) over a fake engine."""
    yield from serve_fast(tmp_path_factory, QWEN3_SERVER_ARGS, API_KEY)


# The control plane's app: LoRA on with two slots, an open weight update abandoned after one
# second without a call of it, processed logprobs unless a request asks (TRL's vllm-serve).
FAST_CONTROL_ARGS = [
    *("--enable-rl-control", "--enable-lora", "--max-loras", "2"),
    *("--logprobs-mode", "processed_logprobs"),
    *("--weight-transfer-config", '{"backend": "gloo", "timeout_s": 1}'),
]


@pytest.fixture(scope="session")
def fast_control_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastApp]:
    yield from serve_fast(tmp_path_factory, FAST_CONTROL_ARGS, API_KEY)


# The same apps for a test that drives the fake engine: put back as they started afterwards.
@pytest.fixture
def fast_smollm2(fast_smollm2_app: FastApp) -> Iterator[FastApp]:
    yield fast_smollm2_app
    fast_smollm2_app.settle()


@pytest.fixture
def fast_rl(fast_rl_app: FastApp) -> Iterator[FastApp]:
    yield fast_rl_app
    fast_rl_app.settle()


@pytest.fixture
def fast_control(fast_control_app: FastApp) -> Iterator[FastApp]:
    yield fast_control_app
    fast_control_app.settle()


@pytest.fixture
def fast_qwen3(fast_qwen3_app: FastApp) -> Iterator[FastApp]:
    yield fast_qwen3_app
    fast_qwen3_app.settle()


@pytest.fixture(scope="session")
def vl_media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder ``qwen2vl_server`` may read ``file:`` media from (tests put files in it)."""
    return tmp_path_factory.mktemp("vl-media")


@pytest.fixture(scope="session")
def qwen2vl_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vl_media_dir: Path
) -> Iterator[Server]:
    """Qwen2-VL tiny that may fetch from loopback (tests serve media on 127.0.0.1).

    Only ``127.0.0.1`` and ``localhost`` are on its allow-list; redirects are followed (each hop
    re-checked); bodies over 1 MiB and fetches over 2 s are refused.
    """
    args = [
        "--model",
        "qwen2-vl-tiny",
        "--allow-private-media-networks",
        "--allowed-media-domains",
        "127.0.0.1",
        "localhost",
        "--media-allow-redirects",
        "--max-media-bytes",
        str(2**20),
        "--media-timeout-s",
        "2",
        "--allowed-local-media-path",
        str(vl_media_dir),
        "--max-model-len",
        "4096",
    ]
    yield from _start(tmp_path_factory, "qwen2vl", args, request=request)


@pytest.fixture(scope="session")
def qwen2vl_strict_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """Qwen2-VL tiny with the default media policy: no private addresses, no redirects."""
    yield from _start(
        tmp_path_factory, "qwen2vl-strict", ["--model", "qwen2-vl-tiny"], request=request
    )


@pytest.fixture(scope="session")
def smollm2(smollm2_server: Server) -> Iterator[httpx.Client]:
    with smollm2_server.client() as client:
        yield client


@pytest.fixture(scope="session")
def qwen3(qwen3_server: Server) -> Iterator[httpx.Client]:
    with qwen3_server.client() as client:
        yield client


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    from tokenwire.assets import prepare

    return prepare("qwen3-tiny")


@pytest.fixture(scope="session")
def qwen3_hf_tokenizer(qwen3_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_dir))


@pytest.fixture(scope="session")
def llama_cpp_models() -> Path:
    from tokenwire.assets import llama_cpp_models_dir

    return llama_cpp_models_dir()


def assert_error(response: httpx.Response, status: int, message_part: str | None = None) -> dict:
    """Every error has the same body; check the status, type and (part of) the message."""
    assert response.status_code == status, response.text
    body = response.json()
    error = body["error"]
    assert error["code"] == status
    assert isinstance(error["type"], str) and error["type"]
    if message_part is not None:
        assert message_part in error["message"], error["message"]
    return error


@pytest.fixture(scope="session")
def smollm2_openai(smollm2_server: Server) -> openai.OpenAI:
    """The real OpenAI client against the embedded default."""
    return openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
