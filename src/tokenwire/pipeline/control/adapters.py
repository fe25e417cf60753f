"""The adapter registry: the only record of the LoRA adapters served by name, their versions,
and which requests hold each version (vLLM's ``/v1/load_lora_adapter`` semantics, SGLang's
``LoRARegistry`` shape).

Adapters come from a directory (``lora_path``) or from a trainer's memory (SGLang's
``/load_lora_adapter_from_tensors``, and the weight-transfer routes with a ``lora_name``). Each
load is a new ``AdapterVersion``; a request acquires the version current when it starts and
releases it when it ends, and every token it samples reports that version. A version that a
newer load replaced (or an unload removed) leaves the engine when its last request ends.
``--max-loras`` counts the versions engines hold, here and nowhere else: engines get resolved
versions and keep one spare slot for the version a load replaces.

Each adapter name also has vLLM's LoRA int id (``lora_int_id``): numbered from 1 in the order
names are first loaded, kept by in-place loads, as vLLM's ``OpenAIServingModels`` numbers them
(``--lora-modules`` first). AReaL's weight update names the adapter it replaces by that id and
serves it under a new name (``replace_by_id``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tokenwire import adapter_files
from tokenwire.engine.base import AdapterTensors, AdapterVersion, Engine, EngineError
from tokenwire.pipeline.errors import InvalidRequest, NotFound

logger = logging.getLogger(__name__)

# What ``/v1/models`` and SGLang's ``loaded_adapters`` show as the path of an adapter sent from
# memory (SGLang's name for it).
MEMORY_ADAPTER_PATH = "__tensor__"


@dataclass(frozen=True, slots=True)
class Adapter:
    """A loaded LoRA adapter as clients see it, and the ``adapter_config.json`` it loaded with
    (new factors sent alone reuse it)."""

    name: str
    path: str  # its directory, or ``MEMORY_ADAPTER_PATH``
    config: dict[str, Any]
    current: AdapterVersion  # what new requests get
    int_id: int  # vLLM's lora_int_id: one per name, kept by in-place loads

    @property
    def version(self) -> str:
        return self.current.version


class AdapterRegistry:
    """Loaded adapters by name and the versions engines hold; ``lock`` orders loads and
    unloads. Acquire and release are synchronous (requests start and end on the event loop)."""

    def __init__(
        self,
        engine: Callable[[], Engine],
        *,
        max_loras: int,
        base_model_names: tuple[str, ...],
        allowed_roots: tuple[Path, ...] = (),
    ) -> None:
        self._engine = engine
        self.max_loras = max_loras  # 0: LoRA is off
        self._base_names = base_model_names
        self.allowed_roots = allowed_roots  # empty: any path the server can read
        self._loaded: dict[str, Adapter] = {}
        # Versions the engine holds: requests holding each, and whether a newer load or an
        # unload retired it (it leaves the engine once nothing holds it).
        self._holders: dict[AdapterVersion, int] = {}
        self._retired: set[AdapterVersion] = set()
        self._loads = 0  # numbers load ids, and the versions of loads that name none
        self._int_ids = 0  # numbers adapter names as vLLM's lora_id_counter does
        self._lock = asyncio.Lock()
        self._evictions: set[asyncio.Task[None]] = set()

    # -- what clients read --------------------------------------------------------------------

    @property
    def loaded(self) -> Mapping[str, Adapter]:
        return MappingProxyType(self._loaded)

    def name_of(self, model: str | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return model if model and model in self._loaded else None

    def check_from_memory(self, name: str) -> None:
        """SkyRL's in-memory load: a 400 unless ``name`` is loaded from a trainer's memory (the
        weight update armed with its receive target loaded it at finish)."""
        self._require_on()
        adapter = self._loaded.get(name)
        if adapter is None or adapter.path != MEMORY_ADAPTER_PATH:
            raise InvalidRequest(
                f"in_memory: no LoRA adapter {name!r} came from a weight update; arm "
                "skyrl_set_lora_receive_target (/collective_rpc) before sending its factors",
                "in_memory",
            )

    @property
    def resident(self) -> int:
        """Adapter versions the engine holds now."""
        return len(self._holders)

    # -- requests -----------------------------------------------------------------------------

    def acquire(self, name: str, param: str = "model") -> AdapterVersion:
        """The current version of ``name``, held until ``release``."""
        adapter = self._loaded.get(name)
        if adapter is None:
            raise InvalidRequest(f"{param}: no LoRA adapter {name!r} is loaded", param)
        self._holders[adapter.current] += 1
        return adapter.current

    def release(self, version: AdapterVersion) -> None:
        self._holders[version] -= 1
        if not self._holders[version] and version in self._retired:
            task = asyncio.create_task(self._evict(version))
            self._evictions.add(task)
            task.add_done_callback(self._evictions.discard)

    # -- loads and unloads --------------------------------------------------------------------

    async def load_path(
        self, name: str, lora_path: str, *, load_inplace: bool = False, version: str | None = None
    ) -> Adapter:
        """Load ``name`` from its directory (or replace it with ``load_inplace``); a misfit is a
        400 and nothing changes."""
        self._require_on()
        if not name or not lora_path:
            raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        self._check_name(name)
        path = self._checked_path(lora_path)
        roots = self.allowed_roots
        try:
            config = await asyncio.to_thread(adapter_files.read_config, path, roots)
            async with self._lock:
                if name in self._loaded and not load_inplace:
                    raise InvalidRequest(
                        f"The lora adapter '{name}' has already been loaded. If you want to "
                        "load the adapter in place, set 'load_inplace' to True.",
                        "lora_name",
                    )
                # Read here, not by the engine: every file a load opens is checked against
                # the roots, and one load at a time holds an adapter's bytes.
                tensors = await asyncio.to_thread(adapter_files.read_weights, path, roots)
                source = AdapterTensors(config, tensors)
                return await self._install(name, lora_path, config, source, version, "lora_path")
        except adapter_files.AdapterFileError as exc:
            raise InvalidRequest(f"LoRA adapter not loaded: {exc}", "lora_path") from exc

    async def load_tensors(
        self,
        name: str,
        tensors: Mapping[str, Any],
        *,
        config: dict[str, Any] | None = None,
        version: str | None = None,
        param: str = "lora_name",
    ) -> Adapter:
        """Load ``name`` from a trainer's memory, or replace its factors (always in place: a
        trainer sends each step's); ``config`` defaults to the loaded adapter's."""
        self._require_on()
        self._check_name(name)
        async with self._lock:
            config = self.config_for(name, config, param)
            source = AdapterTensors(config, tensors)
            return await self._install(name, MEMORY_ADAPTER_PATH, config, source, version, param)

    async def replace_by_id(
        self,
        int_id: int,
        name: str,
        tensors: Mapping[str, Any],
        *,
        config: dict[str, Any],
        version: str | None = None,
        param: str = "lora_int_id",
    ) -> Adapter:
        """AReaL's LoRA update: the adapter with vLLM's id ``int_id`` gets new factors and is
        served as ``name`` from now on (its old name, if another, is gone; requests under the
        old version finish under it), keeping the id. A 400 and nothing changes when no
        adapter has the id or ``name`` is another adapter's."""
        async with self._lock:
            replaced = self.check_replacement(int_id, name)
            source = AdapterTensors(config, tensors)
            return await self._install(
                name, MEMORY_ADAPTER_PATH, config, source, version, param, replaced=replaced
            )

    def check_replacement(self, int_id: int, name: str) -> Adapter:
        """The adapter ``replace_by_id`` would replace; a 400 unless one has vLLM's id
        ``int_id`` and ``name`` may name it (no base model's, no other adapter's)."""
        self._require_on()
        self._check_name(name)
        replaced = self.by_id(int_id)
        clash = self._loaded.get(name)
        if clash is not None and clash is not replaced:
            raise InvalidRequest(
                f"lora_name: {name!r} is another LoRA adapter (lora_int_id {clash.int_id}), "
                f"not {int_id}'s",
                "lora_name",
            )
        return replaced

    def by_id(self, int_id: int, param: str = "lora_int_id") -> Adapter:
        """The adapter with vLLM's ``lora_int_id``; a 400 (vLLM's words) when none has it."""
        self._require_on()
        for adapter in self._loaded.values():
            if adapter.int_id == int_id:
                return adapter
        available = sorted(a.int_id for a in self._loaded.values())
        raise InvalidRequest(f"LoRA adapter {int_id} not found. Available: {available}", param)

    async def unload(self, name: str) -> None:
        self._require_on()
        if not name:
            raise InvalidRequest(
                "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name"
            )
        async with self._lock:
            adapter = self._loaded.pop(name, None)
            if adapter is None:
                raise NotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")
            await self._retire(adapter.current)

    def config_for(self, name: str, config: dict[str, Any] | None, param: str) -> dict[str, Any]:
        """The adapter config an update of ``name`` uses: the one sent, or the loaded one's."""
        self._require_on()
        if config is not None:
            return config
        loaded = self._loaded.get(name)
        if loaded is None:
            raise InvalidRequest(
                f"LoRA adapter '{name}' is not loaded: send its adapter_config.json's fields "
                "(lora_config, or SGLang's config_dict) with its first factors",
                param,
            )
        return loaded.config

    def check_name(self, name: str) -> None:
        """A 400 unless LoRA is on and ``name`` may name an adapter."""
        self._require_on()
        self._check_name(name)

    # -- internals ----------------------------------------------------------------------------

    def _require_on(self) -> None:
        if not self.max_loras:
            raise InvalidRequest("LoRA is off: start the server with --enable-lora", "lora_name")

    def _check_name(self, name: str) -> None:
        if name in self._base_names:
            raise InvalidRequest(
                f"The lora adapter '{name}' conflicts with a served base model.", "lora_name"
            )

    def _checked_path(self, lora_path: str) -> Path:
        """The adapter directory, resolved; under an allowed root when the operator named any
        (the files in it are checked again as they are opened: a symlink may lead out)."""
        try:
            path = Path(os.path.realpath(lora_path))
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"lora_path cannot be looked up: {exc}", "lora_path") from exc
        roots = self.allowed_roots
        if roots and not any(path.is_relative_to(root) for root in roots):
            raise InvalidRequest(
                f"lora_path {lora_path!r} is outside the directories --allowed-lora-paths names",
                "lora_path",
            )
        return path

    async def _install(
        self,
        name: str,
        path: str,
        config: dict[str, Any],
        source: AdapterTensors,
        version: str | None,
        param: str,
        *,
        replaced: Adapter | None = None,
    ) -> Adapter:
        """Hand a new version to the engine, then make it current (the caller holds the lock).
        The version it replaces (``name``'s, or ``replaced``'s, which then leaves its name)
        counts as free unless requests hold it: it leaves at once."""
        replaced = replaced or self._loaded.get(name)
        current = None if replaced is None else replaced.current
        in_use = [v for v, holders in self._holders.items() if v is not current or holders]
        if len(in_use) >= self.max_loras:
            raise InvalidRequest(
                f"LoRA adapter not loaded: all {self.max_loras} --max-loras slots hold adapter "
                "versions in use; unload one, wait for requests of replaced versions to finish, "
                "or raise --max-loras",
                param,
            )
        self._loads += 1
        new = AdapterVersion(name, version or f"{name}@{self._loads}", self._loads)
        try:
            await self._engine().load_adapter(new, source)
        except EngineError as exc:
            raise InvalidRequest(f"LoRA adapter not loaded: {exc}", param) from exc
        self._holders[new] = 0
        if replaced is None:
            self._int_ids += 1
            int_id = self._int_ids
        else:
            int_id = replaced.int_id
            if replaced.name != name:  # a rename: the old name is gone
                del self._loaded[replaced.name]
        self._loaded[name] = Adapter(name, path, config, new, int_id)
        if replaced is not None:
            await self._retire(replaced.current)
        return self._loaded[name]

    async def _retire(self, version: AdapterVersion) -> None:
        """No new request gets ``version``; it leaves the engine once nothing holds it."""
        self._retired.add(version)
        if not self._holders[version]:
            await self._remove(version)

    async def _evict(self, version: AdapterVersion) -> None:
        async with self._lock:
            if version in self._holders and not self._holders[version]:
                await self._remove(version)

    async def _remove(self, version: AdapterVersion) -> None:
        del self._holders[version]
        self._retired.discard(version)
        try:
            await self._engine().unload_adapter(version)
        except Exception:  # a stopped engine holds nothing; no request is affected
            logger.warning("the engine did not unload %s", version, exc_info=True)
