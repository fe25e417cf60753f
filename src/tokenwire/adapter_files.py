"""PEFT's on-disk format for a LoRA adapter: a directory holding ``adapter_config.json`` and
``adapter_model.safetensors`` (what ``peft``'s ``save_pretrained`` writes).

Shared by the engines (the hf engine reads it; vLLM's engine is handed adapters sent from memory
as such a directory) and the pipeline (which keeps each adapter's config, so that a trainer can
send new factors alone).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterFileError(ValueError):
    """An adapter directory whose config cannot be read; the message says why."""


def read_config(path: Path) -> dict[str, Any]:
    """``adapter_config.json`` of the adapter directory ``path``, as a JSON object."""
    if not path.is_dir():
        raise AdapterFileError(f"{path} is not a directory")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError as exc:
        raise AdapterFileError(f"{path} has no {CONFIG_FILE}") from exc
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AdapterFileError(f"{CONFIG_FILE} cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterFileError(f"{CONFIG_FILE} must hold a JSON object")
    return config


def write(path: Path, config: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
    """An adapter held in memory as PEFT's directory at ``path`` (made if missing)."""
    from tokenwire.weight_transfer import safetensors_bytes

    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(dict(config)))
    (path / WEIGHTS_FILE).write_bytes(safetensors_bytes(tensors))
