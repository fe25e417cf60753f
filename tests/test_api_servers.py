"""``--api-server-count 2``: two frontend processes on one port and one core, over HTTP.

A fleet's view of one server: requests land on either frontend (each connection is accepted by
whichever process is free), and every answer must be what one process gives. The engine in the
core is the session's: hf in make test, vLLM's CPU build in make test-vllm. Pause, a weight
reload, a LoRA adapter, a session, an abort by id and a client that leaves each cross from one
frontend to the core and reach every other frontend's requests. The real model (SmolLM2) runs
in the core; the frontends load only its text side.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import API_KEY, SESSION_ENGINE, Server, assert_error, engine_flags
from tests.fast_app import without_ids
from tokenwire.api.app import create_app
from tokenwire.api.forward import ForwardToCore
from tokenwire.pipeline.core_link import CoreLink
from tokenwire.settings import parse_serve_args

PROMPT = [504, 3458, 282, 4649, 314, 260]
GREEDY = {"temperature": 0, "max_tokens": 6}
GENERATE = {"token_ids": PROMPT, "sampling_params": GREEDY}


def server_args(adapter: Path) -> list[str]:
    """On the session's engine: make test-vllm runs these on vLLM's, in the core."""
    return [
        *engine_flags(SESSION_ENGINE["kind"], "smollm2-135m-instruct"),
        *("--api-server-count", "2", "--enable-rl-control", "--max-logprobs", "-1"),
        *("--max-held-requests", "2"),
        *("--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"a0={adapter}"),
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, lora_adapters: list[Path]) -> Iterator[Server]:
    started = Server(
        server_args(lora_adapters[0]),
        tmp_path_factory.mktemp("api-servers") / "server.log",
        api_key=API_KEY,
    )
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


def fresh(server: Server) -> httpx.Client:
    """A client on a connection of its own, which either frontend may accept."""
    return server.client(limits=httpx.Limits(max_keepalive_connections=0))


def children(pid: int) -> list[int]:
    """The server's processes (not multiprocessing's resource tracker)."""
    pids = [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [p for p in pids if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]


def alive(pid: int) -> bool:
    """Running (an exited child that nobody reaped yet is a zombie: not alive)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def left_in_groups(pgids: list[int]) -> list[int]:
    """Live processes of these process groups (each server process leads one)."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            left.append(int(stat.parent.name))
    return left


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def socket_inodes(pid: int) -> set[str]:
    links = (os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir())
    return {link[8:-1] for link in links if link.startswith("socket:[")}


def unix_sockets() -> dict[str, str]:
    """Listening Unix sockets' paths by inode."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return {fields[6]: fields[7] for fields in map(str.split, lines) if len(fields) == 8}


def core_pid(server: Server) -> int:
    """The child listening on the job channel's socket."""
    jobs = {inode for inode, path in unix_sockets().items() if path.endswith("core-jobs.sock")}
    for pid in children(server.process.pid):
        if socket_inodes(pid) & jobs:
            return pid
    raise AssertionError("no child listens on the job channel")


def generate(client: httpx.Client, **fields: object) -> httpx.Response:
    body = {"token_ids": PROMPT, "sampling_params": {**GREEDY, **fields.pop("sampling", {})}}
    return client.post("/inference/v1/generate", json={**body, **fields})


def on_new_connections(server: Server, count: int, call) -> list:
    def one(_: int):
        with fresh(server) as client:
            return call(client)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


