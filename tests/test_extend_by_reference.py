"""Extend by reference: a render or extend remembers its prompt under a handle, and the next
extend names it with only the sampled ids, the reply and the new messages. Every turn of an
episode gives what the full form (previous ids and messages resent) gives, on the real Qwen3
template; a handle is its credential's; what cannot be honoured is a 400 that says why."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.chat_fixtures import WEATHER_TOOL
from tests.conftest import API_KEY, CONTROL_KEY, QWEN3_SERVER_ARGS, assert_error
from tests.fast_app import FastApp, serve_fast
from tests.test_extend import (
    EXTEND,
    IM_END,
    OFF,
    ON,
    QUESTION,
    REASONED_CALL,
    REASONED_CALL_TEXT,
    TOOL_RESULT,
)
from tokenwire.pipeline.prompt_memory import (
    ChainedIds,
    IdsJson,
    PromptMemory,
    RememberedPrompt,
    ids_json,
)
from tokenwire.pipeline.session_store import Owner
from tokenwire.text.chat_template import ChatTemplate

OTHER_KEY = "another-client-key"
RENDER = "/v1/chat/completions/render"
SUNNY = {"role": "assistant", "content": "Sunny, 18 C."}
TOKYO = [{"role": "user", "content": "And Tokyo? réponse 数据"}]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastApp]:
    keys = ["--api-key", API_KEY, OTHER_KEY, "--control-api-key", CONTROL_KEY]
    for app in serve_fast(tmp_path_factory, [*QWEN3_SERVER_ARGS, *keys]):
        app.client.headers["Authorization"] = f"Bearer {API_KEY}"
        yield app


def post(app: FastApp, path: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    response = app.client.post(path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def render(app: FastApp, messages: list, kwargs: dict) -> dict[str, Any]:
    body = {
        "messages": messages,
        "tools": [WEATHER_TOOL],
        "chat_template_kwargs": kwargs,
        "return_prompt_handle": True,
    }
    return post(app, RENDER, body)


def tokens(app: FastApp, text: str) -> list[int]:
    return app.tokenize(text)


class Episode:
    """One conversation extended turn by turn in both forms at once, compared at every turn."""

    def __init__(self, app: FastApp, kwargs: dict) -> None:
        self.app, self.kwargs = app, kwargs
        first = render(app, QUESTION, kwargs)
        self.messages = list(QUESTION)
        self.prompt: list[int] = first["token_ids"]
        self.handle: str = first["prompt_handle"]

    def turn(self, reply: dict, sampled: list[int], new: list, **fields: Any) -> dict[str, Any]:
        options = {"tools": [WEATHER_TOOL], "chat_template_kwargs": self.kwargs, **fields}
        full = post(
            self.app,
            EXTEND,
            {
                "previous_token_ids": [*self.prompt, *sampled],
                "previous_messages": [*self.messages, reply],
                "messages": new,
                **options,
            },
        )
        by_reference = post(
            self.app,
            EXTEND,
            {
                "previous_prompt": self.handle,
                "completion_token_ids": sampled,
                "reply": reply,
                "messages": new,
                **options,
            },
        )
        for field in ("token_ids", "extended", "reason", "kept_tokens", "sampling_params"):
            assert by_reference[field] == full[field], field
        assert "prompt_handle" not in full
        self.messages += [reply, *new]
        self.prompt, self.handle = by_reference["token_ids"], by_reference["prompt_handle"]
        return by_reference


@pytest.mark.parametrize("kwargs", [ON, OFF], ids=["thinking", "no-thinking"])
def test_an_episode_by_reference_equals_the_full_form(app: FastApp, kwargs: dict) -> None:
    episode = Episode(app, kwargs)
    call_ids = [*tokens(app, REASONED_CALL_TEXT), IM_END]
    called = episode.turn(REASONED_CALL, call_ids, TOOL_RESULT, keep_history=True)
    assert called["extended"] is True
    # A reply cut short (no end-of-turn sampled) is closed the same way.
    cut = {"role": "assistant", "content": "Sunny"}
    episode.turn(cut, tokens(app, "Sunny"), TOKYO, keep_history=True)
    # Without keep_history a history the template renders otherwise is the full render.
    episode.turn(SUNNY, [*tokens(app, SUNNY["content"]), IM_END], TOKYO)
    # Ids sampled past the end-of-turn token are dropped.
    past = [*tokens(app, SUNNY["content"]), IM_END, 198, 151643]
    last = episode.turn(SUNNY, past, TOKYO, keep_history=True)
    assert last["extended"] is True


def episode_answers(app: FastApp, kwargs: dict) -> list[dict[str, Any]]:
    episode = Episode(app, kwargs)
    call_ids = [*tokens(app, REASONED_CALL_TEXT), IM_END]
    return [
        episode.turn(REASONED_CALL, call_ids, TOOL_RESULT, keep_history=True),
        episode.turn(SUNNY, [*tokens(app, SUNNY["content"]), IM_END], TOKYO),
        episode.turn(SUNNY, [*tokens(app, "Sunny")], TOKYO, keep_history=True),
    ]


@pytest.mark.parametrize("kwargs", [ON, OFF], ids=["thinking", "no-thinking"])
def test_the_generation_prompt_proof_changes_no_answer(
    app: FastApp, kwargs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3's template is proven to append its generation prompt, so extend takes the history's
    text without it from the remembered one: the same answers as rendering it (unproven), and
    as a proof the remembered text contradicts (then it renders)."""
    assert app.client.app.state.pipeline.ready(None).chat_template.appended_generation_prompt()
    proven = episode_answers(app, kwargs)
    for appended in (None, "<not what the template appends>"):
        monkeypatch.setattr(
            ChatTemplate, "appended_generation_prompt", lambda *_, _a=appended, **__: _a
        )
        answers = episode_answers(app, kwargs)
        for fields, expected in zip(answers, proven, strict=True):
            for field in ("token_ids", "extended", "reason", "kept_tokens"):
                assert fields[field] == expected[field], (appended, field)


