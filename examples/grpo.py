"""GRPO through tokenwire in plain PyTorch: sample -> score -> train -> sync weights, every step.

    tokenwire serve --enable-rl-control --weight-transfer-config '{"backend": "gloo"}' &
    python -m examples.grpo --log grpo.json --plot grpo.png

The task is a calculator episode in two turns: the user asks for ``a op b``, the model replies
(turn 1), the environment's calculator answers in the middle (a ``tool`` message) and asks for
the final answer as the number only (turn 2). The reward is 1 for exactly the number, 0.5 for a
reply that contains it, else 0: the model learns to copy the tool's result in the asked format.

Each step samples ``--prompts`` prompts x ``--group`` episodes with ``tokenwire.client.Rollout``
(extend between turns, so the episode's ids are exactly the sampled ones with a loss mask),
computes group-relative advantages and a clipped policy-gradient loss over the sampled ids with
the trainer's float32 forward, and pushes the new weights to every server in memory
(``WeightSender``, version ``step-N``). Each step also reports how far the sampler's logprobs are
from the trainer's forward of the same ids (max and mean |delta|, k3 KL), split into tokens
sampled before and after the last weight update (``--lag 1``: the next batch is sampled while
this one trains, so its episodes straddle the update), and checks the version of every token.

Sampling is at temperature 1 with no top-k/top-p, so the server's raw logprobs (its default
``--logprobs-mode``) are the sampling distribution's and the trainer's plain log-softmax is the
same quantity. ``--servers`` lists every server (their control routes get the weights);
``--router`` (vllm-router in front of them) then carries the sampling.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tokenwire.client import AsyncClient, Client, Rollout, RolloutResult
from tokenwire.client.weights import WeightSender

SYSTEM = "Use the calculator. Give the final answer as the number only."
ASK_FINAL = "Final answer, number only:"


# --- the environment -------------------------------------------------------------------------


@dataclass(slots=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {self.a} {self.op} {self.b}?"},
        ]

    def calculator(self) -> list[dict[str, str]]:
        """The tool result in the middle of the episode, then the ask for the final answer."""
        return [
            {"role": "tool", "content": f"{self.a} {self.op} {self.b} = {self.answer}"},
            {"role": "user", "content": ASK_FINAL},
        ]


def make_problem(rng: random.Random) -> Problem:
    return Problem(rng.randint(10, 99), rng.choice("+-*"), rng.randint(10, 99))


def reward(problem: Problem, final: str) -> float:
    answer = str(problem.answer)
    if final.strip().rstrip(".") == answer:
        return 1.0
    return 0.5 if re.search(rf"(?<![\d-]){re.escape(answer)}(?!\d)", final) else 0.0


# --- sampling ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Episode:
    problem: Problem
    result: RolloutResult
    reward: float = 0.0
    advantage: float = 0.0


async def sample(
    urls: Sequence[str],
    api_key: str | None,
    problems: list[Problem],
    args: argparse.Namespace,
    step: int,
) -> list[Episode]:
    """``args.group`` episodes per problem; a group shares an ``X-Session-ID`` (vllm-router's
    consistent hash keeps it on one server, whose prefix cache then holds its prompt)."""

    async def group(index: int, problem: Problem) -> list[Episode]:
        headers = {"X-Session-ID": f"step{step}-group{index}"}
        async with AsyncClient(urls[index % len(urls)], api_key=api_key, headers=headers) as c:

            async def one(member: int) -> Episode:
                # One seed per episode: a rerun samples the same ids (at a cost on the hf
                # engine, whose seeded rows run batch-invariant forwards).
                seed = args.seed * 10**6 + 1000 * step + args.group * index + member
                rollout = Rollout(
                    c,
                    max_turns=2,
                    max_tokens=args.max_tokens,
                    temperature=1.0,
                    **({"seed": seed} if args.seed_sampling else {}),
                )
                result = await rollout.run(
                    problem.messages(),
                    lambda turn: problem.calculator() if turn.index == 0 else None,
                )
                return Episode(problem, result)

            return list(await asyncio.gather(*(one(m) for m in range(args.group))))

    groups = await asyncio.gather(*(group(i, p) for i, p in enumerate(problems)))
    return [episode for episodes in groups for episode in episodes]


def score(episodes: list[Episode], group: int) -> None:
    """Rewards, then GRPO's advantages: the reward less its group's mean, over the group's std."""
    for episode in episodes:
        final = episode.result.turns[-1].message.content or ""
        episode.reward = reward(episode.problem, final)
    for start in range(0, len(episodes), group):
        members = episodes[start : start + group]
        rewards = torch.tensor([e.reward for e in members])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for episode, advantage in zip(members, advantages.tolist(), strict=True):
            episode.advantage = advantage