def test_every_process_serves_and_the_answers_agree(server: Server) -> None:
    pids = children(server.process.pid)
    assert len(pids) == 3, "the core and two frontends"
    before = {pid: cpu_ticks(pid) for pid in pids}
    answers = on_new_connections(server, 96, lambda c: generate(c, logprobs=1).json())
    tokens = {tuple(a["choices"][0]["token_ids"]) for a in answers}
    logprobs = {str(a["choices"][0]["logprobs"]) for a in answers}
    assert len(tokens) == 1 and len(logprobs) == 1, "every frontend answers as one process"
    assert all(cpu_ticks(pid) > before[pid] for pid in pids), "each process did some of it"
    # SGLang's /generate, served by the frontends too: the same ids, and logprobs equal up to
    # what a prefill's batch and the prefix cache change (1e-6 here).
    sglang = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    sglang_answers = on_new_connections(
        server, 24, lambda c: c.post("/generate", json={**sglang, "return_logprob": True}).json()
    )
    assert len({str(a["output_ids"]) for a in sglang_answers}) == 1
    first = [entry[0] for entry in sglang_answers[0]["meta_info"]["output_token_logprobs"]]
    for answer in sglang_answers:
        values = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
        assert values == pytest.approx(first, abs=1e-4)
    # The frontends counted them; the core's /metrics sums every process's counts.
    with server.client() as client:
        metrics = client.get("/metrics").text
    served = re.findall(
        r'tokenwire_requests_total\{method="POST",route="/inference/v1/generate",'
        r'status="200"\} (\S+)',
        metrics,
    )
    assert served and float(served[0]) >= 96
    assert "tokenwire_engine_running_requests" in metrics


def posting(path: str, body: dict):
    """A call for ``on_new_connections``: POST ``body`` to ``path``."""
    return lambda client: client.post(path, json=body)


def test_anthropic_and_responses_are_served_by_every_frontend(server: Server) -> None:
    """Without a session nothing of theirs outlives the answer: the frontends serve them, and
    refuse alike what would continue a stored answer (the store is the core's)."""
    messages = [{"role": "user", "content": "Say hi"}]
    anthropic = {"model": "smollm2-135m-instruct", "max_tokens": 6, "messages": messages}
    responses = {"model": "smollm2-135m-instruct", "max_output_tokens": 6, "input": "Say hi"}
    for path, body, text_of in (
        ("/v1/messages", {**anthropic, "temperature": 0}, lambda a: a["content"][0]["text"]),
        ("/v1/responses", {**responses, "temperature": 0}, lambda a: str(a["output"])),
    ):
        answers = on_new_connections(server, 6, posting(path, body))
        assert {a.status_code for a in answers} == {200}, answers[0].text
        assert len({text_of(without_ids(a.json())) for a in answers}) == 1
    continuing = (
        (
            "/v1/messages",
            {**anthropic, "thread": {"type": "continue", "previous_message_id": "msg_1"}},
        ),
        ("/v1/responses", {**responses, "previous_response_id": "resp_1"}),
    )
    for path, body in continuing:
        for answer in on_new_connections(server, 4, posting(path, body)):
            assert_error(answer, 400, "X-Session-ID")


def test_pause_and_a_weight_reload_reach_every_frontend(server: Server, smol_dir: Path) -> None:
    with server.client() as control:
        assert control.post("/pause").status_code == 200
        refused = on_new_connections(server, 8, lambda c: generate(c))
        assert {r.status_code for r in refused} == {503}
        assert "paused" in refused[0].json()["error"]["message"]
        reloaded = control.post(
            "/update_weights", json={"weight_dir": str(smol_dir), "weight_version": "step-1"}
        )
        assert reloaded.json() == {"success": True, "weight_version": "step-1"}
        assert control.post("/resume").status_code == 200
    answers = on_new_connections(server, 8, lambda c: generate(c).json())
    assert {a["choices"][0]["weight_versions"][0]["version"] for a in answers} == {"step-1"}


