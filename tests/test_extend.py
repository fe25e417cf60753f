"""POST /v1/chat/completions/extend on the real Qwen3 template (and SmolLM2's ChatML).

Expected ids come from transformers' own ``apply_chat_template`` (jinja2, not the server's
MiniJinja), so the suffix the server derives is checked against an independent render.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.chat_fixtures import WEATHER_TOOL
from tests.conftest import assert_error
from tests.fast_app import fast_client

EXTEND = "/v1/chat/completions/extend"


# Nothing here runs the model (see ``tests.fast_app.fast_client``).
qwen3 = fast_client("fast_qwen3_app", "qwen3")
smollm2 = fast_client("fast_smollm2_app", "smollm2")


IM_END = 151645
THINK_CLOSE = 151668
ON = {"enable_thinking": True}
OFF = {"enable_thinking": False}
QUESTION = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
]
REASONED_CALL = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "The user wants the weather.",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}
REASONED_CALL_TEXT = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
TOOL_RESULT = [{"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


def template_text(hf, messages: list[dict[str, Any]], kwargs: dict, **flags: Any) -> str:
    """transformers' render (tool-call arguments as objects, as the server hands them over)."""
    import json

    messages = json.loads(json.dumps(messages))
    for message in messages:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return hf.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, **flags, **kwargs)


def suffix_after_reply(hf, previous: list, new: list, kwargs: dict) -> tuple[str, bool]:
    """The full render's text after the reply's ``<|im_end|>``, and whether the history before
    it renders as it did without the new messages."""
    replied = template_text(hf, previous, kwargs, add_generation_prompt=False)
    full = template_text(hf, previous + new, kwargs, add_generation_prompt=True)
    turns = replied.count("<|im_end|>")
    cut = -1
    for _ in range(turns):
        cut = full.index("<|im_end|>", cut + 1)
    cut += len("<|im_end|>")
    return full[cut:], full[:cut] == replied[: replied.rindex("<|im_end|>") + len("<|im_end|>")]


def prompt_ids(client: httpx.Client, messages: list, kwargs: dict) -> list[int]:
    body = {"messages": messages, "tools": [WEATHER_TOOL], "chat_template_kwargs": kwargs}
    response = client.post("/v1/chat/completions/render", json=body)
    assert response.status_code == 200, response.text
    return response.json()["token_ids"]


