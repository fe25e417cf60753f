"""LoRA adapters the server serves by name: loading, replacing and unloading them (vLLM's
``/v1/load_lora_adapter`` semantics), and which adapter a request's ``model`` names.

The engine holds the weights (``Engine.load_adapter``); this registry holds what clients see:
names, paths, parents, versions, and each adapter's config. Adapters come from a directory
(``lora_path``) or from a trainer's memory (``load_adapter_tensors``: SGLang's
``/load_lora_adapter_from_tensors``, and the weight-transfer routes with a ``lora_name``).
A request naming an adapter runs under the version loaded when it arrived, to its end, and
every token reports that version in ``weight_versions``.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenwire import adapter_files
from tokenwire.engine.base import AdapterTensors, EngineError
from tokenwire.pipeline.context import Adapter, Adapters, Pipeline
from tokenwire.pipeline.errors import InvalidRequest, NotFound

# What ``/v1/models`` and SGLang's ``loaded_adapters`` show as the path of an adapter sent from
# memory (SGLang's name for it).
MEMORY_ADAPTER_PATH = "__tensor__"


def _adapters(pipeline: Pipeline) -> Adapters:
    engine = pipeline.ready().engine
    if "lora" not in engine.features:
        raise InvalidRequest("LoRA is off: start the server with --enable-lora", "lora_name")
    return pipeline.adapters


def _checked_path(adapters: Adapters, lora_path: str) -> Path:
    """The adapter directory, resolved; under an allowed root when the operator named any."""
    try:
        path = Path(os.path.realpath(lora_path))
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"lora_path cannot be looked up: {exc}", "lora_path") from exc
    roots = adapters.allowed_roots
    if roots and not any(path.is_relative_to(root) for root in roots):
        raise InvalidRequest(
            f"lora_path {lora_path!r} is outside the directories --allowed-lora-paths names",
            "lora_path",
        )
    return path


async def load_adapter(
    pipeline: Pipeline,
    name: str,
    lora_path: str,
    *,
    load_inplace: bool = False,
    version: str | None = None,
) -> Adapter:
    """Load ``name`` (or replace it with ``load_inplace``); a misfit is a 400, nothing changes."""
    adapters = _adapters(pipeline)
    if not name or not lora_path:
        raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    _check_name(pipeline, name)
    path = _checked_path(adapters, lora_path)
    try:
        config = await asyncio.to_thread(adapter_files.read_config, path)
    except adapter_files.AdapterFileError as exc:
        raise InvalidRequest(f"LoRA adapter not loaded: {exc}", "lora_path") from exc
    async with adapters.lock:
        if name in adapters.loaded and not load_inplace:
            raise InvalidRequest(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "lora_name",
            )
        return await _install(pipeline, Adapter(name, lora_path, version or "", config), path)


async def load_adapter_tensors(
    pipeline: Pipeline,
    name: str,
    tensors: dict[str, Any],
    *,
    config: dict[str, Any] | None = None,
    version: str | None = None,
    param: str = "lora_name",
) -> Adapter:
    """Load ``name`` from a trainer's memory, or replace its factors (always in place: a
    trainer sends each step's); ``config`` defaults to the loaded adapter's."""
    adapters = _adapters(pipeline)
    _check_name(pipeline, name)
    async with adapters.lock:
        config = config_for(pipeline, name, config, param)
        adapter = Adapter(name, MEMORY_ADAPTER_PATH, version or "", config)
        return await _install(pipeline, adapter, AdapterTensors(config, tensors), param)


def config_for(
    pipeline: Pipeline, name: str, config: dict[str, Any] | None, param: str
) -> dict[str, Any]:
    """The adapter config an update of ``name`` uses: the one sent, or the loaded adapter's."""
    adapters = _adapters(pipeline)
    if config is not None:
        return config
    loaded = adapters.loaded.get(name)
    if loaded is None:
        raise InvalidRequest(
            f"LoRA adapter '{name}' is not loaded: send its adapter_config.json's fields "
            "(lora_config, or SGLang's config_dict) with its first factors",
            param,
        )
    return loaded.config


def _check_name(pipeline: Pipeline, name: str) -> None:
    if name in pipeline.config.model_names:
        raise InvalidRequest(
            f"The lora adapter '{name}' conflicts with a served base model.", "lora_name"
        )


async def _install(
    pipeline: Pipeline, adapter: Adapter, source: Path | AdapterTensors, param: str = "lora_path"
) -> Adapter:
    """Hand the adapter to the engine and record it (the caller holds ``adapters.lock``)."""
    adapters = pipeline.adapters
    adapters.loads += 1
    version = adapter.version or f"{adapter.name}@{adapters.loads}"
    try:
        await pipeline.ready().engine.load_adapter(adapter.name, source, version)
    except EngineError as exc:
        raise InvalidRequest(f"LoRA adapter not loaded: {exc}", param) from exc
    adapters.loaded[adapter.name] = replace(adapter, version=version)
    return adapters.loaded[adapter.name]


async def unload_adapter(pipeline: Pipeline, name: str) -> None:
    adapters = _adapters(pipeline)
    if not name:
        raise InvalidRequest(
            "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name"
        )
    async with adapters.lock:
        if name not in adapters.loaded:
            raise NotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")
        del adapters.loaded[name]
        await pipeline.ready().engine.unload_adapter(name)