def test_a_lora_adapter_serves_from_every_frontend(server: Server) -> None:
    def complete(client: httpx.Client, model: str) -> httpx.Response:
        body = {"model": model, "prompt": PROMPT, **GREEDY}
        return client.post("/v1/completions", json=body)

    adapted = on_new_connections(server, 6, lambda c: complete(c, "a0"))
    assert {r.status_code for r in adapted} == {200}
    assert len({r.json()["choices"][0]["text"] for r in adapted}) == 1
    tokenized = on_new_connections(
        server, 6, lambda c: c.post("/tokenize", json={"model": "a0", "prompt": "hi"})
    )
    assert {r.status_code for r in tokenized} == {200}
    unknown = {"model": "not-loaded", "prompt": "hi"}
    for answer in on_new_connections(server, 6, lambda c: c.post("/tokenize", json=unknown)):
        assert_error(answer, 404, "does not exist")
    with server.client() as client:
        assert_error(complete(client, "not-loaded"), 404, "does not exist")
        base = complete(client, "smollm2-135m-instruct").json()
    assert base["choices"][0]["text"] != adapted[0].json()["choices"][0]["text"]


def test_structured_outputs_and_several_choices_cross_to_the_core(server: Server) -> None:
    """A frontend compiles the grammar (its 400s are its own) and the core runs its text."""
    schema = {
        "type": "object",
        "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["count"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": "A count as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        "n": 3,
        "seed": 4,
        "temperature": 1.0,
        "max_tokens": 32,
    }
    answers = on_new_connections(server, 4, lambda c: c.post("/v1/chat/completions", json=body))
    for answer in answers:
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert len(choices) == 3
        for choice in choices:
            assert choice["finish_reason"] == "stop"
            assert 0 <= json.loads(choice["message"]["content"])["count"] <= 9
    # Seeded: every frontend's answer is the same.
    assert len({str(a.json()["choices"]) for a in answers}) == 1
    with server.client() as client:
        broken = {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "b"}}}
        assert client.post("/v1/chat/completions", json=broken).status_code == 400


def test_sglang_pause_holds_every_frontends_requests(server: Server) -> None:
    """Held in the core, not refused: they start once generation continues. A held client that
    leaves frees its place (the core holds two here)."""

    def leave(client: httpx.Client) -> None:
        body = {"token_ids": PROMPT, "sampling_params": GREEDY}
        with pytest.raises(httpx.ReadTimeout):
            client.post("/inference/v1/generate", json=body, timeout=0.5)

    with server.client() as control:
        assert control.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        on_new_connections(server, 2, leave)
        time.sleep(0.5)
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(on_new_connections, server, 2, generate)
            time.sleep(1.0)
            assert not held.done()
            assert control.post("/continue_generation").status_code == 200
            answers = held.result(60)
    assert {answer.status_code for answer in answers} == {200}


def test_a_session_is_one_across_frontends(server: Server) -> None:
    messages: list[dict] = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"turn {turn}: say something"})
        with fresh(server) as client:
            answer = client.post(
                "/v1/chat/completions",
                json={"messages": messages, **GREEDY},
                headers={"X-Session-ID": "across"},
            )
        assert answer.status_code == 200, answer.text
        messages.append(answer.json()["choices"][0]["message"])
    with server.client() as client:
        session = client.get("/v1/sessions/across").json()
    assert len(session["turns"]) == 3