# --- training ----------------------------------------------------------------------------------


def token_logprobs(model: PreTrainedModel, ids: list[int], positions: list[int]) -> torch.Tensor:
    """The float32 logprob of the id at each of ``positions`` given the ids before it (one
    unpadded forward per episode, as the server's own forward sees it; logits only where
    needed)."""
    before = torch.tensor([p - 1 for p in positions])
    logits = model(input_ids=torch.tensor([ids]), logits_to_keep=before).logits[0].float()
    targets = torch.tensor(ids)[before + 1]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


@dataclass(slots=True)
class Mismatch:
    """|trainer - sampler| over sampled tokens, and k3 = e^r - 1 - r with r = trainer - sampler
    (an unbiased estimate of KL(sampler || trainer) from the sampler's own tokens)."""

    tokens: int = 0
    max_abs: float = 0.0
    sum_abs: float = 0.0
    sum_k3: float = 0.0

    def add(self, trainer: torch.Tensor, sampler: torch.Tensor) -> None:
        delta = (trainer - sampler).double()
        self.tokens += delta.numel()
        if delta.numel():
            self.max_abs = max(self.max_abs, delta.abs().max().item())
        self.sum_abs += delta.abs().sum().item()
        self.sum_k3 += (delta.exp() - 1 - delta).sum().item()

    def summary(self) -> dict[str, float | int]:
        n = max(self.tokens, 1)
        return {
            "tokens": self.tokens,
            "max_abs": self.max_abs,
            "mean_abs": self.sum_abs / n,
            "k3_kl": self.sum_k3 / n,
        }


def train_step(
    model: PreTrainedModel,
    previous: PreTrainedModel | None,
    optimizer: torch.optim.Optimizer,
    episodes: list[Episode],
    new_version: str,
    clip: float,
) -> tuple[dict[str, Mismatch], float]:
    """One optimizer step of GRPO's clipped objective, token-mean over the batch. Tokens the
    current weights (``new_version``) sampled are on-policy; tokens an older version sampled
    (``--lag 1``) are compared with ``previous``, that version's weights, and trained with the
    importance ratio against the sampler's logprobs that the clip bounds."""
    mismatch = {"after_update": Mismatch(), "before_update": Mismatch()}
    total = sum(sum(e.result.loss_mask) for e in episodes)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for episode in episodes:
        result = episode.result
        positions = [p for p, bit in enumerate(result.loss_mask) if bit]
        sampler = torch.tensor([result.logprobs[p] for p in positions])
        current = torch.tensor([result.versions[p] == new_version for p in positions])
        # Episodes with no advantage add no gradient: their forward only measures the mismatch.
        with torch.set_grad_enabled(episode.advantage != 0.0):
            logprobs = token_logprobs(model, result.token_ids, positions)
        mismatch["after_update"].add(logprobs.detach()[current], sampler[current])
        if not current.all():
            if previous is None:
                raise ValueError("tokens of an older version, and no older weights kept")
            with torch.no_grad():
                old = token_logprobs(previous, result.token_ids, positions)
            mismatch["before_update"].add(old[~current], sampler[~current])
        if episode.advantage == 0.0:
            continue
        ratio = torch.exp(logprobs - sampler)
        advantage = torch.tensor(episode.advantage)
        objective = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
        loss = -objective.sum() / total
        loss.backward()
        loss_sum += loss.item()
    optimizer.step()
    return mismatch, loss_sum


# --- the loop ----------------------------------------------------------------------------------


@dataclass(slots=True)
class StepLog:
    step: int
    version: str
    reward_mean: float
    exact: float
    trained_episodes: int  # with a nonzero advantage: the ones that move the weights
    loss: float
    mismatch: dict[str, dict[str, float | int]]
    versions: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)
    sample_text: str = ""


