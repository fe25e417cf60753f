"""The framework senders' server: one for every test here (``make test-frameworks``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RL_SERVER_ARGS, Server, _start, smollm2_float32

# AReaL's initial LoRA (``gconfig.lora_name`` "default_lora", version 0), which its trainer
# saves and starts vLLM with as ``--lora-modules default_lora-v0=PATH`` (lora_int_id 1).
AREAL_LORA = "default_lora-v0"


@pytest.fixture(scope="session")
def areal_initial_lora(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    """A fresh PEFT LoRA of SmolLM2 (lora_B zero, as PEFT initialises it), saved by PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    path = tmp_path_factory.mktemp("areal-lora") / "initial_lora"
    get_peft_model(smollm2_float32(smol_dir), config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def frameworks_server(
    tmp_path_factory: pytest.TempPathFactory, areal_initial_lora: Path
) -> Iterator[Server]:
    """``rl_server``'s flags without an API key (skyrl-train's and AReaL's remote engines send
    no Authorization header), and LoRA on with AReaL's initial adapter loaded at start."""
    lora = [
        *("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"),
        *("--lora-modules", f"{AREAL_LORA}={areal_initial_lora}"),
    ]
    yield from _start(tmp_path_factory, "frameworks", [*RL_SERVER_ARGS, *lora])
