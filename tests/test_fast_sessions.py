"""Sessions over the fake engine: turns of the three dialects under one ``X-Session-ID``
extend each other's exact ids, a rewritten history starts a new segment with its reason, the
trajectory's loss mask covers exactly the sampled ids, bad input leaves a session as it was,
sessions stay apart (16 at once), the routes need the API key, and the store survives a
reopen. A session is its key's (another key, the router's key: not found or refused); eight
turns of one session at once are all recorded; a session deleted mid-turn, over its byte
bound, expired, or a full disk: the turn is still answered, and its headers say so."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anthropic
import httpx
import openai
import pytest

from tests.conftest import API_KEY, CONTROL_KEY, QWEN3_SERVER_ARGS
from tests.fake_engine import Gate, Step
from tests.fast_app import FastApp, serve_fast
from tests.test_fast_anthropic import ANTHROPIC_TOOLS, IM_END, THINK_AND_CALL
from tokenwire.pipeline.session_store import RACED, REMOVED, Head, NewTurn, Owner, SessionStore

ANSWER = "<think>\nEasy.\n</think>\n\nIt is sunny in Paris."


OTHER_KEY = "another-client-key"
ROUTER_KEY = "the-router-key"
KEYS = ["--api-key", API_KEY, OTHER_KEY, "--control-api-key", CONTROL_KEY]


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastApp]:
    """Two client keys, the trainer's control key and the router's; the client sends
    ``API_KEY``."""
    store = tmp_path_factory.mktemp("sessions") / "sessions.sqlite3"
    args = [*QWEN3_SERVER_ARGS, "--session-store", str(store), *KEYS]
    for app in serve_fast(tmp_path_factory, [*args, "--router-api-key", ROUTER_KEY]):
        app.client.headers["Authorization"] = f"Bearer {API_KEY}"
        yield app


@pytest.fixture
def app(fast: FastApp) -> Iterator[FastApp]:
    call = [*fast.tokenize(THINK_AND_CALL), IM_END]
    answer = [*fast.tokenize(ANSWER), IM_END]
    # A tool call while the prompt has no tool result yet, then a text answer.
    fast.engine.script = lambda _, prompt, __: answer if 151665 in prompt else call
    yield fast
    fast.settle()


def claude(app: FastApp, session: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver",
        api_key=API_KEY,
        http_client=app.client,
        max_retries=0,
        default_headers={"X-Session-ID": session},
    )


def gpt(app: FastApp, session: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1",
        api_key=API_KEY,
        http_client=app.client,
        max_retries=0,
        default_headers={"X-Session-ID": session},
    )


def trajectory(app: FastApp, session: str) -> dict[str, Any]:
    response = app.client.get(f"/v1/sessions/{session}")
    assert response.status_code == 200, response.text
    return response.json()


def assert_exact(result: dict[str, Any]) -> None:
    """Each turn's prompt starts with the previous turn's of its segment + its sampled ids,
    and each segment's mask is 1 exactly on its turns' sampled ids."""
    turns = result["turns"]
    for segment in result["segments"]:
        ids, mask = segment["token_ids"], segment["loss_mask"]
        assert len(ids) == len(mask)
        expected = [0] * len(ids)
        previous: list[int] | None = None
        for index in segment["turns"]:
            turn = turns[index]
            prompt, sampled = turn["prompt_ids"], turn["sampled_ids"]
            if previous is not None:
                assert prompt[: len(previous)] == previous
            previous = [*prompt, *sampled]
            assert ids[: len(previous)] == previous
            expected[len(prompt) : len(previous)] = [1] * len(sampled)
            assert len(turn["logprobs"]) == len(sampled)
        assert mask == expected


def anthropic_episode(client: anthropic.Anthropic, *, stream: bool) -> list[Any]:
    """Three turns: a tool call, its result answered, a follow-up question."""
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    for turn in range(3):
        kwargs = {"model": "qwen3-tiny", "max_tokens": 64, "messages": messages}
        if stream:
            with client.messages.stream(**kwargs, tools=ANTHROPIC_TOOLS) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(**kwargs, tools=ANTHROPIC_TOOLS)
        content = [block.model_dump(exclude_none=True) for block in reply.content]
        messages = [*messages, {"role": "assistant", "content": content}]
        calls = [block for block in reply.content if block.type == "tool_use"]
        if calls:
            result = {"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny"}
            messages.append({"role": "user", "content": [result]})
        else:
            messages.append({"role": "user", "content": f"And tomorrow ({turn})?"})
    return messages


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_episode_extends_exactly(app: FastApp, stream: bool) -> None:
    session = f"claude-{stream}"
    anthropic_episode(claude(app, session), stream=stream)
    result = trajectory(app, session)
    assert len(result["turns"]) == 3
    assert [s["segment"] for s in result["segments"]] == [0]
    assert result["segments"][0]["reason"] is None
    assert_exact(result)
    engine_prompts = [call.prompt_token_ids for call in app.engine.calls[-3:]]
    assert [turn["prompt_ids"] for turn in result["turns"]] == engine_prompts
    assert result["turns"][0]["finish_reason"] == "stop"
    assert result["turns"][0]["weight_versions"][0]["start"] == 0
    assert result["turns"][0]["dialect"] == "anthropic"
    # Qwen3's template drops reasoning before the last user query: once "And tomorrow?"
    # follows, its full render of the history differs from the recorded ids (kept).
    differs = [turn["render_differs"] for turn in result["turns"]]
    assert differs[:2] == [None, None] and "renders the history otherwise" in differs[2]


def test_compacted_history_starts_a_segment(app: FastApp) -> None:
    client = claude(app, "compact")
    messages = anthropic_episode(client, stream=False)
    # The harness compacts: a summary replaces the history.
    client.messages.create(
        model="qwen3-tiny",
        max_tokens=64,
        messages=[{"role": "user", "content": "Summary: it was sunny."}, messages[-1]],
        tools=ANTHROPIC_TOOLS,
    )
    result = trajectory(app, "compact")
    assert [s["segment"] for s in result["segments"]] == [0, 1]
    assert result["segments"][1]["reason"].startswith("history rewritten")
    assert result["segments"][1]["turns"] == [3]
    assert_exact(result)


def test_responses_and_chat_sessions(app: FastApp) -> None:
    client = gpt(app, "codex")
    tools = [{"type": "function", **t["function"]} for t in _chat_tools(ANTHROPIC_TOOLS)]
    items: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(model="qwen3-tiny", input=items, tools=tools)
    items += [item.model_dump(exclude_none=True) for item in first.output]
    call = next(item for item in first.output if item.type == "function_call")
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
    with client.responses.stream(model="qwen3-tiny", input=items, tools=tools) as stream:
        stream.get_final_response()
    result = trajectory(app, "codex")
    assert [t["dialect"] for t in result["turns"]] == ["responses", "responses"]
    assert len(result["segments"]) == 1
    assert_exact(result)
    chat = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat.completions.create(
        model="qwen3-tiny", messages=chat, tools=_chat_tools(ANTHROPIC_TOOLS)
    )
    assert reply.choices[0].message.tool_calls
    assert app.client.get("/v1/sessions/codex").json()["turns"][-1]["dialect"] == "chat"


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["input_schema"],
            },
        }
        for t in tools
    ]


def test_bad_input_leaves_the_session(app: FastApp) -> None:
    client = claude(app, "bad")
    anthropic_episode(client, stream=False)
    before = trajectory(app, "bad")
    calls = len(app.engine.calls)
    headers = {"X-Session-ID": "bad"}
    bodies = [
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "nope"}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
    ]
    for body in bodies:
        response = app.client.post("/v1/messages", json={"max_tokens": 8, **body}, headers=headers)
        assert response.status_code == 400, response.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2}
    response = app.client.post("/v1/chat/completions", json=chat, headers=headers)
    assert response.status_code == 400 and "n must be 1" in response.text
    long_id = {"X-Session-ID": "x" * 300}
    response = app.client.post("/v1/chat/completions", json={**chat, "n": 1}, headers=long_id)
    assert response.status_code == 400 and "X-Session-ID" in response.text
    assert trajectory(app, "bad") == before
    assert len(app.engine.calls) == calls


def test_routes_list_delete_404_and_auth(app: FastApp) -> None:
    anthropic_episode(claude(app, "listed"), stream=False)
    listed = app.client.get("/v1/sessions").json()
    entry = next(s for s in listed["data"] if s["id"] == "listed")
    assert entry["turns"] == 3 and entry["bytes"] > 0
    no_key = {"Authorization": ""}
    assert app.client.get("/v1/sessions/listed", headers=no_key).status_code == 401
    assert app.client.get("/v1/sessions", headers=no_key).status_code == 401
    assert app.client.delete("/v1/sessions/listed", headers=no_key).status_code == 401
    assert app.client.get("/v1/sessions/nope").status_code == 404
    assert app.client.delete("/v1/sessions/listed").json() == {"id": "listed", "deleted": True}
    assert app.client.get("/v1/sessions/listed").status_code == 404
    assert app.client.delete("/v1/sessions/listed").status_code == 404


def test_sixteen_sessions_at_once_stay_apart(app: FastApp) -> None:
    names = [f"parallel-{i}" for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda name: anthropic_episode(claude(app, name), stream=True), names))
    seen: set[tuple[int, ...]] = set()
    for name in names:
        result = trajectory(app, name)
        assert len(result["turns"]) == 3 and len(result["segments"]) == 1
        assert_exact(result)
        seen.add(tuple(result["segments"][0]["token_ids"]))
    assert len(seen) == 1  # the same scripted episode: the same ids, in each its own


OWNER = Owner.of(b"k", control=False)


def new_turn(head: Head | None, prompt: int = 100) -> NewTurn:
    data = {"sampled_ids": [2], "logprobs": [0.0]}
    ids = [*(head.token_ids if head else []), *[1] * prompt]
    return NewTurn(head, 0, None, ids, [2], data, [], "", "chatcmpl-1")


async def record_turns(store: SessionStore, session: str, turns: int) -> None:
    for _ in range(turns):
        head = await store.head(session, OWNER)
        assert (await store.record(session, OWNER, new_turn(head))).turn is not None


def test_store_survives_reopen_and_is_bounded(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sqlite3")
    store = SessionStore(path, max_bytes=10**6, ttl_s=3600)
    asyncio.run(record_turns(store, "a", 3))
    (size,) = [s["bytes"] for s in asyncio.run(store.sessions(OWNER))]
    store.close()
    # Room for one session of three such turns, not two.
    again = SessionStore(path, max_bytes=2 * size - 1, ttl_s=3600, max_session_bytes=size)
    stored = asyncio.run(again.stored("a", OWNER))
    assert stored is not None and len(stored.turns) == 3
    asyncio.run(record_turns(again, "b", 3))  # over the budget: the older session goes
    assert asyncio.run(again.stored("a", OWNER)) is None
    assert [s["id"] for s in asyncio.run(again.sessions(OWNER))] == ["b"]
    again.close()


def test_two_requests_of_one_session_at_once(app: FastApp) -> None:
    """The turn recorded second did not extend the first: it starts a segment of its own."""
    client = claude(app, "racing")
    anthropic_episode(client, stream=False)
    history = trajectory(app, "racing")
    gate = Gate()
    answer = [*app.tokenize("Fine."), IM_END]
    held = [Step(answer[0], gate=gate), *answer[1:]]
    scripts = iter([held, answer])
    app.engine.script = lambda *_: next(scripts)
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"model": "qwen3-tiny", "max_tokens": 8, "messages": messages}
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(client.messages.create, **body)
        gate.wait_reached()
        client.messages.create(**body)  # answered while the first one waits
        gate.open()
        slow.result()
    result = trajectory(app, "racing")
    assert len(result["turns"]) == len(history["turns"]) + 2
    reasons = [segment["reason"] for segment in result["segments"][-2:]]
    assert reasons[0] == "the tools or chat template options changed"  # no tools this time
    assert reasons[1].startswith("another request of this session")
    assert_exact(result)


FINE = "Fine."
HELLO = [{"role": "user", "content": "Hello?"}]


def answer_fine(app: FastApp, gate: Gate | None = None) -> None:
    """Every request answers "Fine." (held at its first token by ``gate``, if any)."""
    answer = [*app.tokenize(FINE), IM_END]
    app.engine.script = lambda *_: [Step(answer[0], gate=gate), *answer[1:]]


def chat_turn(
    app: FastApp, session: str, messages: list[dict[str, Any]], **headers: str
) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 16}
    return app.client.post(
        "/v1/chat/completions", json=body, headers={"X-Session-ID": session, **headers}
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_session_is_its_keys(app: FastApp, tmp_path: Path) -> None:
    answer_fine(app)
    assert chat_turn(app, "mine", HELLO).headers["X-Session-Turn"] == "0"
    mine = trajectory(app, "mine")
    other, control = bearer(OTHER_KEY), bearer(CONTROL_KEY)
    calls = len(app.engine.calls)
    # Another key: the session does not exist, to read, list, delete or append to.
    assert app.client.get("/v1/sessions/mine", headers=other).status_code == 404
    assert app.client.delete("/v1/sessions/mine", headers=other).status_code == 404
    listed = app.client.get("/v1/sessions", headers=other).json()["data"]
    assert "mine" not in [s["id"] for s in listed]
    refused = chat_turn(app, "mine", HELLO, **other)
    assert refused.status_code == 404 and "another API key" in refused.text
    assert len(app.engine.calls) == calls
    # Its own key, in Anthropic's header too (older SDKs send only x-api-key).
    anthropic_style = {"Authorization": "", "x-api-key": API_KEY}
    assert app.client.get("/v1/sessions/mine", headers=anthropic_style).json() == mine
    # The control key (the trainer's) reads and lists every session.
    assert app.client.get("/v1/sessions/mine", headers=control).json() == mine
    listed = app.client.get("/v1/sessions", headers=control).json()["data"]
    assert "mine" in [s["id"] for s in listed]
    # The router's key opens the stateless routes only: nothing that generates or reads
    # sessions answers with it, as vllm-router sends it on the routes it does not know.
    router = bearer(ROUTER_KEY)
    for method, path, body in [
        ("GET", "/v1/sessions", None),
        ("GET", "/v1/sessions/mine", None),
        ("DELETE", "/v1/sessions/mine", None),
        ("POST", "/v1/messages", {"max_tokens": 8, "messages": HELLO}),
        ("POST", "/v1/responses", {"input": "Hello?"}),
        ("POST", "/v1/chat/completions", {"messages": HELLO}),
    ]:
        response = app.client.request(method, path, json=body, headers=router)
        assert response.status_code == 401, (path, response.text)
        assert "--router-api-key" in response.json()["error"]["message"]
    assert len(app.engine.calls) == calls
    render = {"messages": HELLO}
    assert app.client.post("/v1/chat/completions/render", json=render, headers=router).is_success
    assert app.client.post("/tokenize", json={"prompt": "Hi"}, headers=router).is_success
    # The owner is kept as a hash: the key itself is nowhere in the store's files.
    database = Path(app.client.app.state.pipeline.session_store().path)
    stored = b"".join(path.read_bytes() for path in database.parent.glob(database.name + "*"))
    assert b"mine" in stored and API_KEY.encode() not in stored
    assert app.client.delete("/v1/sessions/mine").json() == {"id": "mine", "deleted": True}


def second_turn_behind_a_gate(app: FastApp, session_id: str) -> tuple[list[dict], Gate]:
    """``session_id``'s first turn recorded; the second turn's history, and the gate the engine
    waits at before answering it."""
    answer_fine(app)
    assert chat_turn(app, session_id, HELLO).status_code == 200
    history = [*HELLO, {"role": "assistant", "content": FINE}, {"role": "user", "content": "?"}]
    gate = Gate()
    answer_fine(app, gate)
    return history, gate


def test_eight_turns_of_one_session_at_once(app: FastApp) -> None:
    """All eight prompts are built before any is recorded: one extends the head, the seven
    recorded after it each stand in a segment of their own; none is lost, none a 5xx."""
    history, gate = second_turn_behind_a_gate(app, "eight")
    with ThreadPoolExecutor(8) as pool:
        turns = [pool.submit(chat_turn, app, "eight", history) for _ in range(8)]
        app.wait_until(lambda: len(app.engine.live) == 8)
        gate.open()
        responses = [turn.result() for turn in turns]
    assert [r.status_code for r in responses] == [200] * 8
    assert sorted(int(r.headers["X-Session-Turn"]) for r in responses) == list(range(1, 9))
    result = trajectory(app, "eight")
    assert len(result["turns"]) == 9
    reasons = [segment["reason"] for segment in result["segments"]]
    assert reasons == [None] + [RACED] * 7
    assert result["segments"][0]["turns"] == [0, 1]
    assert_exact(result)


def test_a_session_deleted_mid_turn(app: FastApp) -> None:
    history, gate = second_turn_behind_a_gate(app, "gone")
    with ThreadPoolExecutor(1) as pool:
        turn = pool.submit(chat_turn, app, "gone", history)
        gate.wait_reached()
        assert app.client.delete("/v1/sessions/gone").status_code == 200
        gate.open()
        response = turn.result()
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
    assert response.headers["X-Session-Unrecorded"] == REMOVED
    assert "X-Session-Turn" not in response.headers
    assert app.client.get("/v1/sessions/gone").status_code == 404
    # The id starts anew.
    answer_fine(app)
    assert chat_turn(app, "gone", HELLO).headers["X-Session-Turn"] == "0"


@pytest.fixture
def small_store(app: FastApp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SessionStore:
    """The app's sessions in a store of 200 kB, 40 kB a session, on a file of its own."""
    store = SessionStore(
        str(tmp_path / "small.sqlite3"), max_bytes=200_000, ttl_s=3600, max_session_bytes=40_000
    )
    monkeypatch.setattr(app.client.app.state.pipeline, "sessions", store)
    yield store
    store.close()


