"""Weight sync from real trainer processes into a running ``tokenwire serve``, end to end, over
NCCL on one GPU (``--backend nccl --device cuda``) or gloo (``--backend gloo``, also on CPU:
how it is checked without a GPU). ``scripts/gpu_weight_sync.sh`` runs it on the GPU machine.

    PYTHONPATH=src python3 scripts/gpu_weight_sync.py --backend nccl --device cuda [--out DIR]
    python scripts/gpu_weight_sync.py --backend gloo --device cpu

It builds a small model (SmolLM2's architecture and tokenizer, ``LAYERS`` layers, seeded random
weights) from the asset files in ``.gpu-assets/`` (``scripts/gpu_prepare.sh``; else tokenwire's
smollm2 asset in the cache), starts the server on ``--device`` with ``--enable-rl-control`` and
``--weight-transfer-config {"backend": BACKEND}``, then one row per sender, each a trainer
process (on CUDA for nccl) that takes one AdamW step from the base weights and sends them while
a request is frozen in flight by a ``keep`` pause:

- ``plain``: ``tests.frameworks.plain_trainer`` (``init_process_group`` + ``dist.broadcast``
  per tensor, vLLM's four phases over plain HTTP). The server joins a trainer's default group
  over gloo only: under nccl the row checks that ``/init_weight_transfer_engine`` is refused
  at once (400) and the server stays up.
- ``sglang``: the group as SGLang's ``init_custom_process_group`` makes it (skyrl-train, AReaL,
  OpenRLHF, verl): ``PrefixStore(group_name, TCPStore)``; ``/init_weights_update_group``, then
  bucketed ``/update_weights_from_distributed`` beside the broadcasts, ``/update_weight_version``,
  ``/destroy_weights_update_group``.
- ``sender``: tokenwire's ``WeightSender`` (``backend=BACKEND``; vLLM's routes with
  ``init_info.group_name``).
- ``missent`` (last): the SGLang form announcing two tensors and sending them swapped, the
  first sent larger than announced: it must be a 4xx with the server alive, the frozen request
  finishing and the old weights kept.

After each update: the frozen request finishes with its tokens named by the old version then
the new; ``/weight_info`` names the new version; greedy ``/inference/v1/generate`` logprobs
equal a float32 transformers forward (on CPU) of the trainer's saved weights within 1e-4 (and
differ from the base weights'). The base weights are reloaded before each row. Prints a table;
exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# tokenwire from this tree, and tests.* (the trainers reused here) importable.
for _path in (ROOT, ROOT / "src"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

ASSET_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
ASSETS = ROOT / ".gpu-assets"
CACHED_ASSET = Path("~/.cache/tokenwire/models/smollm2-135m-instruct").expanduser()
LAYERS = 2
SEED = 0
TOLERANCE = 1e-4
# The frozen request: long enough to still run when the pause lands, even on a GPU.
HELD_TOKENS = 512
GREEDY = {"temperature": 0, "max_tokens": 8, "logprobs": 0}
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
GROUP_NAME = "weight_update_group"
# Joining, and each broadcast, wait at most this long (server and trainers).
TRANSFER_TIMEOUT_S = 20
TRAINER_TIMEOUT_S = 300
# Two processes on one GPU: NCCL refuses two ranks of one communicator on the same device
# ("Duplicate GPU detected") unless they look like different hosts; then they talk over
# loopback sockets. Each process adds its own NCCL_HOSTID.
NCCL_ENV = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_env(backend: str, host_id: str) -> dict[str, str]:
    """The environment of a server or trainer process (unbuffered; tokenwire and tests.*
    importable; NCCL's per-process host id)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no progress bars in the table's log
    paths = [str(ROOT / "src"), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if backend == "nccl":
        env.update(NCCL_ENV, NCCL_HOSTID=host_id)
    return env


# -- the model ------------------------------------------------------------------------------


def asset_dir(explicit: str | None) -> Path:
    for candidate in filter(None, [explicit and Path(explicit), ASSETS, CACHED_ASSET]):
        if all((candidate / name).is_file() for name in ASSET_FILES):
            return candidate
    raise SystemExit(
        f"no asset files ({', '.join(ASSET_FILES)}) in {ASSETS} or {CACHED_ASSET}: run "
        "scripts/gpu_prepare.sh (or `tokenwire prepare smollm2-135m-instruct`) first"
    )


def build_model(assets: Path, out: Path) -> Path:
    """SmolLM2's config with ``LAYERS`` layers, seeded random float32 weights, SmolLM2's
    tokenizer, chat template and generation config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(assets)
    config.num_hidden_layers = LAYERS
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out)
    for name in ASSET_FILES[1:]:
        shutil.copyfile(assets / name, out / name)
    return out


def load_model(model_dir: Path | str, device: str = "cpu") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device)


def trained_model(model_dir: str, out_dir: str, device: str) -> Any:
    """The trainer's model after one optimizer step, its weights saved to ``out_dir`` (the
    parity reference)."""
    from tests.weight_trainer import one_step

    model = load_model(model_dir, device)
    one_step(model)
    model.save_pretrained(out_dir)
    return model


def reference_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> tuple:
    """A trainer's view of ``output`` (float32, CPU): each token's log-softmax, and how far
    each lies below its position's best (0 where it is the argmax)."""
    import torch

    model = load_model(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    chosen = [logprobs[i, t].item() for i, t in enumerate(output)]
    below = [logprobs[i].max().item() - value for i, value in enumerate(chosen)]
    return chosen, below


# -- the server -----------------------------------------------------------------------------


class Server:
    """``python -m tokenwire.cli serve`` from this tree; its log in ``log_path``."""

    def __init__(self, model_dir: Path, backend: str, device: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        transfer = json.dumps({"backend": backend, "timeout_s": TRANSFER_TIMEOUT_S})
        command = [
            sys.executable,
            *("-m", "tokenwire.cli", "serve", "--model", str(model_dir)),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--device", device, "--dtype", "float32", "--enable-rl-control"),
            *("--weight-transfer-config", transfer, "--session-store", ":memory:"),
        ]
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=process_env(backend, "tokenwire-server"),
        )

    def wait_ready(self, timeout_s: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready in {timeout_s} s:\n{self.tail()}")

    def alive(self) -> bool:
        import httpx

        if self.process.poll() is not None:
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=10).status_code == 200
        except httpx.TransportError:
            return False

    def tail(self, chars: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def ok(response: Any) -> Any:
    if response.status_code != 200:
        raise Check(
            f"{response.request.method} {response.request.url.path}: "
            f"{response.status_code} {response.text[:300]}"
        )
    return response.json() if response.content else None


class Check(AssertionError):
    """A check that failed: the row's detail."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Check(message)


class Stream:
    """A streaming greedy generate read on a thread."""

    def __init__(self, url: str, ids: list[int], max_tokens: int) -> None:
        self.chunks: list[dict] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.body = {
            "token_ids": ids,
            "stream": True,
            "sampling_params": {
                "temperature": 0,
                "logprobs": 0,
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
        }
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()

    def _run(self, url: str) -> None:
        import httpx

        try:
            with (
                httpx.Client(base_url=url, timeout=600) as client,
                client.stream("POST", "/inference/v1/generate", json=self.body) as response,
            ):
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks.append(json.loads(line[6:]))
        except BaseException as exc:  # the server died: the row says so
            self.error = exc
        finally:
            self.done.set()

    def tokens(self) -> list[int]:
        return [t for c in self.chunks for ch in c["choices"] for t in ch["token_ids"]]

    def wait_for_tokens(self, count: int) -> None:
        deadline = time.monotonic() + 120
        while len(self.tokens()) < count:
            check(not self.done.is_set(), f"the held request ended early: {self.error}")
            check(time.monotonic() < deadline, "the held request stalled")
            time.sleep(0.01)

    def final(self, timeout_s: float = 300) -> dict:
        check(self.done.wait(timeout_s), "the held request did not end")
        check(self.error is None, f"the held request failed: {self.error!r}")
        finals = [ch for c in self.chunks for ch in c["choices"] if ch.get("finish_reason")]
        check(bool(finals), "the held request ended without a finish reason")
        return finals[0]


# -- trainer processes (this file's ``trainer`` subcommand, or a module of tests/) ----------


class Trainer:
    """A trainer process: "ready" once its group formed; sends on ``go()``."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, word: str, timeout_s: float = TRAINER_TIMEOUT_S) -> str:
        """The line that starts with ``word`` (frameworks log to stdout too)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise Check(f"the trainer said no {word!r} in {timeout_s:g} s") from None
            if line is None:
                code = self.process.wait()
                raise Check(f"the trainer exited ({code}) before {word!r}: {self.stderr()}")
            if line.split(" ", 1)[0] == word:
                return line

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def stderr(self) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace").strip()
        return " | ".join(text.splitlines()[-6:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()


def sglang_group(backend: str, port: int, world_size: int, group_name: str) -> Any:
    """Rank 0 of the group exactly as SGLang's ``init_custom_process_group`` makes it (as
    skyrl-train, AReaL, OpenRLHF and verl call it): the rendezvous store wrapped in
    ``PrefixStore(group_name, store)``, the group named ``group_name``."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=TRANSFER_TIMEOUT_S)
    url = f"tcp://127.0.0.1:{port}"
    store, rank, world_size = next(rendezvous(url, 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def buckets(named: list[tuple[str, Any]], limit_bytes: int) -> list[list[tuple[str, Any]]]:
    """AReaL's cut: a bucket closes before the tensor that would take it past the limit."""
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > limit_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def _post_in_thread(client: Any, path: str, body: dict) -> tuple[threading.Thread, dict]:
    answer: dict[str, Any] = {}

    def post() -> None:
        try:
            answer["response"] = client.post(path, json=body)
        except Exception as exc:
            answer["error"] = exc

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread, answer


def _answer(thread: threading.Thread, answer: dict, timeout_s: float) -> Any:
    thread.join(timeout_s)
    if thread.is_alive():
        raise RuntimeError(f"no answer in {timeout_s:g} s")
    if "error" in answer:
        raise answer["error"]
    return answer["response"]


def trainer_sglang(
    model_dir: str, out_dir: str, url: str, backend: str, device: str, missent: str
) -> None:
    """SGLang's routes from a trainer that made its group SGLang's way (``sglang_group``)."""
    import httpx
    import torch
    import torch.distributed as dist

    model = trained_model(model_dir, out_dir, device)
    server = httpx.Client(base_url=url, timeout=TRAINER_TIMEOUT_S)
    port = free_port()
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": GROUP_NAME,
        "backend": backend,
    }
    thread, answer = _post_in_thread(server, "/init_weights_update_group", init)
    group = sglang_group(backend, port, 2, GROUP_NAME)
    joined = _answer(thread, answer, TRANSFER_TIMEOUT_S + 20)
    if joined.status_code != 200 or not joined.json().get("success", True):
        raise SystemExit(f"init_weights_update_group: {joined.status_code} {joined.text}")
    print("ready", flush=True)
    sys.stdin.readline()
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    if missent == "missent":
        # Announced: a small tensor, then a large one; sent the other way round.
        small = next((n, t) for n, t in named if t.dim() == 1)
        large = next((n, t) for n, t in named if t.dim() == 2 and t.numel() > 4 * small[1].numel())
        body = {
            "names": [small[0], large[0]],
            "dtypes": ["float32", "float32"],
            "shapes": [list(small[1].shape), list(large[1].shape)],
            "group_name": GROUP_NAME,
        }
        thread, answer = _post_in_thread(server, "/update_weights_from_distributed", body)
        broken = ""
        try:
            for tensor in (large[1], small[1]):
                dist.broadcast(tensor, src=0, group=group)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # the server closed its end: its answer says why
            broken = f" (broadcast: {type(exc).__name__})"
        try:
            response = _answer(thread, answer, TRANSFER_TIMEOUT_S + 30)
            print(f"status {response.status_code} {response.text[:300]}{broken}", flush=True)
        except Exception as exc:
            print(f"status none {type(exc).__name__}: {exc}{broken}", flush=True)
        os._exit(0)  # the group may be wedged: no teardown to hang in
    for bucket in buckets(named, 32 * 1024 * 1024):
        body = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": GROUP_NAME,
            "flush_cache": True,
        }
        thread, answer = _post_in_thread(server, "/update_weights_from_distributed", body)
        for _, tensor in bucket:
            dist.broadcast(tensor, src=0, group=group)
        response = _answer(thread, answer, TRAINER_TIMEOUT_S)
        if response.status_code != 200 or not response.json().get("success", True):
            raise SystemExit(f"update_weights_from_distributed: {response.text[:300]}")
    if device == "cuda":
        torch.cuda.synchronize()
    destroyed = server.post("/destroy_weights_update_group", json={"group_name": GROUP_NAME})
    if destroyed.status_code != 200:
        raise SystemExit(f"destroy_weights_update_group: {destroyed.text[:300]}")
    dist.destroy_process_group(group)
    print("sent", flush=True)


def trainer_sender(
    model_dir: str, out_dir: str, url: str, backend: str, device: str, version: str
) -> None:
    """tokenwire's ``WeightSender`` over ``backend``."""
    from tokenwire.client import Client
    from tokenwire.client.weights import WeightSender

    model = trained_model(model_dir, out_dir, device)
    sender = WeightSender([Client(url)], backend=backend, timeout_s=TRANSFER_TIMEOUT_S)
    sender.connect()
    print("ready", flush=True)
    sys.stdin.readline()
    sender.send(model, version=version)
    sender.close()
    print("sent", flush=True)


# -- the rows -------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    form: str
    result: str = "FAIL"
    seconds: float = 0.0
    detail: str = ""


class Run:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.backend = args.backend
        self.device = args.device
        # The trainer on the server's device for nccl; gloo trainers send CPU tensors.
        self.trainer_device = "cuda" if args.backend == "nccl" else "cpu"
        self.work = work
        self.base_dir = work / "base"
        self.server: Server | None = None
        self.prompt: list[int] = []
        self.rows: list[Row] = []

    def client(self) -> Any:
        import httpx

        assert self.server is not None
        return httpx.Client(base_url=self.server.url, timeout=TRAINER_TIMEOUT_S)

    def row(self, name: str, form: str, body: Callable[[Row], None]) -> None:
        row = Row(name, form)
        start = time.monotonic()
        print(f"== {name}: {form}", flush=True)
        try:
            body(row)
            if row.result == "FAIL":
                row.result = "PASS"
        except Exception as exc:
            row.result = "FAIL"
            row.detail = f"{type(exc).__name__}: {exc}" if not isinstance(exc, Check) else str(exc)
            if not isinstance(exc, Check):
                traceback.print_exc()
        row.seconds = time.monotonic() - start
        print(f"   {row.result} ({row.seconds:.1f} s) {row.detail}", flush=True)
        self.rows.append(row)

    def trainer(self, name: str, command: list[str]) -> Trainer:
        env = process_env(self.backend, "tokenwire-trainer")
        return Trainer([sys.executable, *command], env, self.work / f"trainer-{name}.log")

    # The shared steps.

    def reload_base(self) -> None:
        with self.client() as client:
            reload = {"weight_dir": str(self.base_dir), "weight_version": "base"}
            ok(client.post("/update_weights", json=reload))
            ok(client.post("/resume"))

    def greedy(self) -> dict:
        with self.client() as client:
            body = {"token_ids": self.prompt, "sampling_params": GREEDY}
            return ok(client.post("/inference/v1/generate", json=body))["choices"][0]

    def parity(self, model_dir: Path, version: str, *, changed_from: Path | None) -> str:
        """Greedy logprobs against a forward of ``model_dir``; the version on every token."""
        choice = self.greedy()
        ids = choice["token_ids"]
        spans = choice["weight_versions"]
        check(
            spans == [{"version": version, "start": 0, "end": len(ids)}],
            f"greedy tokens' versions {spans}, not {version!r}",
        )
        got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        want, below = reference_logprobs(model_dir, self.prompt, ids)
        diff = max(abs(a - b) for a, b in zip(got, want, strict=True))
        check(diff <= TOLERANCE, f"logprobs off a transformers forward by {diff:.2e}")
        check(max(below) <= TOLERANCE, f"a greedy token {max(below):.2e} below the argmax")
        detail = f"max |dlogprob| {diff:.1e}"
        if changed_from is not None:
            old, _ = reference_logprobs(changed_from, self.prompt, ids)
            moved = max(abs(a - b) for a, b in zip(got, old, strict=True))
            check(moved > 1e-3, f"logprobs within {moved:.1e} of the base weights': no update")
            detail += f", {moved:.1e} from base"
        return detail

    def held_update(self, row: Row, trainer: Trainer, version: str, *, name_it: bool) -> None:
        """Freeze a request (keep), let the trainer send, (name the version,) resume; the
        request ends with its tokens named base, then ``version``."""
        trainer.expect("ready")
        held = Stream(self.server.url, self.prompt, HELD_TOKENS)  # type: ignore[union-attr]
        held.wait_for_tokens(2)
        with self.client() as client:
            ok(client.post("/pause", params={"mode": "keep"}))
            frozen = len(held.tokens())
            start = time.monotonic()
            trainer.go()
            trainer.expect("sent")
            seconds = time.monotonic() - start
            if name_it:
                ok(client.post("/update_weight_version", json={"new_version": version}))
            ok(client.post("/resume"))
            final = held.final()
            info = ok(client.get("/weight_info"))
        check(frozen < HELD_TOKENS, "the held request finished before the pause")
        check(final["finish_reason"] == "length", f"held request: {final['finish_reason']}")
        versions = [span["version"] for span in final["weight_versions"]]
        check(versions == ["base", version], f"held request's versions {versions}")
        check(info.get("weight_version") == version, f"/weight_info {info}")
        row.detail = f"update {seconds:.2f} s; held request base->{version}; "

    # The rows.

    def row_base(self, row: Row) -> None:
        self.reload_base()
        row.detail = self.parity(self.base_dir, "base", changed_from=None)

    def row_plain(self, row: Row) -> None:
        self.reload_base()
        if self.backend != "gloo":
            self._plain_refused(row)
            return
        trained = self.work / "trained-plain"
        trainer = self.trainer(
            "plain",
            [
                *("-m", "tests.frameworks.plain_trainer"),
                *(str(self.base_dir), str(trained), "plain-1", self.server.url),  # type: ignore[union-attr]
            ],
        )
        try:
            self.held_update(row, trainer, "plain-1", name_it=False)
        finally:
            trainer.stop()
        row.detail += self.parity(trained, "plain-1", changed_from=self.base_dir)

    def _plain_refused(self, row: Row) -> None:
        """A trainer's default group over nccl: refused before anything is dialled."""
        init = {"master_address": "127.0.0.1", "master_port": free_port()}
        init |= {"rank_offset": 1, "world_size": 2}
        start = time.monotonic()
        with self.client() as client:
            response = client.post("/init_weight_transfer_engine", json={"init_info": init})
        seconds = time.monotonic() - start
        check(response.status_code == 400, f"{response.status_code} {response.text[:300]}")
        check("gloo" in response.text, f"400 without the reason: {response.text[:300]}")
        check(seconds < 10, f"refused after {seconds:.1f} s")
        check(self.server.alive(), "the server died")  # type: ignore[union-attr]
        row.result = "REFUSED"
        row.detail = f"400 in {seconds:.2f} s as documented (default group: gloo only)"

    def row_sglang(self, row: Row) -> None:
        self.reload_base()
        trained = self.work / "trained-sglang"
        trainer = self.trainer("sglang", self._sglang_command(trained, "all"))
        try:
            self.held_update(row, trainer, "sglang-1", name_it=True)
        finally:
            trainer.stop()
        row.detail += self.parity(trained, "sglang-1", changed_from=self.base_dir)

    def _sglang_command(self, trained: Path, what: str) -> list[str]:
        assert self.server is not None
        return [
            str(Path(__file__).resolve()),
            *("trainer", "sglang", str(self.base_dir), str(trained), self.server.url),
            *(self.backend, self.trainer_device, what),
        ]

    def row_sender(self, row: Row) -> None:
        self.reload_base()
        assert self.server is not None
        trained = self.work / "trained-sender"
        command = [
            str(Path(__file__).resolve()),
            *("trainer", "sender", str(self.base_dir), str(trained), self.server.url),
            *(self.backend, self.trainer_device, "sender-1"),
        ]
        trainer = self.trainer("sender", command)
        try:
            self.held_update(row, trainer, "sender-1", name_it=False)
        finally:
            trainer.stop()
        row.detail += self.parity(trained, "sender-1", changed_from=self.base_dir)

    def row_missent(self, row: Row) -> None:
        """Two tensors announced, sent swapped, the first sent larger than announced."""
        assert self.server is not None
        self.reload_base()
        before = self.greedy()
        trainer = self.trainer("missent", self._sglang_command(self.work / "unused", "missent"))
        try:
            trainer.expect("ready")
            held = Stream(self.server.url, self.prompt, HELD_TOKENS)
            held.wait_for_tokens(2)
            with self.client() as client:
                ok(client.post("/pause", params={"mode": "keep"}))
                trainer.go()
                status = trainer.expect("status", TRANSFER_TIMEOUT_S + 60)
        finally:
            trainer.stop()
        code = status.split(" ", 2)[1]
        alive = self.server.alive()
        row.detail = f"update answered {status.removeprefix('status ')[:160]}"
        check(alive, f"the server died: {row.detail}")
        check(code.isdigit() and 400 <= int(code) < 500, row.detail)
        with self.client() as client:
            ok(client.post("/resume"))
            final = held.final()
            info = ok(client.get("/weight_info"))
        check(final["finish_reason"] == "length", f"held request: {final['finish_reason']}")
        check(info.get("weight_version") == "base", f"/weight_info {info}")
        after = self.greedy()
        check(after["token_ids"] == before["token_ids"], "greedy ids changed: weights not kept")
        got = [e["logprob"] for e in after["logprobs"]["content"]]
        was = [e["logprob"] for e in before["logprobs"]["content"]]
        check(got == was, "greedy logprobs changed: the old weights were not kept")
        answer = status.split(" ", 2)[2] if status.count(" ") >= 2 else ""
        row.detail = f"{code}, server up, held request finished, old weights kept: {answer[:200]}"

    def summary(self) -> int:
        width = max(len(r.name) for r in self.rows)
        form_width = max(len(r.form) for r in self.rows)
        print()
        print(
            f"== gpu_weight_sync: backend {self.backend}, server on {self.device}, "
            f"trainers on {self.trainer_device} =="
        )
        for r in self.rows:
            print(
                f"{r.name:<{width}}  {r.form:<{form_width}}  {r.result:<7}  "
                f"{r.seconds:6.1f} s  {r.detail}"
            )
        failed = [r.name for r in self.rows if r.result == "FAIL"]
        print(f"{len(self.rows) - len(failed)} passed, {len(failed)} failed")
        return 1 if failed else 0


def versions_line(device: str) -> str:
    import torch
    import transformers

    parts = [
        f"python {sys.version.split()[0]}",
        f"torch {torch.__version__}",
        f"transformers {transformers.__version__}",
    ]
    if device == "cuda":
        parts.append(f"cuda {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
        parts.append("nccl " + ".".join(map(str, torch.cuda.nccl.version())))
    return ", ".join(parts)


def orchestrate(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.backend == "nccl" and args.device != "cuda":
        raise SystemExit("--backend nccl needs --device cuda")
    # A timeout's SIGTERM ends the run through its cleanup (the server and trainers stopped).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-weight-sync-"))
    work.mkdir(parents=True, exist_ok=True)
    print(versions_line(args.device), flush=True)
    run = Run(args, work)
    build_model(asset_dir(args.assets), run.base_dir)
    run.server = Server(run.base_dir, args.backend, args.device, work / "server.log")
    status = 1
    try:
        run.server.wait_ready()
        with run.client() as client:
            run.prompt = ok(client.post("/tokenize", json={"messages": PROMPT}))["tokens"]
        rows = {
            "base": ("the server on the base weights", run.row_base),
            "plain": ("init_process_group + vLLM's four phases", run.row_plain),
            "sglang": ("SGLang's init_custom_process_group + routes", run.row_sglang),
            "sender": ("tokenwire WeightSender (vLLM's routes)", run.row_sender),
            "missent": ("SGLang form, larger tensor than announced", run.row_missent),
        }
        for name in args.rows.split(","):
            form, body = rows[name]
            run.row(name, f"{form} [{args.backend}]", body)
        status = run.summary()
    finally:
        alive = run.server.process.poll() is None
        run.server.stop()
        if status or not alive:
            print(f"-- server log tail ({work / 'server.log'}):\n{run.server.tail()}")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(work / "server.log", out / "server.log")
            with open(out / "trainers.log", "w") as logs:
                for log in sorted(work.glob("trainer-*.log")):
                    logs.write(f"== {log.name}\n{log.read_text(errors='replace')}\n")
            rows_json = [vars(r) for r in run.rows]
            (out / "summary.json").write_text(json.dumps(rows_json, indent=1))
    return status


def main(argv: list[str]) -> int:
    if argv[:1] == ["trainer"]:
        kind, *rest = argv[1:]
        {"sglang": trainer_sglang, "sender": trainer_sender}[kind](*rest)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend", default=os.environ.get("BACKEND", "nccl"), choices=["nccl", "gloo"]
    )
    parser.add_argument("--device", default=os.environ.get("DEVICE"), choices=["cuda", "cpu"])
    parser.add_argument(
        "--rows",
        default="base,plain,sglang,sender,missent",
        help="which rows, in order (missent last: it may wedge an nccl group)",
    )
    parser.add_argument("--assets", help=f"the smollm2 asset files (default {ASSETS})")
    parser.add_argument("--work", help="scratch directory (default: a new temporary one)")
    parser.add_argument("--out", help="copy the server log and a summary.json here")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
