"""PEFT's on-disk format for a LoRA adapter: a directory holding ``adapter_config.json`` and
``adapter_model.safetensors`` (what ``peft``'s ``save_pretrained`` writes).

Shared by the engines (the hf engine reads it; vLLM's engine is handed adapters sent from memory
as such a directory) and the pipeline (which keeps each adapter's config, so that a trainer can
send new factors alone).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT writes a few hundred bytes; more is not an adapter config.
MAX_CONFIG_BYTES = 2**20


class AdapterFileError(ValueError):
    """An adapter directory whose files cannot be read; the message says why, and never quotes
    the files' bytes."""


def read_config(path: Path, roots: tuple[Path, ...] = ()) -> dict[str, Any]:
    """``adapter_config.json`` of the adapter directory ``path``, as a JSON object with finite
    numbers (NaN or infinity would scale every factor to garbage). With ``roots``, the file
    must resolve to a path under one of them (``open_file``)."""
    with open_file(path, CONFIG_FILE, roots) as handle:
        raw = handle.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterFileError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw.decode(), parse_constant=_refuse_constant, parse_float=_finite)
    except json.JSONDecodeError as exc:
        raise AdapterFileError(
            f"{CONFIG_FILE} is not valid JSON (line {exc.lineno}, column {exc.colno})"
        ) from None
    except UnicodeDecodeError:
        raise AdapterFileError(f"{CONFIG_FILE} is not UTF-8 text") from None
    except RecursionError:
        raise AdapterFileError(f"{CONFIG_FILE} is nested too deeply") from None
    except ValueError as exc:  # a non-finite number, or an integer of thousands of digits
        raise AdapterFileError(f"{CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterFileError(f"{CONFIG_FILE} must hold a JSON object")
    return config


def read_weights(path: Path, roots: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The factors in ``adapter_model.safetensors`` of ``path``, read into memory while the
    file is open (a trainer rewriting the adapter it saves each step must not fault the
    server); a file that is not exactly what its header describes is refused unread."""
    from tokenwire.engine.base import WeightsError
    from tokenwire.engine.checkpoint import read_open_safetensors

    with open_file(path, WEIGHTS_FILE, roots) as handle:
        try:
            return read_open_safetensors(handle, WEIGHTS_FILE)
        except WeightsError as exc:
            raise AdapterFileError(str(exc)) from exc


def open_file(path: Path, name: str, roots: tuple[Path, ...] = ()) -> IO[bytes]:
    """The regular file ``name`` of the adapter directory ``path``, open for reading. With
    ``roots`` it is resolved first (symlinks followed) and must lie under one of them; the
    resolved path is opened without following a last symlink, so a link swapped in after the
    check is refused rather than followed."""
    if not os.path.isdir(path):
        raise AdapterFileError(f"{path} is not a directory")
    file = Path(os.path.realpath(path / name))
    if roots and not any(file.is_relative_to(root) for root in roots):
        raise AdapterFileError(
            f"{name} resolves outside the directories --allowed-lora-paths names"
        )
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(file, flags)
    except FileNotFoundError:
        raise AdapterFileError(f"the adapter directory has no {name}") from None
    except OSError as exc:  # a directory, a symlink swapped in, no permission, ...
        raise AdapterFileError(f"{name} cannot be opened: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device would block or never end
        os.close(fd)
        raise AdapterFileError(f"{name} is not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise ValueError("a number overflows to infinity")
    return value


def write(path: Path, config: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
    """An adapter held in memory as PEFT's directory at ``path`` (made if missing)."""
    from tokenwire.weight_transfer import safetensors_bytes

    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(dict(config)))
    (path / WEIGHTS_FILE).write_bytes(safetensors_bytes(tensors))