def extend(
    client: httpx.Client, previous_ids: list[int], previous: list, new: list, **fields: Any
) -> dict:
    body = {
        "previous_token_ids": previous_ids,
        "previous_messages": previous,
        "messages": new,
        "tools": [WEATHER_TOOL],
        **fields,
    }
    response = client.post(EXTEND, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def encode(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False)


def test_exact_extension_equals_full_render(qwen3: httpx.Client, qwen3_hf_tokenizer) -> None:
    """Thinking on, a reasoned tool call, then its result: Qwen3 renders that history the same
    way, so with canonical previous ids extending gives exactly the full render."""
    hf = qwen3_hf_tokenizer
    previous = [*QUESTION, REASONED_CALL]
    previous_ids = [*prompt_ids(qwen3, QUESTION, ON), *encode(hf, REASONED_CALL_TEXT), IM_END]
    body = extend(qwen3, previous_ids, previous, TOOL_RESULT, chat_template_kwargs=ON)
    suffix, same_history = suffix_after_reply(hf, previous, TOOL_RESULT, ON)
    assert same_history
    assert body["extended"] is True and body["reason"] is None
    assert body["kept_tokens"] == len(previous_ids)
    assert body["token_ids"] == [*previous_ids, *encode(hf, suffix)]
    assert body["token_ids"] == prompt_ids(qwen3, previous + TOOL_RESULT, ON)
    assert suffix.startswith("\n<|im_start|>user\n<tool_response>")
    assert body["request_id"].startswith("chatcmpl-")
    room = 4096 - len(body["token_ids"])
    assert body["sampling_params"]["max_tokens"] == room


def test_sampled_ids_are_kept_verbatim(qwen3: httpx.Client, qwen3_hf_tokenizer) -> None:
    """Ids a re-render would change (a split word, leading whitespace after the newline, bytes
    of one character in two tokens) stay as sampled; the template's suffix follows."""
    hf = qwen3_hf_tokenizer
    previous = [*QUESTION, REASONED_CALL]
    reply = encode(hf, "<think>\n") + [hf.convert_tokens_to_ids(c) for c in "The"]
    reply += encode(hf, " user wants the weather.\n</think>\n\n") + [82912, 246]  # '龘' split
    previous_ids = [*prompt_ids(qwen3, QUESTION, ON), *reply, IM_END]
    body = extend(qwen3, previous_ids, previous, TOOL_RESULT, chat_template_kwargs=ON)
    suffix, _ = suffix_after_reply(hf, previous, TOOL_RESULT, ON)
    assert body["token_ids"] == [*previous_ids, *encode(hf, suffix)]


@pytest.mark.parametrize(
    ("kwargs", "reply", "closing"),
    [
        (ON, "<think>\nStill thinking about", [THINK_CLOSE, IM_END]),
        (OFF, " The weather is", [IM_END]),
        (ON, "<think>\nDone.\n</think>\n\nIt is", [IM_END]),
    ],
    ids=["cut-in-reasoning", "cut-in-content", "cut-after-reasoning"],
)
def test_cut_reply_is_closed(
    qwen3: httpx.Client, qwen3_hf_tokenizer, kwargs: dict, reply: str, closing: list[int]
) -> None:
    hf = qwen3_hf_tokenizer
    message = {"role": "assistant", "content": reply}
    previous_ids = [*prompt_ids(qwen3, QUESTION, kwargs), *encode(hf, reply)]
    new = [{"role": "tool", "content": "18 C"}]
    body = extend(
        qwen3,
        previous_ids,
        [*QUESTION, message],
        new,
        chat_template_kwargs=kwargs,
        keep_history=True,
    )
    suffix, _ = suffix_after_reply(hf, [*QUESTION, message], new, kwargs)
    assert body["extended"] is True
    assert body["token_ids"] == [*previous_ids, *closing, *encode(hf, suffix)]


def test_ids_after_the_end_of_turn_are_dropped(qwen3: httpx.Client, qwen3_hf_tokenizer) -> None:
    hf = qwen3_hf_tokenizer
    message = {"role": "assistant", "content": "Sunny."}
    previous_ids = [*prompt_ids(qwen3, QUESTION, OFF), *encode(hf, "Sunny."), IM_END]
    body = extend(
        qwen3,
        [*previous_ids, 198, 151643],
        [*QUESTION, message],
        [{"role": "user", "content": "Thanks"}],
        chat_template_kwargs=OFF,
        keep_history=True,
    )
    assert body["extended"] is True
    assert body["kept_tokens"] == len(previous_ids)
    assert body["token_ids"][: len(previous_ids) + 1] == [*previous_ids, 198]


@pytest.mark.parametrize(
    ("kwargs", "previous_tail", "new"),
    [
        (OFF, [], TOOL_RESULT),  # the empty think block is not re-rendered for history turns
        (ON, [REASONED_CALL], [{"role": "user", "content": "And Tokyo?"}]),  # reasoning dropped
    ],
    ids=["thinking-off-tool", "thinking-on-new-query"],
)
def test_history_rewrite_returns_full_render_unless_kept(
    qwen3: httpx.Client, qwen3_hf_tokenizer, kwargs: dict, previous_tail: list, new: list
) -> None:
    hf = qwen3_hf_tokenizer
    message = previous_tail[0] if previous_tail else {"role": "assistant", "content": "Sunny."}
    reply = REASONED_CALL_TEXT if previous_tail else "Sunny."
    previous = [*QUESTION, message]
    previous_ids = [*prompt_ids(qwen3, QUESTION, kwargs), *encode(hf, reply), IM_END]
    suffix, same_history = suffix_after_reply(hf, previous, new, kwargs)
    assert not same_history

    full = extend(qwen3, previous_ids, previous, new, chat_template_kwargs=kwargs)
    assert full["extended"] is False and full["kept_tokens"] == 0
    assert "renders the history otherwise" in full["reason"]
    assert full["token_ids"] == prompt_ids(qwen3, previous + new, kwargs)
    assert full["token_ids"][: len(previous_ids)] != previous_ids

    kept = extend(
        qwen3, previous_ids, previous, new, chat_template_kwargs=kwargs, keep_history=True
    )
    assert kept["extended"] is True and "kept as sent" in kept["reason"]
    assert kept["token_ids"] == [*previous_ids, *encode(hf, suffix)]


def test_new_assistant_message_is_not_extended(qwen3: httpx.Client) -> None:
    message = {"role": "assistant", "content": "Sunny."}
    previous_ids = [*prompt_ids(qwen3, QUESTION, ON), 50, IM_END]
    new = [{"role": "assistant", "content": "More?"}, {"role": "user", "content": "Yes"}]
    body = extend(qwen3, previous_ids, [*QUESTION, message], new, chat_template_kwargs=ON)
    assert body["extended"] is False
    assert "assistant message" in body["reason"]
    assert body["token_ids"] == prompt_ids(qwen3, [*QUESTION, message, *new], ON)


def test_ids_from_another_generation_prompt_are_not_extended(qwen3: httpx.Client) -> None:
    """Rendered with thinking on, extended with thinking off: the prompt that opened the reply
    is not the one this template writes, so the boundary cannot be trusted."""
    message = {"role": "assistant", "content": "Sunny."}
    previous_ids = [*prompt_ids(qwen3, QUESTION, ON), 50, IM_END]
    body = extend(
        qwen3,
        previous_ids,
        [*QUESTION, message],
        TOOL_RESULT,
        chat_template_kwargs=OFF,
        keep_history=True,
    )
    assert body["extended"] is False
    assert "generation prompt" in body["reason"]


def test_template_without_end_of_turn_token(qwen3: httpx.Client) -> None:
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    message = {"role": "assistant", "content": " Sunny."}
    previous = [{"role": "user", "content": "Weather?"}, message]
    previous_ids = qwen3.post(
        "/tokenize",
        json={"prompt": "user: Weather?\nassistant: Sunny.", "add_special_tokens": False},
    ).json()["tokens"]
    body = extend(
        qwen3, previous_ids, previous, [{"role": "user", "content": "Ok"}], chat_template=template
    )
    assert body["extended"] is False
    assert "end-of-turn" in body["reason"]


def test_chatml_without_reasoning_extends_exactly(smollm2: httpx.Client) -> None:
    """SmolLM2's template: no think blocks, nothing rewritten, the bridge is the newline."""
    messages = [{"role": "user", "content": "Hi"}]
    prompt = smollm2.post("/v1/chat/completions/render", json={"messages": messages}).json()
    sampled = smollm2.post("/tokenize", json={"prompt": " Hello!", "add_special_tokens": False})
    previous_ids = [*prompt["token_ids"], *sampled.json()["tokens"], 2]
    previous = [*messages, {"role": "assistant", "content": " Hello!"}]
    new = [{"role": "user", "content": "Bye"}]
    body = smollm2.post(
        EXTEND,
        json={"previous_token_ids": previous_ids, "previous_messages": previous, "messages": new},
    ).json()
    assert body["extended"] is True and body["reason"] is None
    suffix = smollm2.post(
        "/tokenize",
        json={
            "prompt": "\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
            "add_special_tokens": False,
        },
    ).json()["tokens"]
    assert body["token_ids"] == [*previous_ids, *suffix]


REPLY = {"role": "assistant", "content": "Sunny."}


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        ({"previous_messages": QUESTION}, 400, "must end with the assistant reply"),
        ({"previous_messages": [REPLY]}, 400, "previous_messages"),
        ({"previous_token_ids": []}, 400, "previous_token_ids"),
        ({"previous_token_ids": [1, -2]}, 400, "previous_token_ids"),
        ({"previous_token_ids": [1, 10**7]}, 400, "out of vocabulary"),
        ({"messages": []}, 400, "messages"),
        ({"keep_history": "maybe"}, 400, "keep_history"),
        ({"model": "nope"}, 404, "does not exist"),
        ({"max_tokens": 10**6}, 400, "maximum context length"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            }
                        ],
                    }
                ]
            },
            400,
            "text-only",
        ),
    ],
)
def test_bad_input(qwen3: httpx.Client, change: dict, status: int, message: str) -> None:
    body = {
        "previous_token_ids": [*prompt_ids(qwen3, QUESTION, OFF), 50, IM_END],
        "previous_messages": [*QUESTION, REPLY],
        "messages": [{"role": "user", "content": "Thanks"}],
        "chat_template_kwargs": OFF,
        **change,
    }
    assert_error(qwen3.post(EXTEND, json=body), status, message)