def test_a_handle_extends_twice_into_two_branches(app: FastApp) -> None:
    first = render(app, QUESTION, OFF)
    branches = []
    for reply_text in ("Sunny.", "Rainy."):
        reply = {"role": "assistant", "content": reply_text}
        body = {
            "previous_prompt": first["prompt_handle"],
            "completion_token_ids": [*tokens(app, reply_text), IM_END],
            "reply": reply,
            "messages": TOKYO,
            "tools": [WEATHER_TOOL],
            "chat_template_kwargs": OFF,
            "keep_history": True,
        }
        branches.append(post(app, EXTEND, body))
    sunny, rainy = branches
    assert sunny["prompt_handle"] != rainy["prompt_handle"] != first["prompt_handle"]
    assert sunny["token_ids"][: len(first["token_ids"])] == first["token_ids"]
    assert sunny["token_ids"] != rainy["token_ids"]


def reference_body(app: FastApp, **change: Any) -> dict[str, Any]:
    first = render(app, QUESTION, OFF)
    return {
        "previous_prompt": first["prompt_handle"],
        "completion_token_ids": [*tokens(app, "Sunny."), IM_END],
        "reply": {"role": "assistant", "content": "Sunny."},
        "messages": TOKYO,
        "tools": [WEATHER_TOOL],
        "chat_template_kwargs": OFF,
        **change,
    }


def test_a_handle_is_its_credentials(app: FastApp) -> None:
    body = reference_body(app)
    other = {"Authorization": f"Bearer {OTHER_KEY}"}
    assert_error(app.client.post(EXTEND, json=body, headers=other), 400, "no prompt with this")
    # The control key (the trainer's) may use any.
    control = {"Authorization": f"Bearer {CONTROL_KEY}"}
    assert app.client.post(EXTEND, json=body, headers=control).status_code == 200
    assert app.client.post(EXTEND, json=body).status_code == 200


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"previous_prompt": "prompt-0123"}, "no prompt with this handle"),
        ({"previous_token_ids": [1, 2]}, "not both"),
        ({"reply": None}, "go together"),
        ({"reply": {"role": "user", "content": "Hi"}}, "reply must be the assistant message"),
        ({"completion_token_ids": [1, 10**7]}, "completion_token_ids"),
        ({"chat_template_kwargs": ON}, "rendered with other tools"),
        ({"tools": None}, "rendered with other tools"),
    ],
)
def test_what_cannot_be_honoured_is_a_400(app: FastApp, change: dict, message: str) -> None:
    body = {key: value for key, value in reference_body(app, **change).items() if value is not None}
    assert_error(app.client.post(EXTEND, json=body), 400, message)


