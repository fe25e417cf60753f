"""LoRA adapters in PEFT's format: read and checked, then served per row against PEFT itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokenwire.engine.base import WeightsError
from tokenwire.engine.hf.lora import CONFIG_FILE, WEIGHTS_FILE, AdapterSlots

pytestmark = pytest.mark.model
SMOLLM2 = Path.home() / ".cache/tokenwire/models/smollm2-135m-instruct"
TARGETS = (["q_proj", "v_proj"], ["q_proj", "k_proj", "o_proj"], ["gate_proj", "down_proj"])


def _base() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three PEFT adapters (random lora_B, so each changes the model), saved by PEFT."""
    from peft import LoraConfig, get_peft_model

    paths = []
    for i, targets in enumerate(TARGETS):
        torch.manual_seed(i)
        config = LoraConfig(
            r=4 + 4 * i,
            lora_alpha=16,
            target_modules=targets,
            init_lora_weights=False,
            use_rslora=i == 2,
        )
        peft_model = get_peft_model(_base(), config)
        path = tmp_path_factory.mktemp(f"adapter{i}")
        peft_model.save_pretrained(path)
        paths.append(path)
    return paths


def _peft_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel

    with torch.inference_mode():
        return PeftModel.from_pretrained(_base(), path).eval()(input_ids=ids).logits


def test_mixed_batch_matches_peft(adapters: list[Path]) -> None:
    """Base + three adapters in one forward: each row equals PEFT's forward of its adapter."""
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 28, 30]] * 4)
    model = _base()
    slots = AdapterSlots(model, max_loras=4, max_rank=16)
    for slot, path in enumerate(adapters, start=1):
        slots.put(slot, slots.read(path))
    slots.rows = torch.tensor([0, 1, 2, 3])
    with torch.inference_mode():
        served = model(input_ids=ids).logits
    # References in the same batch shape: CPU GEMMs of other shapes alone differ by ~1e-4.
    with torch.inference_mode():
        reference = [_base()(input_ids=ids).logits[0]]
    reference += [_peft_logits(p, ids)[row] for row, p in enumerate(adapters, start=1)]
    for row, expected in enumerate(reference):
        logprobs = torch.log_softmax(served[row], -1)
        assert (logprobs - torch.log_softmax(expected, -1)).abs().max() <= 1e-4
    assert (served[1] - served[0]).abs().max() > 1e-2  # the adapter changes the output

    slots.clear(2)
    with torch.inference_mode():
        cleared = model(input_ids=ids).logits
    assert torch.allclose(cleared[2], served[0], atol=1e-5)  # slot 2 serves the base again


def _write(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / CONFIG_FILE).write_text(json.dumps(config))
    save_file(tensors, path / WEIGHTS_FILE)
    return path


def test_bad_adapters_are_refused(tmp_path: Path, adapters: list[Path]) -> None:
    model = _base()
    slots = AdapterSlots(model, max_loras=2, max_rank=8)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    good = {f"{q}.lora_A.weight": torch.zeros(4, 576), f"{q}.lora_B.weight": torch.zeros(576, 4)}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    cases = {
        "missing": (tmp_path / "nowhere", "not a directory"),
        "rank": (adapters[2], "above --max-lora-rank 8"),
        "target": (
            _write(
                tmp_path / "target",
                config,
                {k.replace("q_proj", "rotary"): v for k, v in good.items()},
            ),
            "not a linear of the model",
        ),
        "shape": (
            _write(tmp_path / "shape", config, {**good, f"{q}.lora_A.weight": torch.zeros(4, 100)}),
            "has shape (4, 100)",
        ),
        "nan": (
            _write(
                tmp_path / "nan",
                config,
                {**good, f"{q}.lora_B.weight": torch.full((576, 4), float("nan"))},
            ),
            "NaN or infinite",
        ),
        "dora": (_write(tmp_path / "dora", {**config, "use_dora": True}, good), "use_dora"),
        "no_weights": (_write(tmp_path / "empty", config, {"x": torch.zeros(1)}), "lora_A"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(WeightsError, match=re.escape(message)):
            slots.read(path)
        assert slots.nbytes == 0, name  # nothing was installed