def test_needs_the_api_key(qwen3: httpx.Client) -> None:
    assert_error(qwen3.post(EXTEND, json={}, headers={"Authorization": ""}), 401)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    previous_ids=st.lists(st.integers(0, 151668), min_size=1, max_size=40),
    reply=st.text(max_size=30),
    new_role=st.sampled_from(["user", "tool", "system", "assistant", "x"]),
    kwargs=st.sampled_from([ON, OFF, {}]),
    keep_history=st.booleans(),
)
def test_any_previous_ids_answer_without_5xx(
    qwen3: httpx.Client,
    previous_ids: list[int],
    reply: str,
    new_role: str,
    kwargs: dict,
    keep_history: bool,
) -> None:
    """Whatever ids and reply text arrive, the answer is a render or a clear 400, and an
    extended one starts with the kept ids."""
    previous = [*QUESTION, {"role": "assistant", "content": reply}]
    prefix = prompt_ids(qwen3, QUESTION, kwargs) if keep_history else []
    response = qwen3.post(
        EXTEND,
        json={
            "previous_token_ids": [*prefix, *previous_ids],
            "previous_messages": previous,
            "messages": [{"role": new_role, "content": "ok"}],
            "chat_template_kwargs": kwargs,
            "keep_history": keep_history,
            "max_tokens": 1,
        },
    )
    assert response.status_code in (200, 400), response.text
    if response.status_code == 200:
        body = response.json()
        sent = [*prefix, *previous_ids]
        kept = body["kept_tokens"]
        assert body["token_ids"][:kept] == sent[:kept]
        assert body["extended"] == (kept > 0)


