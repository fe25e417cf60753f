"""Acceptance of extend + Rollout: seeded multi-turn tool-use rollouts on qwen3-tiny.

The rollouts are the example's (``examples.tool_rollout``: scripted reasoning and tool-call
openings, sampled rest, thinking on and off); the checks are independent of the server: the
suffix after each reply against transformers' own render, the loss mask against the turns'
sampled ids, and the logprobs against one transformers forward (``examples.trainer_check``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest

from examples.tool_rollout import WEATHER_TOOL, run_rollouts
from examples.trainer_check import check_rollouts, load_model, loss_mask_problems
from tests.conftest import API_KEY, Server
from tokenwire.client import AsyncClient, RolloutResult

# The acceptance run is 100 rollouts (``python -m examples.trainer_check``): 17-54 s here on 2
# shared cores, mostly sampling over the 151k vocabulary. The suite runs 40 of the same kind.
ROLLOUTS = 40
MODES = (True, False)
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def rollouts(qwen3_server: Server) -> list[RolloutResult]:
    async def run() -> list[RolloutResult]:
        async with AsyncClient(qwen3_server.url, api_key=API_KEY) as client:
            return await run_rollouts(
                client, ROLLOUTS, seed=1000, thinking_modes=MODES, max_turns=3, max_tokens=8
            )

    return asyncio.run(run())


def test_rollouts_have_tool_calls_reasoning_and_several_turns(rollouts) -> None:
    turns = [turn for result in rollouts for turn in result.turns]
    assert len(rollouts) == ROLLOUTS
    assert sum(len(result.turns) > 1 for result in rollouts) == ROLLOUTS
    assert sum(bool(turn.message.tool_calls) for turn in turns) >= ROLLOUTS // 2
    assert sum(turn.message.reasoning_content is not None for turn in turns) >= ROLLOUTS // 5
    assert {turn.finish_reason for turn in turns} >= {"length", "tool_calls"}


def test_no_prefix_breaks(rollouts) -> None:
    for result in rollouts:
        assert result.prefix_breaks == 0
        for before, after in zip(result.turns, result.turns[1:], strict=False):
            assert after.extended is True
            assert after.prompt_ids[: len(before.token_ids)] == before.token_ids


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the server hands it to the template (null content "", arguments parsed)."""
    message = json.loads(json.dumps(message))
    message["content"] = message.get("content") or ""
    for call in message.get("tool_calls") or ():
        with contextlib.suppress(ValueError):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return message


def _template_suffix(hf, previous: list, new: list, thinking: bool) -> tuple[str, bool]:
    """transformers' full render after the reply's end-of-turn, and whether the history before
    it renders as it did without the new messages."""

    def render(messages: list, generation_prompt: bool) -> str:
        return hf.apply_chat_template(
            [_for_template(m) for m in messages],
            tools=[WEATHER_TOOL],
            tokenize=False,
            add_generation_prompt=generation_prompt,
            enable_thinking=thinking,
        )

    replied = render(previous, False)
    full = render(previous + new, True)
    cut = -1
    for _ in range(replied.count(IM_END)):
        cut = full.index(IM_END, cut + 1)
    cut += len(IM_END)
    return full[cut:], full[:cut] == replied[: replied.rindex(IM_END) + len(IM_END)]


def test_suffix_is_the_template_render_at_the_boundary(rollouts, qwen3_hf_tokenizer) -> None:
    hf = qwen3_hf_tokenizer
    im_end, think_close = hf.convert_tokens_to_ids([IM_END, "</think>"])
    exact = kept = 0
    for number, result in enumerate(rollouts):
        thinking = MODES[number % len(MODES)]
        replies = [i for i, m in enumerate(result.messages) if m["role"] == "assistant"]
        for index, (before, after) in enumerate(zip(result.turns, result.turns[1:], strict=False)):
            previous = result.messages[: replies[index] + 1]
            new = result.messages[replies[index] + 1 : replies[index + 1]]
            suffix, same_history = _template_suffix(hf, previous, new, thinking)
            suffix_ids = hf.encode(suffix, add_special_tokens=False)
            assert after.prompt_ids[len(after.prompt_ids) - len(suffix_ids) :] == suffix_ids
            closing = after.prompt_ids[len(before.token_ids) : -len(suffix_ids)]
            reply = hf.decode(before.completion_ids)
            cut_in_reasoning = "<think>" in reply and "</think>" not in reply
            if before.token_ids[-1] == im_end:
                assert closing == []
            else:
                assert closing == ([think_close] if cut_in_reasoning else []) + [im_end]
            # The server's judgement of exactness agrees with transformers' render.
            assert (after.reason is None) == same_history, after.reason
            exact += same_history
            kept += not same_history
    assert exact and kept  # both kinds of boundary were exercised


def test_loss_mask_covers_exactly_the_sampled_ids(rollouts) -> None:
    for result in rollouts:
        assert loss_mask_problems(result) == []
        assert sum(result.loss_mask) == sum(len(turn.sampled_ids) for turn in result.turns)


def test_every_sampled_id_carries_its_weight_version(rollouts) -> None:
    """``versions`` names the weights that sampled each id where the loss mask is 1 (kept
    turns' ids keep theirs), and nothing elsewhere: what a trainer checks staleness with."""
    for result in rollouts:
        assert len(result.versions) == len(result.token_ids)
        for bit, version in zip(result.loss_mask, result.versions, strict=True):
            assert (version is not None) == (bit == 1)
        assert {v for v in result.versions if v is not None} == {"default"}


def test_trainer_logprobs_match(rollouts, qwen3_dir) -> None:
    check = check_rollouts(load_model(qwen3_dir), rollouts, tolerance=1e-4)
    assert check.problems == []
    assert check.checked_tokens >= ROLLOUTS
    assert check.max_abs_diff <= 1e-4
