"""Multi-turn tool-use rollouts with ``tokenwire.client.Rollout``.

    python -m examples.tool_rollout --url http://127.0.0.1:8000 --rollouts 4

Each rollout asks about the weather; when the reply calls ``get_weather`` the tool runs here and
its result goes back through extend, otherwise the user asks again. Every turn's prompt starts
with the previous turn's ids (extend keeps them verbatim), so the last turn's ids and loss mask
are the whole episode for a trainer.

``--scripted`` (default) forces some replies to open with reasoning and tool calls (prefill, loss
mask 0) so that a model with random weights such as ``qwen3-tiny`` still produces them; the rest
of each reply is sampled. Against a real model, ``--no-scripted`` lets it call tools itself.
Tool calls are parsed when the server runs with ``--tool-call-parser hermes
--enable-auto-tool-choice`` (and ``--reasoning-parser qwen3`` for reasoning).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from tokenwire.client import AsyncClient, Rollout, RolloutResult, Turn

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CITIES = ["Paris", "Köln", "東京", "São Paulo", 'Quote "City"', "Back\\slash"]
FOLLOW_UPS = ["And tomorrow?", "Thanks! Any rain?", "  spaced   out  ", "Was ist mit 🦩?"]


def run_tool(call: Mapping[str, Any]) -> str:
    """The environment: a fake weather service (arguments arrive as a JSON string)."""
    function = call.get("function") or {}
    try:
        city = json.loads(function.get("arguments") or "{}").get("city", "?")
    except (ValueError, AttributeError):
        return "error: arguments are not a JSON object"
    return f"{city}: {len(str(city)) + 10} °C, sunny"


def scripted_opening(rng: random.Random, thinking: bool) -> str | None:
    """A reply opening: none, open reasoning, or tool calls written as models write them
    (canonical JSON, or compact with escapes the template would re-space)."""
    city = rng.choice(CITIES)
    canonical = json.dumps({"name": "get_weather", "arguments": {"city": city}}, ensure_ascii=False)
    compact = json.dumps(
        {"name": "get_weather", "arguments": {"city": city}}, separators=(",", ":")
    )
    call = f"<tool_call>\n{rng.choice([canonical, compact])}\n</tool_call>"
    choices: list[str | None] = [None, call, f"{call}\n{call}"]
    if thinking:
        choices += [
            "<think>\n",
            f"<think>\nThe user wants the weather.\n\n\nI will call the tool.\n</think>\n\n{call}",
            "<think>\n\n</think>\n\n",
        ]
    return rng.choice(choices)


def follow_up(rng: random.Random, turn: Turn) -> list[dict[str, Any]]:
    """Tool results for the reply's calls, else what the user (or system) says next."""
    calls = turn.message.tool_calls or []
    if calls:
        return [
            {"role": "tool", "tool_call_id": call.get("id"), "content": run_tool(call)}
            for call in calls
        ]
    if rng.random() < 0.15:
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ok?"}]
    return [{"role": "user", "content": rng.choice(FOLLOW_UPS)}]


async def run_rollout(
    client: AsyncClient,
    seed: int,
    *,
    thinking: bool | None,
    max_turns: int = 3,
    max_tokens: int = 16,
    scripted: bool = True,
) -> RolloutResult:
    """One seeded episode; ``thinking`` sets ``enable_thinking`` (None: the template's default)."""
    rng = random.Random(seed)
    kwargs = None if thinking is None else {"enable_thinking": thinking}
    rollout = Rollout(
        client,
        tools=[WEATHER_TOOL],
        chat_template_kwargs=kwargs,
        max_turns=max_turns,
        prefill=(lambda _: scripted_opening(rng, thinking is True)) if scripted else None,
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
    )
    messages = [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": f"What is the weather in {rng.choice(CITIES)}?"},
    ]
    return await rollout.run(messages, lambda turn: follow_up(rng, turn))


async def run_rollouts(
    client: AsyncClient,
    count: int,
    *,
    seed: int = 0,
    thinking_modes: Sequence[bool | None] = (True, False),
    **options: Any,
) -> list[RolloutResult]:
    """``count`` episodes, concurrently (the server batches them), thinking modes alternating."""
    return list(
        await asyncio.gather(
            *(
                run_rollout(
                    client,
                    seed + index,
                    thinking=thinking_modes[index % len(thinking_modes)],
                    **options,
                )
                for index in range(count)
            )
        )
    )


def summary(results: Sequence[RolloutResult]) -> str:
    turns = [turn for result in results for turn in result.turns]
    reasons = Counter(turn.reason for turn in turns if turn.reason)
    lines = [
        f"{len(results)} rollouts, {len(turns)} turns, "
        f"{sum(bool(turn.message.tool_calls) for turn in turns)} with tool calls, "
        f"{sum(turn.message.reasoning_content is not None for turn in turns)} with reasoning, "
        f"prefix breaks: {sum(result.prefix_breaks for result in results)}",
        *(f"  {count} x {reason}" for reason, count in reasons.most_common()),
    ]
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> None:
    modes = {"on": (True,), "off": (False,), "both": (True, False), "default": (None,)}
    async with AsyncClient(args.url, api_key=args.api_key) as client:
        results = await run_rollouts(
            client,
            args.rollouts,
            seed=args.seed,
            thinking_modes=modes[args.thinking],
            max_turns=args.turns,
            max_tokens=args.max_tokens,
            scripted=args.scripted,
        )
    for turn in results[0].turns:
        print(f"turn {turn.index}: extended={turn.extended} {turn.message.for_history()}")
    print(summary(results))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key")
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--thinking", choices=["on", "off", "both", "default"], default="both")
    parser.add_argument("--scripted", action=argparse.BooleanOptionalAction, default=True)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(_main(parse_args()))