def test_large_tools_render_off_the_event_loop(
    qwen3: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose bulk is its tools (short messages) renders and encodes on a worker
    thread, as large messages do: the event loop keeps serving everyone else."""
    import asyncio

    from tokenwire.pipeline import chat_render
    from tokenwire.pipeline import extend as extend_module

    on_loop: list[str] = []

    def spy(name: str, real: Any) -> Any:
        def call(*args: Any) -> Any:
            try:
                asyncio.get_running_loop()
                on_loop.append(name)
            except RuntimeError:  # a worker thread has no running loop
                pass
            return real(*args)

        return call

    real_render = chat_render._render_server_template
    monkeypatch.setattr(chat_render, "_render_server_template", spy("render", real_render))
    monkeypatch.setattr(extend_module, "extend_ids", spy("extend", extend_module.extend_ids))
    big_tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Looks things up.",
            "parameters": {
                "type": "object",
                "properties": {f"field_{i}": {"type": "string"} for i in range(20_000)},
            },
        },
    }
    body = {
        "previous_token_ids": [*prompt_ids(qwen3, QUESTION, OFF), 50, IM_END],
        "previous_messages": [*QUESTION, REPLY],
        "messages": [{"role": "user", "content": "Thanks"}],
        "tools": [big_tool],
        "chat_template_kwargs": OFF,
    }
    on_loop.clear()  # the small render of previous_token_ids above
    # Rendered, extended and encoded (then too long for this model: what the red team's got).
    assert_error(qwen3.post(EXTEND, json=body), 400, "maximum context length")
    assert on_loop == []
    # A small request still renders inline: a thread hop would cost more than its render.
    prompt_ids(qwen3, QUESTION, OFF)
    assert on_loop == ["render"]


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "A", "name": "bot", "reasoning_content": "why"},
        {"role": "tool", "content": "22", "tool_call_id": "call-1"},
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
        {"role": "assistant", "tool_calls": [_CALL]},
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "user", "name": None, "content": "b"},
        {"content": "c", "role": "system"},
    ],
)
def test_template_messages_are_model_dumps(message: dict[str, Any]) -> None:
    """A message's template dict, built directly where its fields are strings, is what
    model_dump gives (keys in its order), as every other message's is."""
    from tokenwire.pipeline import chat_render
    from tokenwire.protocol.chat import ChatMessage

    model = ChatMessage.model_validate(message)
    dumped = model.model_dump(exclude_unset=True)
    built = chat_render._text_message_dump(model)
    assert built is None or (built == dumped and list(built) == list(dumped))
    if all(type(value) is str for value in message.values()) and "reasoning_content" not in message:
        assert built is not None  # the direct build is taken where it can be
    for iterates_content in (False, True):
        data = chat_render._message_for_template(model, iterates_content)
        if built is not None:
            assert data == dumped and list(data) == list(dumped)