def test_a_session_over_its_bound_is_closed(app: FastApp, small_store: SessionStore) -> None:
    answer_fine(app)
    for session in ("a", "b"):
        assert chat_turn(app, session, HELLO).status_code == 200
    messages, recorded = list(HELLO), 0
    while (response := chat_turn(app, "big", messages)).headers.get("X-Session-Turn"):
        recorded += 1
        assert recorded < 100
        messages += [
            {"role": "assistant", "content": FINE},
            {"role": "user", "content": "x" * 2000},
        ]
    assert response.status_code == 200
    assert response.headers["X-Session-Unrecorded"].startswith("the session takes no more turns")
    assert "--session-max-bytes" in response.headers["X-Session-Unrecorded"]
    refused = chat_turn(app, "big", [*messages, {"role": "user", "content": "more"}])
    assert refused.status_code == 409 and "takes no more turns" in refused.text
    big = trajectory(app, "big")
    assert len(big["turns"]) == recorded and "--session-max-bytes" in big["closed"]
    listed = {s["id"]: s for s in app.client.get("/v1/sessions").json()["data"]}
    assert set(listed) == {"a", "b", "big"}  # its growth evicted no one
    assert listed["big"]["bytes"] <= 40_000 and listed["big"]["closed"] == big["closed"]
    assert app.client.delete("/v1/sessions/big").status_code == 200
    assert chat_turn(app, "big", HELLO).headers["X-Session-Turn"] == "0"


