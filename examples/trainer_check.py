"""The trainer's side: recompute the rollouts' logprobs with transformers and compare.

    tokenwire serve --model qwen3-tiny --reasoning-parser qwen3 \\
        --tool-call-parser hermes --enable-auto-tool-choice &
    python -m examples.trainer_check --model qwen3-tiny --rollouts 100

A trainer computes the policy's logprobs of the collected ids with its own forward pass; PPO-style
ratios are only right if those ids are the sampled ones, in the contexts they were sampled in,
and the server's logprobs agree with the trainer's. For each rollout this checks that the loss
mask marks exactly the sampled ids (each at the position it was sampled at) and that one
transformers forward over the whole episode gives the server's logprobs within ``--tolerance``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from examples.tool_rollout import run_rollouts, summary
from tokenwire.client import AsyncClient, RolloutResult

DEFAULT_TOLERANCE = 1e-4


@dataclass(slots=True)
class Check:
    checked_tokens: int = 0
    max_abs_diff: float = 0.0
    problems: list[str] | None = None


def load_model(model_dir: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def recompute_logprobs(
    model: PreTrainedModel, token_ids: Sequence[int], positions: Sequence[int]
) -> list[float]:
    """logprob of the id at each of ``positions`` (>= 1) given the ids before it.

    Only those positions' logits are computed (``logits_to_keep``): a full [length, vocabulary]
    log-softmax is most of the cost with a 151k vocabulary.
    """
    ids = torch.tensor([list(token_ids)])
    before = torch.tensor([position - 1 for position in positions])
    logits = model(input_ids=ids, logits_to_keep=before).logits[0].float()
    targets = ids[0, before + 1, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets)[:, 0].tolist()


def loss_mask_problems(result: RolloutResult) -> list[str]:
    """The mask's 1s are exactly the sampled ids, each at the offset it was sampled at."""
    ids, mask = result.token_ids, result.loss_mask
    problems = []
    if len(mask) != len(ids) or len(result.logprobs) != len(ids):
        return [f"mask/logprobs/ids lengths differ: {len(mask)}/{len(result.logprobs)}/{len(ids)}"]
    first = max((t.index for t in result.turns if t.extended is False), default=0)
    expected: list[int] = []
    for turn in result.turns[first:]:
        offset = len(turn.prompt_ids) + len(turn.prefill_ids)
        if ids[offset : offset + len(turn.sampled_ids)] != turn.sampled_ids:
            problems.append(f"turn {turn.index}: sampled ids are not at offset {offset}")
        expected += turn.sampled_ids
    masked = [token for token, bit in zip(ids, mask, strict=True) if bit == 1]
    if masked != expected or any(bit not in (0, 1) for bit in mask):
        problems.append("the loss mask does not mark exactly the sampled ids")
    return problems


def check_rollouts(
    model: PreTrainedModel, results: Sequence[RolloutResult], tolerance: float
) -> Check:
    check = Check(problems=[])
    for number, result in enumerate(results):
        check.problems += [f"rollout {number}: {p}" for p in loss_mask_problems(result)]
        positions = [position for position, bit in enumerate(result.loss_mask) if bit]
        recomputed = recompute_logprobs(model, result.token_ids, positions)
        for position, logprob in zip(positions, recomputed, strict=True):
            diff = abs(logprob - result.logprobs[position])
            check.max_abs_diff = max(check.max_abs_diff, diff)
        check.checked_tokens += len(positions)
        if result.prefix_breaks:
            check.problems.append(f"rollout {number}: {result.prefix_breaks} prefix breaks")
    if check.max_abs_diff > tolerance:
        check.problems.append(f"logprobs differ by {check.max_abs_diff:.2e} > {tolerance:.0e}")
    return check


def model_dir_of(name: str) -> Path:
    path = Path(name)
    if path.is_dir():
        return path
    from tokenwire.assets import prepare

    return prepare(name)


async def _main(args: argparse.Namespace) -> int:
    async with AsyncClient(args.url, api_key=args.api_key) as client:
        results = await run_rollouts(
            client, args.rollouts, seed=args.seed, max_turns=args.turns, max_tokens=args.max_tokens
        )
    print(summary(results))
    check = check_rollouts(load_model(model_dir_of(args.model)), results, args.tolerance)
    print(
        f"{check.checked_tokens} sampled ids checked, max |logprob diff| {check.max_abs_diff:.2e}"
    )
    for problem in check.problems or ():
        print("FAIL", problem)
    return 1 if check.problems else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key")
    parser.add_argument("--model", default="qwen3-tiny", help="asset name or model directory")
    parser.add_argument("--rollouts", type=int, default=100)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(parse_args())))