def test_abort_by_id_and_a_running_id_cross_frontends(server: Server) -> None:
    chunks: list[str] = []
    first = threading.Event()

    def stream() -> None:
        body = {
            "token_ids": PROMPT,
            "request_id": "long-1",
            "stream": True,
            "sampling_params": {"max_tokens": 4000, "ignore_eos": True},
        }
        with (
            fresh(server) as client,
            client.stream("POST", "/inference/v1/generate", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(line)
                    first.set()

    runner = threading.Thread(target=stream)
    runner.start()
    assert first.wait(60)
    duplicates = on_new_connections(server, 4, lambda c: generate(c, request_id="long-1"))
    for duplicate in duplicates:
        assert_error(duplicate, 400, "already running")
    with fresh(server) as client:
        aborted = client.post("/abort_requests", json={"request_ids": ["long-1"]}).json()
    assert aborted["aborted"] == 1
    runner.join(60)
    assert not runner.is_alive()
    assert '"finish_reason":"abort"' in chunks[-1]


def test_a_client_that_leaves_frees_the_core(server: Server) -> None:
    body = {"token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": 4000}}
    body["sampling_params"]["ignore_eos"] = True
    with (
        fresh(server) as client,
        client.stream("POST", "/inference/v1/generate", json=body) as response,
    ):
        next(response.iter_lines())
    with server.client() as client:
        deadline = time.monotonic() + 30
        while client.get("/get_load").json()["load"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.get("/get_load").json()["load"] == 0


def core_http_socket(server: Server) -> str:
    """The path of the core's HTTP socket, which the frontends forward to."""
    held = socket_inodes(core_pid(server))
    for inode, path in unix_sockets().items():
        if inode in held and path.endswith("core-http.sock"):
            return path
    raise AssertionError("the core listens on no HTTP socket")


def test_a_frontend_still_loading_lets_the_core_answer(server: Server) -> None:
    """The port is shared: a frontend that has not loaded yet accepts requests while another
    one answers /health 200. It forwards them all, its own routes too, and the core answers
    them as one process does (it refused them 503 before)."""
    settings = parse_serve_args([*server_args(Path("unused")), "--api-key", API_KEY])
    loading = create_app(settings, core=CoreLink("unused"))  # never started: nothing loaded
    assert loading.state.pipeline.runtime is None
    front = ForwardToCore(loading, loading.state.pipeline, core_http_socket(server))
    tokenize = {"prompt": "Hello there"}

    async def ask() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        transport = httpx.ASGITransport(front)
        async with (
            front.client,  # its connections to the core
            httpx.AsyncClient(transport=transport, base_url="http://front") as client,
        ):
            return [
                await client.get("/health"),
                await client.post("/tokenize", json=tokenize, headers=headers),
                await client.post("/inference/v1/generate", json=GENERATE, headers=headers),
            ]

    health, tokenized, generated = asyncio.run(ask())
    assert health.status_code == 200
    with server.client() as client:
        assert (
            tokenized.status_code == 200
            and tokenized.json() == client.post("/tokenize", json=tokenize).json()
        )
        expected = client.post("/inference/v1/generate", json=GENERATE).json()
    assert generated.status_code == 200, generated.text
    assert without_ids(generated.json()) == without_ids(expected)


def test_sigterm_drains_every_process(server: Server) -> None:
    """Last: a stream in flight finishes, then every process exits 0."""
    pids = children(server.process.pid)
    body = {"token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": 48}}
    body["sampling_params"]["ignore_eos"] = True
    with (
        fresh(server) as client,
        client.stream("POST", "/inference/v1/generate", json=body) as response,
    ):
        lines = response.iter_lines()
        next(lines)
        server.process.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert '"finish_reason":"length"' in [line for line in rest if line.startswith("data: {")][-1]
    assert server.process.wait(60) == 0
    assert not [pid for pid in pids if alive(pid)]


def test_a_dead_core_stops_the_server(tmp_path: Path, lora_adapters: list[Path]) -> None:
    """The core's engine dying (here the whole core, SIGKILLed) ends every process, exit 1,
    and what the core started (vLLM's engine core under --engine vllm) with it."""
    server = Server(server_args(lora_adapters[0]), tmp_path / "server.log", api_key=API_KEY)
    try:
        server.wait_ready()
        pids = children(server.process.pid)
        os.kill(core_pid(server), signal.SIGKILL)
        assert server.process.wait(60) == 1
        assert not [pid for pid in pids if alive(pid)]
        assert not left_in_groups(pids)
    finally:
        server.stop()


def test_a_killed_parent_takes_its_processes_with_it(
    tmp_path: Path, lora_adapters: list[Path]
) -> None:
    """SIGKILL leaves the parent no time to stop its children: the kernel tells them."""
    server = Server(server_args(lora_adapters[0]), tmp_path / "server.log", api_key=API_KEY)
    try:
        server.wait_ready()
        pids = children(server.process.pid)
        server.process.kill()
        server.process.wait(10)
        deadline = time.monotonic() + 60
        while left_in_groups(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left_in_groups(pids)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health")
    finally:
        server.stop()