def test_an_expired_session_is_gone(app: FastApp, small_store: SessionStore) -> None:
    answer_fine(app)
    assert chat_turn(app, "old", HELLO).status_code == 200
    small_store.ttl_s = 0  # every session is now past its TTL
    assert app.client.get("/v1/sessions/old").status_code == 404
    assert app.client.get("/v1/sessions").json()["data"] == []
    history = [*HELLO, {"role": "assistant", "content": FINE}, {"role": "user", "content": "?"}]
    assert chat_turn(app, "old", history).headers["X-Session-Turn"] == "0"  # not continued
    small_store.ttl_s = 3600
    result = trajectory(app, "old")
    assert len(result["turns"]) == 1 and result["segments"][0]["reason"] is None


def test_every_accepted_id_reads_and_deletes(app: FastApp) -> None:
    answer_fine(app)
    odd = "a b?c#d%e&f=g+h~i\\j'k\"l<m>n{o}p|q"
    assert chat_turn(app, odd, HELLO).status_code == 200
    path = "/v1/sessions/" + quote(odd, safe="")
    assert app.client.get(path).json()["id"] == odd
    assert app.client.delete(path).status_code == 200
    for refused in ("run/17", "caf\xe9", "tab\there"):
        response = app.client.post(
            "/v1/chat/completions",
            json={"messages": HELLO},
            headers={"X-Session-ID": refused.encode("latin-1")},
        )
        assert response.status_code == 400 and "without '/'" in response.text, refused


