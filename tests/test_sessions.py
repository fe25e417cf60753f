"""Sessions on the real qwen3-tiny server (qwen3 reasoning and hermes tool-call parsers), driven
by the real ``anthropic`` and ``openai`` SDKs with an ``X-Session-ID`` header, streaming and
not: 16 scripted episodes of 4 turns each, all at once. Every turn's recorded prompt starts with
the previous turn's prompt + sampled ids, the loss mask covers exactly the sampled ids, and the
trajectory's logprobs equal a transformers forward of each segment's ids. A compacted history
gives a second exact segment with its reason; a SIGTERM mid-episode loses no recorded turn, and
neither does a SIGKILL under load.
The harnesses' stateful forms, run by their own code: the anthropic SDK's tool runner with its
default threads, and the openai SDK's Responses chained by ``previous_response_id``."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import httpx2
import openai
import pytest
import torch

from tests.chat_fixtures import TOOLS
from tests.conftest import API_KEY, QWEN3_SERVER_ARGS, Server, engine_flags
from tests.test_fast_sessions import assert_exact

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from serverbench import ServerProcess, free_port, tree_env  # noqa: E402

pytestmark = pytest.mark.model

EPISODES = 16  # all at once: concurrency is what could mix their turns
TURNS = 4
LOGPROB_TOLERANCE = 1e-4
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def start(store: Path, log: Path) -> Server:
    args = [*QWEN3_SERVER_ARGS, "--session-store", str(store)]
    server = Server([*args, *engine_flags("hf", "qwen3-tiny")], log, api_key=API_KEY)
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("sessions")
    running = start(folder / "sessions.sqlite3", folder / "server.log")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def model(qwen3_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()


class Harness:
    """A scripted agent harness: each turn sends the whole history back as its SDK got it."""

    def __init__(self, server: Server, session: str, dialect: str, stream: bool) -> None:
        self.dialect, self.stream = dialect, stream
        headers = {"X-Session-ID": session}
        if dialect == "anthropic":
            self.claude = anthropic.Anthropic(
                base_url=server.url, api_key=API_KEY, default_headers=headers, max_retries=0
            )
        else:
            self.openai = openai.OpenAI(
                base_url=f"{server.url}/v1",
                api_key=API_KEY,
                default_headers=headers,
                max_retries=0,
            )
        self.history: list[Any] = []

    def turn(self, text: str) -> None:
        """Send ``text`` (as a tool result when the last reply called a tool) and keep the reply."""
        if self.dialect == "anthropic":
            self._anthropic(text)
        else:
            self._responses(text)

    def _anthropic(self, text: str) -> None:
        last = self.history[-1]["content"] if self.history else []
        calls = [block["id"] for block in last if block.get("type") == "tool_use"]
        if calls:
            content: Any = [{"type": "tool_result", "tool_use_id": calls[0], "content": text}]
        else:
            content = text
        self.history.append({"role": "user", "content": content})
        kwargs = {
            "model": "qwen3-tiny",
            "max_tokens": 12,
            "messages": self.history,
            "tools": ANTHROPIC_TOOLS,
        }
        if self.stream:
            with self.claude.messages.stream(**kwargs) as events:
                reply = events.get_final_message()
        else:
            reply = self.claude.messages.create(**kwargs)
        blocks = [block.model_dump(exclude_none=True) for block in reply.content]
        self.history.append({"role": "assistant", "content": blocks})

    def _responses(self, text: str) -> None:
        calls = [item["call_id"] for item in self.history if item.get("type") == "function_call"]
        answered = {i["call_id"] for i in self.history if i.get("type") == "function_call_output"}
        pending = [call for call in calls if call not in answered]
        if pending:
            self.history.append({"type": "function_call_output", "call_id": pending[0]})
            self.history[-1]["output"] = text
        else:
            self.history.append({"role": "user", "content": text})
        kwargs = {
            "model": "qwen3-tiny",
            "input": self.history,
            "tools": RESPONSES_TOOLS,
            "max_output_tokens": 12,
        }
        if self.stream:
            with self.openai.responses.stream(**kwargs) as events:
                reply = events.get_final_response()
        else:
            reply = self.openai.responses.create(**kwargs)
        self.history.extend(item.model_dump(exclude_none=True) for item in reply.output)


def trajectory(server: Server, session: str) -> dict[str, Any]:
    with server.client() as client:
        response = client.get(f"/v1/sessions/{session}")
    assert response.status_code == 200, response.text
    return response.json()


def assert_logprobs_match_forward(model: Any, result: dict[str, Any]) -> float:
    """Each segment's masked logprobs against one forward of its ids; the largest difference."""
    worst = 0.0
    for segment in result["segments"]:
        ids = torch.tensor([segment["token_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        positions = [p for p, bit in enumerate(segment["loss_mask"]) if bit]
        expected = [logprobs[p - 1, ids[0, p]].item() for p in positions]
        recorded = [lp for i in segment["turns"] for lp in result["turns"][i]["logprobs"]]
        assert len(recorded) == len(expected)
        difference = max((abs(a - b) for a, b in zip(recorded, expected, strict=True)), default=0)
        worst = max(worst, difference)
    assert worst <= LOGPROB_TOLERANCE
    return worst


def test_concurrent_episodes_are_exact(server: Server, model: Any) -> None:
    def episode(index: int) -> str:
        session = f"episode-{index}"
        dialect = ("anthropic", "responses")[index % 2]
        harness = Harness(server, session, dialect, stream=index // 2 % 2 == 1)
        for turn in range(TURNS):
            harness.turn(f"Step {turn}: what is the weather in city {index}?")
        return session

    with ThreadPoolExecutor(16) as pool:  # 16 sessions at once
        sessions = list(pool.map(episode, range(EPISODES)))
    worst = 0.0
    seen_prompts: set[tuple[int, ...]] = set()
    for session in sessions:
        result = trajectory(server, session)
        assert len(result["turns"]) == TURNS, session
        assert len(result["segments"]) == 1, (session, result["segments"][1:])
        assert_exact(result)
        for turn in result["turns"]:
            spans = turn["weight_versions"]
            assert spans[0]["start"] == 0 and spans[-1]["end"] == len(turn["sampled_ids"])
        first = tuple(result["turns"][0]["prompt_ids"])
        assert first not in seen_prompts  # each episode's own city: no turn of another
        seen_prompts.add(first)
        worst = max(worst, assert_logprobs_match_forward(model, result))
    print(f"{EPISODES} episodes x {TURNS} turns: 0 breaks, worst logprob difference {worst:.2e}")


def test_compaction_gives_two_exact_segments(server: Server, model: Any) -> None:
    harness = Harness(server, "compacted", "anthropic", stream=False)
    harness.turn("What is the weather in Paris?")
    harness.turn("And in Lyon?")
    # The harness compacts its history into one summary message.
    harness.history = [{"role": "user", "content": "Summary: we talked about the weather."}]
    harness.history.append({"role": "assistant", "content": [{"type": "text", "text": "Yes"}]})
    harness.turn("And in Nice?")
    harness.turn("And in Lille?")
    result = trajectory(server, "compacted")
    assert [s["turns"] for s in result["segments"]] == [[0, 1], [2, 3]]
    assert result["segments"][1]["reason"].startswith("history rewritten")
    assert_exact(result)
    assert_logprobs_match_forward(model, result)


def test_sigterm_mid_episode_loses_no_turn(tmp_path: Path) -> None:
    store = tmp_path / "sessions.sqlite3"
    first = start(store, tmp_path / "first.log")
    try:
        harness = Harness(first, "survivor", "responses", stream=True)
        harness.turn("What is the weather in Paris?")
        harness.turn("And in Lyon?")
        before = trajectory(first, "survivor")
    finally:
        first.stop()  # SIGTERM
    second = start(store, tmp_path / "second.log")
    try:
        assert trajectory(second, "survivor") == before
        harness.openai = openai.OpenAI(
            base_url=f"{second.url}/v1",
            api_key=API_KEY,
            default_headers={"X-Session-ID": "survivor"},
            max_retries=0,
        )
        harness.turn("And in Nice?")
        result = trajectory(second, "survivor")
        assert len(result["turns"]) == 3 and len(result["segments"]) == 1
        assert_exact(result)
        with httpx.Client(base_url=second.url) as client:
            assert client.get("/v1/sessions/survivor").status_code == 401
            listed = client.get("/v1/sessions", headers={"Authorization": f"Bearer {API_KEY}"})
        assert [s["id"] for s in listed.json()["data"]] == ["survivor"]
        assert json.dumps(result)  # the trajectory is plain JSON
    finally:
        second.stop()


@anthropic.beta_tool
def get_weather(city: Literal["Paris", "Lyon"]) -> str:
    """The weather in a city.

    Args:
        city: Which city.
    """
    return f"sunny in {city}"


def sent_bodies(sent: list[dict[str, Any]]) -> httpx2.Client:
    """An http client for the anthropic SDK that keeps each /v1/messages body it sends."""

    def keep(request: httpx2.Request) -> None:
        if request.url.path == "/v1/messages":
            sent.append(json.loads(request.content))

    return httpx2.Client(event_hooks={"request": [keep]})


@pytest.mark.parametrize("stream", [False, True])
def test_the_anthropic_tool_runner_threads_a_session(
    server: Server, model: Any, stream: bool
) -> None:
    """``beta.messages.tool_runner`` with its default threads: the first turn creates the
    thread, each later one continues it with only the tool results (the SDK leaves ``system``
    and ``tools`` out: the thread keeps them). Four calls forced by ``tool_choice: any``, one
    exact segment whose logprobs equal a forward. Midway the session is deleted: the next
    ``continue`` is refused with ``thread_not_found``, on which the SDK replays the whole
    history under a new thread, and the session starts again from it."""
    session = f"runner-{stream}"
    sent: list[dict[str, Any]] = []
    client = anthropic.Anthropic(
        base_url=server.url,
        api_key=API_KEY,
        default_headers={"X-Session-ID": session},
        max_retries=0,
        http_client=sent_bodies(sent),
    )
    runner = client.beta.messages.tool_runner(
        model="qwen3-tiny",
        max_tokens=96,
        system="Be brief.",
        tools=[get_weather],
        tool_choice={"type": "any"},
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "Weather in Paris, then in Lyon?"}],
        max_iterations=6,
        stream=stream,
    )
    replies = []
    for item in runner:
        replies.append(item.get_final_message() if stream else item)
        if len(replies) == 4:  # the server loses the thread
            with server.client() as http:
                assert http.delete(f"/v1/sessions/{session}").status_code == 200
    assert [reply.stop_reason for reply in replies] == ["tool_use"] * 6
    threads = [body["thread"] for body in sent]
    kinds = ["create", *["continue"] * 4, "create", "continue"]
    assert [thread["type"] for thread in threads] == kinds
    for body, thread in zip(sent, threads, strict=True):
        continued = thread["type"] == "continue"
        assert ("tools" in body) is not continued and ("system" in body) is not continued
    # The replay sends the whole history again: 4 answers, 4 tool results and the question.
    assert len(sent[5]["messages"]) == 9
    result = trajectory(server, session)
    assert len(result["turns"]) == 2 and len(result["segments"]) == 1
    assert_exact(result)
    assert_logprobs_match_forward(model, result)


def test_responses_chained_by_previous_response_id(server: Server, model: Any) -> None:
    """The openai SDK's Responses, each turn sending only its new input items with
    ``previous_response_id`` (and the instructions and tools again, as OpenAI requires): one
    exact segment over the episode."""
    client = openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key=API_KEY,
        default_headers={"X-Session-ID": "chained"},
        max_retries=0,
    )
    fields = {"model": "qwen3-tiny", "instructions": "Be brief.", "max_output_tokens": 12}
    reply = client.responses.create(**fields, input="Weather in Paris?", tools=RESPONSES_TOOLS)
    for turn in range(TURNS - 1):
        calls = [item.call_id for item in reply.output if item.type == "function_call"]
        new: list[Any] = [
            {"type": "function_call_output", "call_id": call, "output": "sunny"} for call in calls
        ] or [{"role": "user", "content": f"And in city {turn}?"}]
        reply = client.responses.create(
            **fields, input=new, tools=RESPONSES_TOOLS, previous_response_id=reply.id
        )
    result = trajectory(server, "chained")
    assert len(result["turns"]) == TURNS and len(result["segments"]) == 1
    assert_exact(result)
    assert_logprobs_match_forward(model, result)


def fake_server(store: Path, log: Path) -> ServerProcess:
    """The real app over the fake engine (``tests/fake_server.py``), recording into ``store``."""
    port = free_port()
    flags = ["--served-model-name", "qwen3-tiny", "--api-key", API_KEY, "--session-store"]
    command = [sys.executable, str(ROOT / "tests/fake_server.py"), str(port), *flags, str(store)]
    return ServerProcess(command, port, log=log, env=tree_env(ROOT))


def test_sigkill_under_load_loses_no_acknowledged_turn(tmp_path: Path) -> None:
    """Eight sessions take turns as fast as the server answers; the server is killed (-9)
    mid-load and started again on the same store: every turn a client saw answered is there,
    each session still exact (a turn killed before its answer may be recorded or not)."""
    store = tmp_path / "sessions.sqlite3"
    first = fake_server(store, tmp_path / "first.log")
    acknowledged: dict[str, int] = {}
    enough = threading.Event()

    def load(index: int) -> None:
        session = f"loaded-{index}"
        headers = {"X-Session-ID": session, "Authorization": f"Bearer {API_KEY}"}
        messages: list[dict[str, Any]] = []
        with httpx.Client(base_url=first.url, headers=headers, timeout=30) as client:
            while True:
                messages.append({"role": "user", "content": f"Question {len(messages)}?"})
                body = {"model": "qwen3-tiny", "messages": messages, "max_tokens": 4}
                try:
                    reply = client.post("/v1/chat/completions", json=body)
                except httpx.TransportError:
                    return  # killed
                assert reply.status_code == 200, reply.text
                acknowledged[session] = int(reply.headers["X-Session-Turn"]) + 1
                messages.append(reply.json()["choices"][0]["message"])
                if sum(acknowledged.values()) >= 120:
                    enough.set()

    workers = [threading.Thread(target=load, args=(index,)) for index in range(8)]
    for worker in workers:
        worker.start()
    try:
        assert enough.wait(120), acknowledged
        os.kill(first.process.pid, signal.SIGKILL)
    finally:
        for worker in workers:
            worker.join(60)
        first.process.kill()
        first.process.wait()
    second = fake_server(store, tmp_path / "second.log")
    try:
        with httpx.Client(
            base_url=second.url, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as http:
            for session, turns in acknowledged.items():
                result = http.get(f"/v1/sessions/{session}").json()
                assert len(result["turns"]) in (turns, turns + 1), session
                assert_exact(result)
    finally:
        second.stop()
    print(f"killed under load: {sum(acknowledged.values())} acknowledged turns, 0 lost")


def test_eight_parallel_turns_of_one_session_three_times(tmp_path: Path) -> None:
    """Eight turns of one session sent at once, three rounds, over HTTP: no 5xx, each answered
    turn readable (racing turns stand in segments of their own), the session exact."""
    server = fake_server(tmp_path / "sessions.sqlite3", tmp_path / "server.log")
    headers = {"X-Session-ID": "parallel", "Authorization": f"Bearer {API_KEY}"}
    answered = 0
    try:
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
            messages = [{"role": "user", "content": "Hi?"}]
            for _ in range(3):
                body = {"model": "qwen3-tiny", "messages": messages, "max_tokens": 4}
                with ThreadPoolExecutor(8) as pool:
                    sent = [
                        pool.submit(client.post, "/v1/chat/completions", json=body)
                        for _ in range(8)
                    ]
                    replies = [reply.result() for reply in sent]
                assert [reply.status_code for reply in replies] == [200] * 8
                answered += 8
                messages += [replies[0].json()["choices"][0]["message"]]
                messages += [{"role": "user", "content": "And then?"}]
            result = client.get("/v1/sessions/parallel").json()
    finally:
        server.stop()
    assert len(result["turns"]) == answered
    assert_exact(result)
