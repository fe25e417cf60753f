"""pydantic-ai's ``AnthropicModel`` with thinking on, run unmodified over HTTP under an
``X-Session-ID``: it sends every turn's whole history back, thinking blocks and their
signatures included, and the session records the episode as one exact segment (issue 29's
acceptance). The model thinks by script (``thinking_server``); the rest is the real server."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("pydantic_ai", reason="the agent harnesses: make test-frameworks")
pytest.importorskip("pydantic_ai.models.anthropic", reason="pydantic-ai-slim[anthropic]")

from anthropic import AsyncAnthropic
from pydantic_ai import Agent
from pydantic_ai.messages import ThinkingPart, ToolCallPart
from pydantic_ai.models.anthropic import AnthropicModel, AnthropicModelSettings
from pydantic_ai.providers.anthropic import AnthropicProvider

from tests.frameworks.thinking_server import API_KEY
from tests.test_fast_sessions import assert_exact

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from serverbench import ServerProcess, free_port, tree_env  # noqa: E402

SESSION = "pydantic-ai-thinking"
QUESTIONS = ["Weather in Paris?", "Should I take an umbrella?", "And tomorrow?"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    port = free_port()
    command = [sys.executable, str(ROOT / "tests/frameworks/thinking_server.py"), str(port)]
    running = ServerProcess(command, port, env=tree_env(ROOT))
    yield running
    running.stop()


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


async def episode(url: str) -> list[Any]:
    """Three questions, each run sending the whole history so far (pydantic-ai's way)."""
    client = AsyncAnthropic(
        base_url=url, api_key=API_KEY, default_headers={"X-Session-ID": SESSION}, max_retries=0
    )
    model = AnthropicModel("qwen3-tiny", provider=AnthropicProvider(anthropic_client=client))
    thinking = {"type": "enabled", "budget_tokens": 1024}
    settings = AnthropicModelSettings(max_tokens=2048, anthropic_thinking=thinking)
    agent = Agent(model, model_settings=settings, tools=[get_weather], instructions="Be brief.")
    history: list[Any] | None = None
    for question in QUESTIONS:
        result = await agent.run(question, message_history=history)
        assert "sunny" in result.output
        history = result.all_messages()
    return history or []


def test_pydantic_ai_anthropic_thinking_episode_is_one_segment(server: ServerProcess) -> None:
    history = asyncio.run(episode(server.url))
    parts = [part for message in history for part in message.parts]
    thoughts = [part for part in parts if isinstance(part, ThinkingPart)]
    # Each answer thought, and pydantic-ai kept every signature to send it back.
    assert len(thoughts) == 4 and all(thought.signature for thought in thoughts)
    assert sum(isinstance(part, ToolCallPart) for part in parts) == 1
    headers = {"Authorization": f"Bearer {API_KEY}"}
    result = httpx.get(f"{server.url}/v1/sessions/{SESSION}", headers=headers).json()
    # A tool call, its answer, then two questions: four turns, and no history rewritten.
    assert len(result["turns"]) == 4
    assert [segment["reason"] for segment in result["segments"]] == [None]
    assert_exact(result)