def test_a_full_disk_loses_the_record_not_the_answer(
    app: FastApp, small_store: SessionStore
) -> None:
    answer_fine(app)
    messages = list(HELLO)
    for _ in range(4):
        assert "X-Session-Turn" in chat_turn(app, "first", messages).headers
        messages += [
            {"role": "assistant", "content": FINE},
            {"role": "user", "content": "x" * 3000},
        ]

    def fill() -> None:  # SQLite's own limit: past these pages, "database or disk is full"
        small_store._db.execute("VACUUM")  # no free page left inside the file either
        (pages,) = small_store._db.execute("PRAGMA page_count").fetchone()
        small_store._db.execute(f"PRAGMA max_page_count = {pages}")

    small_store._thread.submit(fill).result()
    long = [{"role": "user", "content": "y" * 6000}]
    response = chat_turn(app, "second", long)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
    assert "database or disk is full" in response.headers["X-Session-Unrecorded"]
    body = {"messages": long, "max_tokens": 16, "stream": True}
    with app.client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Session-ID": "second"}
    ) as stream:
        assert stream.status_code == 200 and stream.read().endswith(b"data: [DONE]\n\n")
    assert app.client.get("/v1/sessions/second").status_code == 404
    assert len(trajectory(app, "first")["turns"]) == 4  # as it was
    # Deleting needs no new page, and frees those the next turns take.
    assert app.client.delete("/v1/sessions/first").status_code == 200
    last = chat_turn(app, "second", long)
    assert last.headers.get("X-Session-Turn") == "0", last.headers


