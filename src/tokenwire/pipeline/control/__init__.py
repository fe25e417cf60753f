"""The RL control plane: what a training loop changes between steps, one owner per state.

- ``gate.Gate``: may a request start now (paused, sleeping, SGLang-held, draining);
- ``weights.WeightLifecycle``: the served weights whole, updating or broken, and every
  transition of them (checkpoint reloads, transfers, tensor updates) under one lock;
- ``transfer.WeightTransfer``: the trainer's group and the protocols that drive the lifecycle
  (vLLM's four phases, SGLang's one-call forms);
- ``adapters.AdapterRegistry``: the LoRA adapters, their versions and who holds them.

``ControlPlane`` composes them: ``admit`` is the one admission check of every generating
route, and the calls that span two owners (a resume must end an update nobody finished) live
here. Callers ask these objects; none of their state is written from outside them.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from tokenwire.engine.base import AdapterVersion, Engine
from tokenwire.pipeline.control.adapters import AdapterRegistry
from tokenwire.pipeline.control.gate import VLLM_MEMORY_TAGS, Gate
from tokenwire.pipeline.control.trainer_address import TrainerAddressPolicy
from tokenwire.pipeline.control.transfer import WeightTransfer
from tokenwire.pipeline.control.weights import WeightLifecycle
from tokenwire.pipeline.errors import InvalidRequest, NotReady
from tokenwire.pipeline.jobs import JobRegistry
from tokenwire.protocol.control import TransferUpdateInfo, UpdateWeightsFromDistributedBody
from tokenwire.weight_transfer import WeightTransferConfig

_FLUSH_RETRY_S = 0.05  # between two tries of a flush that waits for the engine


class ControlPlane:
    """The gate, the weights, the transfer and the adapters of one server."""

    def __init__(
        self,
        engine: Callable[[], Engine],
        jobs: JobRegistry,
        *,
        weight_transfer: WeightTransferConfig | None,
        trainer_addresses: TrainerAddressPolicy,
        max_held_requests: int,
        max_loras: int,
        base_model_names: tuple[str, ...],
        allowed_lora_roots: tuple[Path, ...] = (),
    ) -> None:
        self._engine = engine
        self._jobs = jobs
        self.gate = Gate(engine, max_held_requests=max_held_requests)
        self.adapters = AdapterRegistry(
            engine,
            max_loras=max_loras,
            base_model_names=base_model_names,
            allowed_roots=allowed_lora_roots,
        )
        # An open update is abandoned once the transfer's own timeout passed with no call.
        deadline_s = (weight_transfer or WeightTransferConfig()).timeout_s
        self.weights = WeightLifecycle(engine, self.gate, deadline_s=deadline_s)
        self.transfer = WeightTransfer(
            weight_transfer, trainer_addresses, engine, self.weights, self.adapters, self.abort
        )

    # -- admission ----------------------------------------------------------------------------

    def admit(self) -> None:
        """Refuse a new request (503 saying why) unless it may start now: the server is up,
        the weights are whole, nothing sleeps, no pause refuses it. Under SGLang's pause, one
        that got past ``gate.wait_while_held`` queues in the paused engine."""
        self._engine()
        refusal = self.gate.refusal() or self.weights.refusal()
        if refusal is not None:
            raise NotReady(refusal)

    def admit_job(self, adapter: str | None, adapter_param: str = "model") -> AdapterVersion | None:
        """``admit`` a job, then hold the current version of the LoRA adapter it names
        (``adapter_param`` names the field; None: the base model) until ``adapters.release``:
        the one admission of every job, in one process or in the core of several."""
        self.admit()
        return None if adapter is None else self.adapters.acquire(adapter, adapter_param)

    # -- calls that span owners ---------------------------------------------------------------

    async def resume(self) -> None:
        """Resume. An update that is open ends first: nothing of it reached the model (else the
        answer says what completes the weights), so its trainer is taken as gone."""
        async with self.weights.locked():
            if self.weights.update is not None and not self.weights.update.received:
                await self.weights.abandon("resumed before the update finished")
            if self.weights.broken is not None:
                raise InvalidRequest(
                    f"not resumed: the weights are not whole ({self.weights.broken}); send a "
                    "complete weight update or reload a checkpoint first"
                )
            if self.weights.update is not None:
                raise InvalidRequest(
                    "not resumed: a weight update is in progress and some of its tensors are "
                    "in; /finish_weight_update first"
                )
            await self.gate.lift()

    async def sleep(
        self, level: int, *, mode: str = "abort", tags: Collection[str] = VLLM_MEMORY_TAGS
    ) -> None:
        await self.gate.sleep(level, mode=mode, tags=tags)

    async def wake_up(self, tags: Collection[str] | None = None) -> None:
        """Wake ``tags`` (None: all); once none sleeps, resume."""
        if self.gate.wake(tags):
            await self.resume()

    async def reload(
        self, weight_dir: str, version: str | None, *, abort_all_requests: bool = False
    ) -> str:
        """Swap in a checkpoint directory between engine steps; return its version."""
        self._engine()
        path = _checkpoint_path(weight_dir)  # before anything is aborted
        if abort_all_requests:
            await self.abort()
        async with self.weights.locked():
            return await self.weights.reload(path, version)

    async def update_weights(
        self,
        weight_dir: str | None,
        version: str | None,
        update_info: TransferUpdateInfo | list[TransferUpdateInfo] | None,
        named: UpdateWeightsFromDistributedBody | None = None,
    ) -> str | None:
        """``/update_weights``: prime-rl's form loads ``weight_dir`` (returns its version);
        vLLM's receives ``update_info`` over the group, skyrl-train's (``named``) receives and
        loads its tensors at once, as SGLang's ``/update_weights_from_distributed`` (both
        return None)."""
        forms = [
            name
            for name, given in (
                ("weight_dir", weight_dir),
                ("update_info", update_info),
                ("names", named),
            )
            if given is not None
        ]
        if len(forms) > 1:
            raise InvalidRequest(
                f"{forms[-1]}: send one of weight_dir (prime-rl's form), update_info (vLLM's) "
                f"or names/dtypes/shapes (skyrl-train's), not {' and '.join(forms)}",
                forms[-1],
            )
        if update_info is not None:
            await self.transfer.update(update_info)
            return None
        if named is not None:
            await self.transfer.update_from_distributed(named)
            return None
        if weight_dir is None:
            raise InvalidRequest(
                'weight_dir: Field required: /update_weights takes prime-rl\'s {"weight_dir": '
                '..., "weight_version"?} (a checkpoint directory), vLLM\'s {"update_info": '
                '...} (after POST /init_weight_transfer_engine) or skyrl-train\'s {"names", '
                '"dtypes", "shapes"} (after POST /init_weight_update_communicator)',
                "weight_dir",
            )
        return await self.reload(weight_dir, version)

    async def set_weight_version(self, version: str, *, abort_all_requests: bool = False) -> None:
        self._engine()
        if abort_all_requests:
            await self.abort()
        async with self.weights.locked():
            await self.weights.set_version(version)

    async def abort(self, request_ids: list[str] | None = None) -> int:
        """Abort running requests by id (None or empty: all); return how many were running.
        Aborted requests end with ``finish_reason: "abort"`` and keep the tokens made so far."""
        self._engine()
        return len(await self._jobs.abort(request_ids or self._jobs.ids()))

    async def flush_cache(self, timeout_s: float = 0.0) -> bool:
        """SGLang's flush: reset the prefix cache, retrying for up to ``timeout_s`` while an
        engine refuses (vLLM's does while running requests hold cached blocks)."""
        engine = self._engine()
        deadline = time.monotonic() + timeout_s
        while not await engine.reset_prefix_cache():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_FLUSH_RETRY_S)
        return True

    # -- read-only answers --------------------------------------------------------------------

    def load(self) -> int:
        """Requests running or waiting in the engine: what routers balance on."""
        stats = self._engine().stats()
        return stats.running + stats.waiting

    def num_paused_requests(self) -> int:
        return self.load() if self.gate.paused else 0

    @property
    def weight_version(self) -> str:
        return self._engine().weight_version

    def weight_info(self) -> dict[str, Any]:
        """``/weight_info``: the version, and the weights' state (tokenwire's fields)."""
        return {
            "weight_version": self.weight_version,
            "state": self.weights.state,
            "reason": self.weights.broken,
        }

    def close(self) -> None:
        """The server is shutting down: refuse what has not started, stop the deadlines."""
        self.gate.drain()
        self.weights.close()


def _checkpoint_path(weight_dir: str) -> Path:
    """The path of a checkpoint directory; a 400 when the OS cannot even look it up (a
    component over 255 bytes, say) rather than the engine's OSError."""
    path = Path(weight_dir)
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass  # the engine says what is missing
    except OSError as exc:
        raise InvalidRequest(
            f"weights not loaded: {weight_dir!r} cannot be looked up: {exc.strerror}",
            "weight_dir",
        ) from exc
    return path
