"""The closed RL loop of ``examples/grpo.py`` against the shared RL server, under either engine:
two GRPO steps of SmolLM2 (two problems x two episodes, two turns with the calculator's result
between them), each followed by an in-memory weight push. The loop completes, every sampled id
carries the version of the step that sampled it, and the trainer's float32 forward of every
sampled id is within 1e-4 of the sampler's logprob at every step (the parity bound the engine
tests use). No assertion on the reward: learning is the example's business, not a smoke test's.
Leaves ``rl_server`` with the base weights."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from examples.grpo import StepLog, parse_args, run
from tests.conftest import API_KEY, SESSION_ENGINE, Server
from tokenwire.assets import prepare
from tokenwire.client import Client

PARITY = 1e-4  # trainer vs sampler logprob, per token, as in the engine parity tests
STEPS = 2  # each step's samples carry its own version: two show the update took


@pytest.fixture(scope="module")
def grpo_logs(rl_server: Server, tmp_path_factory: pytest.TempPathFactory) -> list[StepLog]:
    log = tmp_path_factory.mktemp("grpo") / "grpo.json"
    args = parse_args(
        [
            *("--servers", rl_server.url, "--api-key", API_KEY),
            *("--steps", str(STEPS), "--prompts", "2", "--group", "2", "--max-tokens", "4"),
            # A high rate and two layers: every step must change the weights the next samples.
            *("--lr", "1e-4", "--train-layers", "2", "--log", str(log)),
        ]
    )
    started = time.perf_counter()
    try:
        logs = asyncio.run(run(args))
    finally:
        with Client(rl_server.url, api_key=API_KEY) as client:
            client.control.update_weights(str(prepare("smollm2-135m-instruct")), "default")
    assert Path(log).is_file()
    seconds = time.perf_counter() - started
    # The mismatch per step, in the CI log (-s): vLLM's is the number to watch.
    print(f"grpo smoke on {SESSION_ENGINE['kind']}, {seconds:.1f} s:")
    for entry in logs:
        print(f"  step {entry.step}: {entry.mismatch['after_update']} {entry.seconds}")
    return logs


def test_every_step_samples_with_the_last_pushed_weights(grpo_logs: list[StepLog]) -> None:
    assert [entry.version for entry in grpo_logs] == [f"step-{i}" for i in range(STEPS)]
    for entry in grpo_logs:
        # staleness 0: every sampled id of step N came from the weights pushed as step-N
        assert list(entry.versions) == [entry.version]
        assert entry.versions[entry.version] == entry.mismatch["after_update"]["tokens"] > 0
        assert entry.mismatch["before_update"]["tokens"] == 0


def test_the_weights_change(grpo_logs: list[StepLog]) -> None:
    """Some group's rewards differ (seeded sampling: the same ones every run), so the pushes
    carry trained weights and the parity below is checked against them."""
    assert sum(entry.trained_episodes for entry in grpo_logs) > 0


def test_trainer_and_sampler_logprobs_agree_at_every_step(grpo_logs: list[StepLog]) -> None:
    for entry in grpo_logs:
        mismatch = entry.mismatch["after_update"]
        assert mismatch["max_abs"] <= PARITY, (entry.step, mismatch)
        assert 0 <= mismatch["k3_kl"] < PARITY**2, (entry.step, mismatch)