def test_stateful_forms_continue_a_session(app: FastApp) -> None:
    """Anthropic's thread and Responses' previous_response_id send only the new messages: the
    session's last answer is continued by extend, in the same segment, exactly."""
    headers = {"X-Session-ID": "threaded"}
    gone = {"X-Session-ID": "never-recorded"}
    base = {"max_tokens": 64, "tools": ANTHROPIC_TOOLS, "system": "Be brief."}
    first = app.client.post(
        "/v1/messages",
        json={**base, "messages": [{"role": "user", "content": "Paris?"}]},
        headers=headers,
    ).json()
    call = next(block for block in first["content"] if block["type"] == "tool_use")
    result = {"type": "tool_result", "tool_use_id": call["id"], "content": "sunny"}
    thread = {"type": "continue", "previous_message_id": first["id"]}
    # As the anthropic SDK continues a thread: without system and tools (the thread keeps them).
    body = {"max_tokens": 64, "messages": [{"role": "user", "content": [result]}], "thread": thread}
    second = app.client.post("/v1/messages", json=body, headers=headers)
    assert second.status_code == 200, second.text
    assert second.headers["X-Session-Turn"] == "1"
    # Each refusal names its field and carries the code the SDK acts on (it replays).
    unknown = {**thread, "previous_message_id": "msg_unknown"}
    for refused, param, code in [
        (
            app.client.post("/v1/messages", json=body, headers=headers),
            "thread",
            "thread_already_continued",
        ),
        (
            app.client.post("/v1/messages", json={**body, "thread": unknown}, headers=gone),
            "thread",
            "thread_not_found",
        ),
        (app.client.post("/v1/messages", json=body), "thread", "thread_unsupported_request"),
        (
            app.client.post("/v1/messages", json={**body, "thread": {"type": "create"}}),
            "thread",
            "thread_unsupported_request",
        ),
        (app.client.post("/v1/messages/render", json=body, headers=headers), "thread", None),
        (
            app.client.post(
                "/v1/messages",
                json={**body, "thread": {**thread, "type": "create"}},
                headers=headers,
            ),
            "thread",
            None,
        ),
        (
            app.client.post(
                "/v1/messages",
                json={
                    **body,
                    "system": "Be long.",
                    "thread": {**thread, "previous_message_id": second.json()["id"]},
                },
                headers=headers,
            ),
            "system",
            None,
        ),
    ]:
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == param, error
        assert error.get("details", {}).get("error_code") == code, error
    result = trajectory(app, "threaded")
    assert len(result["turns"]) == 2 and [s["reason"] for s in result["segments"]] == [None]
    assert_exact(result)
    # A create is a session's turn like any other: the whole history, continuing the session.
    history = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": first["content"]},
        body["messages"][0],
        {"role": "assistant", "content": second.json()["content"]},
        {"role": "user", "content": "Thanks."},
    ]
    created = {**base, "messages": history, "thread": {"type": "create"}}
    third = app.client.post("/v1/messages", json=created, headers=headers)
    assert third.status_code == 200 and third.headers["X-Session-Turn"] == "2", third.text

    headers = {"X-Session-ID": "chained"}
    tools = [{"type": "function", **t["function"]} for t in _chat_tools(ANTHROPIC_TOOLS)]
    base = {"tools": tools, "instructions": "Be brief."}
    first = app.client.post("/v1/responses", json={**base, "input": "Paris?"}, headers=headers)
    call = next(item for item in first.json()["output"] if item["type"] == "function_call")
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    body = {**base, "input": [output], "previous_response_id": first.json()["id"]}
    second = app.client.post("/v1/responses", json=body, headers=headers)
    assert second.status_code == 200, second.text
    assert second.json()["previous_response_id"] == first.json()["id"]
    result = trajectory(app, "chained")
    assert len(result["turns"]) == 2 and [s["reason"] for s in result["segments"]] == [None]
    assert_exact(result)
    stale = app.client.post("/v1/responses", json=body, headers=headers)
    assert stale.status_code == 400 and "last answer" in stale.text


