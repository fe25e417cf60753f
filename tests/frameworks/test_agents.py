"""The agent harnesses' structured outputs, run unmodified over HTTP against a real tokenwire
server (issue 30): openai-agents' ``output_type`` through its chat-completions model
(``response_format`` json_schema) and its Responses model (``text.format``), and pydantic-ai's
output types, its default tool output (a ``final_result`` tool forced by ``tool_choice:
"required"``, enforced by a grammar over the hermes parser's call format) and ``NativeOutput``
(``response_format``). Each run completes and its output validates against the harness's own
model. SmolLM2 (a real instruct model without a reasoning parser; its tokenizer has no
``<tool_call>`` token, so the grammar spells the tags as text and the parser still finds the
call). The output type's schema bounds every field, so any sample the grammar allows ends
within ``MAX_TOKENS``: no seed is needed for the runs to complete. ``make test-frameworks``
installs the harnesses into ``.venv-frameworks``; elsewhere this module is skipped."""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("agents", reason="the agent harnesses: make test-frameworks")
pytest.importorskip("pydantic_ai", reason="the agent harnesses: make test-frameworks")

import agents
import pydantic_ai
from openai import AsyncOpenAI
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.conftest import Server, _start

MODEL = "smollm2-135m-instruct"
SERVER_ARGS = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
PROMPT = "Pick a city to visit, for how many days and in which season."
INSTRUCTIONS = "Plan a short trip."
# A bound a user sets on a small model; the schema keeps every answer well inside it.
MAX_TOKENS = 200

# Each harness's agent on a fresh client against the server; what it sent is recorded.
Run = Callable[[AsyncOpenAI], Coroutine[Any, Any, Any]]


class Season(enum.StrEnum):
    SPRING = "spring"
    SUMMER = "summer"
    AUTUMN = "autumn"
    WINTER = "winter"


# Its schema (pydantic's) has the enum under $defs, referred to by $ref; the docstring is the
# schema's description, which the harnesses show the model.
class Trip(BaseModel):
    """A short trip: which city, for how many days, in which season."""

    city: str = Field(min_length=1, max_length=32)
    days: int = Field(ge=1, le=7)
    season: Season


@pytest.fixture(scope="module")
def agents_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """SmolLM2 with the hermes tool parser, as a user serves it for tool calls."""
    yield from _start(tmp_path_factory, "agents", SERVER_ARGS)


def run(server: Server, agent_run: Run) -> tuple[Any, list[dict[str, Any]]]:
    """``agent_run``'s result on its own event loop, and the JSON bodies the harness sent."""
    sent: list[dict[str, Any]] = []

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    async def main() -> Any:
        hooks = {"request": [record]}
        async with httpx.AsyncClient(event_hooks=hooks, timeout=120) as http:
            client = AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key="unused", http_client=http, max_retries=0
            )
            return await agent_run(client)

    return asyncio.run(main()), sent


def assert_trip(output: Any) -> None:
    assert isinstance(output, Trip), output
    Trip.model_validate(output.model_dump())


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_output_type(agents_server: Server, api: str) -> None:
    """openai-agents' ``Runner`` with ``output_type=Trip`` on its chat-completions model and
    its Responses model: one turn, the final output parsed by the SDK (strict schema)."""
    agents.set_tracing_disabled(True)  # no trace export: nothing outside to send it to

    async def agent_run(client: AsyncOpenAI) -> Any:
        model: agents.Model
        if api == "chat":
            model = agents.OpenAIChatCompletionsModel(MODEL, client)
        else:
            model = agents.OpenAIResponsesModel(MODEL, client)
        agent = agents.Agent(
            name="planner",
            instructions=INSTRUCTIONS,
            model=model,
            output_type=Trip,
            model_settings=agents.ModelSettings(max_tokens=MAX_TOKENS),
        )
        return await agents.Runner.run(agent, PROMPT)

    result, sent = run(agents_server, agent_run)
    assert_trip(result.final_output)
    [body] = sent
    fmt = body["response_format"] if api == "chat" else body["text"]["format"]
    assert fmt["type"] == "json_schema"


def pydantic_ai_run(output_type: Any, **settings: Any) -> Run:
    async def agent_run(client: AsyncOpenAI) -> Any:
        model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
        model_settings = pydantic_ai.ModelSettings(max_tokens=MAX_TOKENS, **settings)
        agent = pydantic_ai.Agent(
            model, output_type=output_type, instructions=INSTRUCTIONS, model_settings=model_settings
        )
        return await agent.run(PROMPT)

    return agent_run


@pytest.mark.parametrize("parallel", [None, False], ids=["default", "one-call"])
def test_pydantic_ai_tool_output(agents_server: Server, parallel: bool | None) -> None:
    """pydantic-ai's default output mode: a ``final_result`` tool whose parameters are Trip's
    schema (``$defs`` and all), called under ``tool_choice: "required"``. The tags are text
    in SmolLM2's vocabulary (several tokens each), and the calls still parse. By default the
    model may call it more than once (SmolLM2 often does, up to ``max_tokens``: the cut-off
    call stays in the content, as the hermes parser keeps text); pydantic-ai takes the first.
    With ``parallel_tool_calls=False`` the grammar allows exactly one call and nothing else."""
    with agents_server.client() as client:
        tag = client.post("/tokenize", json={"prompt": "<tool_call>"}).json()["tokens"]
    assert len(tag) > 1
    settings = {} if parallel is None else {"parallel_tool_calls": parallel}
    result, sent = run(agents_server, pydantic_ai_run(Trip, **settings))
    assert_trip(result.output)
    [body] = sent
    assert body["tool_choice"] == "required"
    assert body.get("parallel_tool_calls") == parallel
    assert [tool["function"]["name"] for tool in body["tools"]] == ["final_result"]
    assert "$defs" in body["tools"][0]["function"]["parameters"]
    response = result.all_messages()[1]
    assert isinstance(response, pydantic_ai.ModelResponse)
    assert response.finish_reason == "tool_call"
    calls = [part for part in response.parts if isinstance(part, pydantic_ai.ToolCallPart)]
    assert calls and all(call.tool_name == "final_result" for call in calls)
    if parallel is False:
        assert response.parts == calls and len(calls) == 1


def test_pydantic_ai_native_output(agents_server: Server) -> None:
    """``NativeOutput(Trip)``: the schema as ``response_format`` json_schema."""
    result, sent = run(agents_server, pydantic_ai_run(pydantic_ai.NativeOutput(Trip)))
    assert_trip(result.output)
    [body] = sent
    assert body["response_format"]["type"] == "json_schema"
    assert "tools" not in body