def check_versions(episodes: list[Episode], allowed: set[str]) -> dict[str, int]:
    """Every sampled id carries a version this step may have sampled with (staleness 0: the
    current one; ``--lag 1``: also the one before), and none goes back in time."""
    counts: dict[str, int] = {}
    for episode in episodes:
        result = episode.result
        seen = [v for v, bit in zip(result.versions, result.loss_mask, strict=True) if bit]
        for version in seen:
            if version not in allowed:
                raise AssertionError(f"a token sampled by {version!r}; expected {sorted(allowed)}")
            counts[version] = counts.get(version, 0) + 1
        order = sorted(allowed, key=_step_of)
        if [order.index(v) for v in seen] != sorted(order.index(v) for v in seen):
            raise AssertionError(f"versions go back within an episode: {seen}")
    return counts


def _step_of(version: str) -> int:
    return int(version.removeprefix("step-"))


def load_policy(model: str) -> PreTrainedModel:
    path = Path(model)
    if not path.is_dir():
        from tokenwire.assets import prepare

        path = Path(prepare(model))
    # float32: the server's hf engine runs float32 on CPU, so the forwards agree to ~1e-5.
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


async def run(args: argparse.Namespace) -> list[StepLog]:
    # One thread by default: the server's hf engine takes the other core (--engine-threads'
    # default), and two threads that a busy machine deschedules wait on each other (10x slower).
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = load_policy(args.model)
    # Only the top layers train: the gradient then stops there (cheaper on CPU); every weight is
    # still sent, as a server takes only complete updates.
    trainable = set(range(model.config.num_hidden_layers - args.train_layers, 10**6))
    for name, param in model.named_parameters():
        layer = re.search(r"\.layers\.(\d+)\.", name)
        param.requires_grad = (
            bool(layer and int(layer.group(1)) in trainable) or name == "model.norm.weight"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    previous = copy.deepcopy(model) if args.lag else None

    servers = args.servers
    sampling_urls = [args.router] if args.router else servers
    sender = WeightSender(
        [Client(url, api_key=args.control_key or args.api_key) for url in servers]
    )
    sender.connect()
    logs: list[StepLog] = []
    try:
        t = time.perf_counter()
        sender.send(model, version="step-0")  # the servers start from the trainer's weights
        print(f"weights step-0 sent in {time.perf_counter() - t:.1f} s", flush=True)
        problems = [[make_problem(rng) for _ in range(args.prompts)] for _ in range(args.steps)]
        pending = asyncio.create_task(sample(sampling_urls, args.api_key, problems[0], args, 0))
        for step in range(args.steps):
            started = time.perf_counter()
            episodes = await pending
            seconds = {"sampling": time.perf_counter() - started}
            version = f"step-{step}"
            allowed = {version} | ({f"step-{step - 1}"} if args.lag and step else set())
            counts = check_versions(episodes, allowed)

            t = time.perf_counter()
            score(episodes, args.group)
            seconds["scoring"] = time.perf_counter() - t
            if args.lag and step + 1 < args.steps:
                # The next batch samples on the current weights while this one trains; the push
                # below pauses it (keep) and it goes on with the new weights.
                pending = asyncio.create_task(
                    sample(sampling_urls, args.api_key, problems[step + 1], args, step + 1)
                )
            t = time.perf_counter()
            if previous is not None:
                # Weights of this step's version, for the tokens the next step samples on them.
                keep = {k: v.clone() for k, v in model.state_dict().items()}
            mismatch, loss = await asyncio.to_thread(
                train_step, model, previous, optimizer, episodes, version, args.clip
            )
            seconds["training"] = time.perf_counter() - t
            t = time.perf_counter()
            await asyncio.to_thread(sender.send, model, version=f"step-{step + 1}")
            seconds["weight_sync"] = time.perf_counter() - t
            if previous is not None:
                previous.load_state_dict(keep)
            if not args.lag and step + 1 < args.steps:
                pending = asyncio.create_task(
                    sample(sampling_urls, args.api_key, problems[step + 1], args, step + 1)
                )
            seconds["step"] = time.perf_counter() - started
            rewards = [e.reward for e in episodes]
            log = StepLog(
                step=step,
                version=version,
                reward_mean=sum(rewards) / len(rewards),
                exact=sum(r == 1.0 for r in rewards) / len(rewards),
                trained_episodes=sum(e.advantage != 0.0 for e in episodes),
                loss=loss,
                mismatch={k: m.summary() for k, m in mismatch.items()},
                versions=counts,
                seconds={k: round(v, 3) for k, v in seconds.items()},
                sample_text=episodes[0].result.turns[-1].message.content or "",
            )
            logs.append(log)
            after = log.mismatch["after_update"]
            print(
                f"step {step:3d} reward {log.reward_mean:.3f} exact {log.exact:.2f} "
                f"max|d| {after['max_abs']:.2e} k3 {after['k3_kl']:.1e} "
                f"before-update tokens {log.mismatch['before_update']['tokens']} "
                f"{' '.join(f'{k} {v:.1f}s' for k, v in log.seconds.items())} "
                f"| {log.sample_text!r}",
                flush=True,
            )
            if args.log:
                write_log(args, logs)
    finally:
        sender.close()
    return logs


def write_log(args: argparse.Namespace, logs: list[StepLog]) -> None:
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "control_key")}
    Path(args.log).write_text(
        json.dumps({"config": config, "steps": [asdict(log) for log in logs]}, indent=1)
    )