CHROMIUM = shutil.which("chromium")


def test_a_twenty_turn_episode_views_as_a_page(app: FastApp, tmp_path: Path) -> None:
    """Twenty tool-call turns of the openai SDK, then ``/v1/sessions/{id}/view`` loaded in
    headless Chromium (Debian's package): every turn is there, with exactly its sampled tokens
    marked (the loss mask), each titled with its id and logprob; another key gets a 404."""
    call = [*app.tokenize(THINK_AND_CALL), IM_END]
    app.engine.script = lambda *_: call
    client = gpt(app, "twenty")
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris, then 19 more cities?"}]
    for index in range(20):
        reply = client.chat.completions.create(
            model="qwen3-tiny", messages=messages, tools=_chat_tools(ANTHROPIC_TOOLS), logprobs=True
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for tool_call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": f"{index} C"})
    recorded = trajectory(app, "twenty")
    assert len(recorded["turns"]) == 20 and len(recorded["segments"]) == 1
    page = app.client.get("/v1/sessions/twenty/view")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    assert app.client.get("/v1/sessions/twenty/view", headers=bearer(OTHER_KEY)).status_code == 404
    if CHROMIUM is None:
        pytest.skip("no chromium to render the page (Debian: apt-get install chromium)")
    saved = tmp_path / "view.html"
    saved.write_text(page.text)
    shown = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", saved.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    dom = shown.stdout
    for index in range(20):
        assert f'id="turn-{index}"' in dom
    # The sampled spans are the mask's ones, token for token.
    segment = recorded["segments"][0]
    assert dom.count('class="tok sampled"') == sum(segment["loss_mask"])
    assert dom.count('class="tok prompt"') == len(segment["loss_mask"]) - sum(segment["loss_mask"])
    first_sampled = recorded["turns"][0]["sampled_ids"][0]
    logprob = recorded["turns"][0]["logprobs"][0]
    assert f'title="id {first_sampled}, logprob {logprob:.4f}' in dom
