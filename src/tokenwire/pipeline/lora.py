"""LoRA adapters the server serves by name: loading, replacing and unloading them (vLLM's
``/v1/load_lora_adapter`` semantics), and which adapter a request's ``model`` names.

The engine holds the weights (``Engine.load_adapter``); this registry holds what clients see:
names, paths, parents and versions. A request naming an adapter runs under the version loaded
when it arrived, to its end, and every token reports that version in ``weight_versions``.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenwire.engine.base import EngineError
from tokenwire.pipeline.context import Adapter, Adapters, Pipeline
from tokenwire.pipeline.errors import InvalidRequest, NotFound


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
    if name in pipeline.config.model_names:
        raise InvalidRequest(
            f"The lora adapter '{name}' conflicts with a served base model.", "lora_name"
        )
    path = _checked_path(adapters, lora_path)
    async with adapters.lock:
        if name in adapters.loaded and not load_inplace:
            raise InvalidRequest(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "lora_name",
            )
        adapters.loads += 1
        version = version or f"{name}@{adapters.loads}"
        try:
            await pipeline.ready().engine.load_adapter(name, path, version)
        except EngineError as exc:
            raise InvalidRequest(f"LoRA adapter not loaded: {exc}", "lora_path") from exc
        adapter = adapters.loaded[name] = Adapter(name, lora_path, version)
        return adapter


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