def plot(logs: list[StepLog], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [log.step for log in logs]
    fig, (ax_reward, ax_mismatch, ax_time) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    ax_reward.plot(steps, [log.reward_mean for log in logs], marker="o", label="mean reward")
    ax_reward.plot(steps, [log.exact for log in logs], marker=".", label="exactly the number")
    ax_reward.set_ylabel("reward")
    ax_reward.legend()
    for key, style in (("after_update", "o-"), ("before_update", "x--")):
        points = [(log.step, log.mismatch[key]) for log in logs if log.mismatch[key]["tokens"]]
        if points:
            xs = [s for s, _ in points]
            ax_mismatch.semilogy(
                xs, [m["max_abs"] for _, m in points], style, label=f"max |Δ| {key}"
            )
            ax_mismatch.semilogy(
                xs, [m["mean_abs"] for _, m in points], style, alpha=0.5, label=f"mean |Δ| {key}"
            )
    ax_mismatch.axhline(1e-4, color="grey", lw=0.8, ls=":", label="1e-4")
    ax_mismatch.set_ylabel("trainer - sampler logprob")
    ax_mismatch.legend(fontsize=7)
    bottom = [0.0] * len(logs)
    for part in ("sampling", "scoring", "training", "weight_sync"):
        values = [log.seconds.get(part, 0.0) for log in logs]
        ax_time.bar(steps, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax_time.set_ylabel("seconds")
    ax_time.set_xlabel("step")
    ax_time.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=["http://127.0.0.1:8000"])
    parser.add_argument("--router", help="sample through this router (in front of --servers)")
    parser.add_argument("--api-key")
    parser.add_argument("--control-key", help="the servers' --control-api-key, if set")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="asset or directory")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=4, help="problems per step")
    parser.add_argument("--group", type=int, default=4, help="episodes per problem")
    parser.add_argument("--max-tokens", type=int, default=8, help="per turn")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--train-layers", type=int, default=12, help="top layers trained")
    parser.add_argument("--lag", type=int, choices=[0, 1], default=0, help="off-policy lag")
    parser.add_argument(
        "--seed", type=int, default=0, help="problems, torch and per-episode sampling seeds"
    )
    parser.add_argument("--no-sampling-seeds", dest="seed_sampling", action="store_false")
    parser.add_argument("--threads", type=int, default=1, help="the trainer's torch threads")
    parser.add_argument("--log", help="JSON log path")
    parser.add_argument("--plot", help="PNG path (needs matplotlib)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logs = asyncio.run(run(args))
    if args.plot:
        plot(logs, args.plot)
    first, last = logs[: min(5, len(logs))], logs[-min(5, len(logs)) :]
    print(
        f"reward: first {len(first)} steps {sum(s.reward_mean for s in first) / len(first):.3f}, "
        f"last {len(last)} {sum(s.reward_mean for s in last) / len(last):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
