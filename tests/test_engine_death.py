"""A dead engine is a server fault (issue 34): when the hf engine's thread or vLLM's engine core
dies, the requests in flight and every new one get a 503 saying so, /health answers 503,
``tokenwire_engine_dead`` is 1, and the process exits 1 within seconds, so a supervisor restarts
it. Real servers over HTTP on 127.0.0.1, one each: the hf one dies by fault injection
(``tests.dying_server``), vLLM's by ``kill -9`` of its worker (make test-vllm only)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Server, engine_flags
from tests.dying_server import FAULT
from tests.fake_engine import Gate, Step
from tests.fast_app import serve_fast, sse_chunks

# The acceptance's "within seconds", generously: the server itself takes about 2 s.
EXIT_BOUND_S = 20
STARTED_TIMEOUT_S = 120


def generate_body(token_ids: list[int], **extra: Any) -> dict[str, Any]:
    sampling = {"max_tokens": 8000, "ignore_eos": True}
    return {"token_ids": token_ids, "sampling_params": sampling, **extra}


def check_engine_death(server: Server, kill: Callable[[], None], reason: str) -> None:
    """With a stream in the engine and a body still arriving, ``kill`` the engine; then every
    answer is a 503 naming ``reason`` and the process exits 1."""
    lines: list[str] = []

    def stream() -> None:
        with (
            server.client() as own,
            own.stream(
                "POST", "/inference/v1/generate", json=generate_body([1, 2, 3], stream=True)
            ) as response,
        ):
            lines.extend(line for line in response.iter_lines() if line)

    streamer = threading.Thread(target=stream)
    streamer.start()
    deadline = time.monotonic() + STARTED_TIMEOUT_S
    while not lines:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.05)
    # Keeps the server up a moment after the death (it is answered once it gives up waiting).
    half_open = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    half_open.sendall(
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
    )
    killed = time.monotonic()
    kill()
    with server.client() as client:
        deadline = time.monotonic() + 10
        while (health := client.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health never said the engine died"
            time.sleep(0.05)
        refused = client.post("/inference/v1/generate", json=generate_body([5, 6]))
        metrics = client.get("/metrics").text
    for response in (health, refused):
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "ServiceUnavailableError"
        assert error["message"].startswith("The engine died (") and reason in error["message"]
    assert "tokenwire_engine_dead 1.0" in metrics
    streamer.join(timeout=30)
    assert lines[-1] == "data: [DONE]"
    failed = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert failed["code"] == 503 and reason in failed["message"], failed
    assert server.process.wait(timeout=EXIT_BOUND_S) == 1
    print(f"exited 1 {time.monotonic() - killed:.1f} s after the engine died")
    reply = b""
    while chunk := half_open.recv(4096):
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 503")
    assert "Internal Server Error" not in server.log_path.read_text()


def test_a_dead_engine_is_a_503_everywhere_over_the_fake_engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The pipeline's and the api's part, model-free (make test-fast): a fresh app over the
    fake engine, which dies while a stream waits in it."""
    serving = serve_fast(tmp_path_factory, [])
    app = next(serving)
    try:
        assert "tokenwire_engine_dead 0.0" in app.client.get("/metrics").text
        gate = Gate()
        app.engine.script = lambda request_id, prompt, sampling: [5, Step(6, gate=gate)]
        body = generate_body([1, 2, 3], stream=True)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reading = pool.submit(sse_chunks, app.client, "/inference/v1/generate", body)
            gate.wait_reached()
            app.engine.die("injected")
            chunks = reading.result(timeout=10)
        assert chunks[0]["choices"][0]["token_ids"] == [5]
        assert chunks[-1]["error"]["code"] == 503
        message = chunks[-1]["error"]["message"]
        assert message == "The engine died (injected); this server is exiting"
        for path, payload in [
            ("/inference/v1/generate", generate_body([1, 2])),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/tokenize", {"prompt": "hi"}),
        ]:
            response = app.client.post(path, json=payload)
            assert response.status_code == 503, (path, response.text)
            assert response.json()["error"]["message"] == message
        health = app.client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == message
        assert "tokenwire_engine_dead 1.0" in app.client.get("/metrics").text
    finally:
        serving.close()


@pytest.mark.model  # its own server, with the model
@pytest.mark.hf_only
def test_hf_engine_thread_death_is_a_503_and_the_server_exits_1(tmp_path: Path) -> None:
    server = Server(["--enable-rl-control"], tmp_path / "server.log", module="tests.dying_server")
    try:
        server.wait_ready()

        def fault() -> None:  # the pause waits on the thread when it dies: answered 503
            with server.client() as client:
                response = client.post("/pause", params={"mode": "wait"})
            assert response.status_code == 503, response.text
            assert "the hf engine's thread failed: RuntimeError: " + FAULT in response.text

        check_engine_death(server, fault, FAULT)
    finally:
        server.stop()


def descendants(pid: int) -> dict[int, str]:
    """The processes under ``pid``, each with its command line (vLLM retitles its own)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            # pid (comm) state ppid ...: comm may hold spaces and parentheses.
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: dict[int, str] = {}
    level = {pid}
    while level:
        level = {child for child, parent in parents.items() if parent in level}
        for child in level:
            with contextlib.suppress(OSError):
                found[child] = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
    return found


@pytest.mark.model
@pytest.mark.vllm_only
def test_vllm_worker_killed_is_a_503_and_the_server_exits_1(tmp_path: Path) -> None:
    """``kill -9`` of vLLM's worker process (under its engine core), as the OOM killer took
    it in the issue."""
    args = ["--enable-rl-control", *engine_flags("vllm", "smollm2-135m-instruct")]
    server = Server(args, tmp_path / "server.log")
    try:
        server.wait_ready()
        processes = descendants(server.process.pid)
        workers = [pid for pid, command in processes.items() if "Worker" in command]
        assert workers, f"vLLM's worker process not found among {processes}"

        def kill() -> None:
            for pid in workers:
                os.kill(pid, signal.SIGKILL)

        check_engine_death(server, kill, "vLLM's")
    finally:
        server.stop()