def test_render_with_media_gives_no_handle(app: FastApp) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [image]}], "return_prompt_handle": True}
    assert_error(app.client.post(RENDER, json=body), 400, "text conversations")


def test_memory_keeps_the_most_recent_under_its_bound() -> None:
    owner = Owner.of(b"key", control=False)

    def prompt() -> RememberedPrompt:
        return RememberedPrompt([7] * 1000, [], None, b"", owner, IdsJson.of([7] * 1000))

    memory = PromptMemory(max_bytes=3 * prompt().size)

    handles = [memory.remember(prompt()) for _ in range(3)]
    memory.recall(handles[0], owner)  # used: the least recently used is now handles[1]
    newest = memory.remember(prompt())
    assert memory.held_bytes <= memory.max_bytes
    for kept in (handles[0], handles[2], newest):
        assert memory.recall(kept, owner).token_ids == [7] * 1000
    with pytest.raises(Exception, match="no prompt with this handle"):
        memory.recall(handles[1], owner)
    assert PromptMemory(max_bytes=0).remember(prompt()) is None


def test_chained_ids_are_the_list_they_chain() -> None:
    """Every read extend makes of a remembered prompt's chained ids (index, slice, length,
    iteration, a prefix then more, the JSON) gives what the flat list gives."""
    rng, owner = random.Random(0), Owner.of(b"key", control=False)
    for _ in range(500):
        pieces = [[rng.randrange(9) for _ in range(rng.randrange(4))] for _ in range(4)]
        flat = [token for piece in pieces for token in piece]
        chained = ChainedIds.joined(ChainedIds(pieces[:-1]), pieces[-1])
        assert len(chained) == len(flat) and list(chained) == flat and chained == flat
        for index in range(-len(flat) - 1, len(flat) + 1):
            if -len(flat) <= index < len(flat):
                assert chained[index] == flat[index]
            else:
                with pytest.raises(IndexError):
                    chained[index]
        bounds = (None, 0, 2, -3, 5, 20)
        for start, stop, step in itertools.product(bounds, bounds, (None, 1, 2, -1)):
            assert chained[start:stop:step] == flat[start:stop:step]
        size, rest = rng.randrange(len(flat) + 2), [rng.randrange(9) for _ in range(2)]
        assert chained.prefix_then(size, rest) == [*flat[:size], *rest]
        assert orjson.loads(ids_json(chained).array()) == flat
        lead = RememberedPrompt(flat[:3], [], None, b"", owner, ids_json(flat[:3]))
        assert orjson.loads(ids_json(chained, lead).array()) == flat
        assert orjson.loads(ids_json(chained, lead).then(rest).array()) == [*flat, *rest]


def test_the_client_extends_by_reference_and_names_a_lost_handle(app: FastApp) -> None:
    from tokenwire.client import Client
    from tokenwire.client.errors import BadRequestError

    client = Client(http_client=app.client)
    first = client.render_chat(QUESTION, chat_template_kwargs=OFF, return_prompt_handle=True)
    assert first.prompt_handle is not None
    sunny = {"role": "assistant", "content": "Sunny."}
    sampled = [*tokens(app, "Sunny."), IM_END]
    fields = {"chat_template_kwargs": OFF, "keep_history": True}
    by_reference = client.extend_by_reference(first.prompt_handle, sampled, sunny, TOKYO, **fields)
    full = client.extend([*first.token_ids, *sampled], [*QUESTION, sunny], TOKYO, **fields)
    assert by_reference.token_ids == full.token_ids and by_reference.extended
    with pytest.raises(BadRequestError) as lost:
        client.extend_by_reference("prompt-gone", sampled, sunny, TOKYO, **fields)
    assert lost.value.param == "previous_prompt"
