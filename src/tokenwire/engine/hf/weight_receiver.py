"""The hf engine's end of a trainer's weight-transfer group (see ``tokenwire.weight_transfer``).

Joining runs on a worker thread (a rendezvous may wait for the trainer; generation goes on
meanwhile); receiving runs on the engine thread between steps, copying each tensor into the
model as it arrives, so no second copy of the model is held. A broadcast that breaks off
leaves the group unusable: it is destroyed and ``WeightTransferError`` says why.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from tokenwire.engine.base import EngineError, WeightGroup, WeightTransferError, WeightUpdate
from tokenwire.engine.hf.runner import ModelRunner
from tokenwire.weight_transfer import TensorMeta, join_group, leave_group, receive


class WeightReceiver:
    """At most one group at a time; its calls come one after another (the pipeline's lock)."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self._group: Any = None
        self._lock = threading.Lock()  # join (worker thread) against receive (engine thread)

    def backends(self) -> tuple[str, ...]:
        """gloo moves CPU tensors; nccl only CUDA ones."""
        return ("gloo", "nccl") if self._runner.device.type == "cuda" else ("gloo",)

    def join(self, spec: WeightGroup) -> None:
        if spec.backend not in self.backends():
            raise EngineError(
                f"backend {spec.backend!r} cannot move this engine's weights (on "
                f"{self._runner.device.type}); backends that can: {', '.join(self.backends())}"
            )
        with self._lock:
            if self._group is not None:
                raise EngineError("a weight-transfer group is already open")
            try:
                self._group = join_group(
                    master_address=spec.master_address,
                    master_port=spec.master_port,
                    rank=spec.rank,
                    world_size=spec.world_size,
                    backend=spec.backend,
                    group_name=spec.group_name,
                    timeout_s=spec.timeout_s,
                )
            except Exception as exc:  # refused, timed out, a rank missing
                raise WeightTransferError(f"could not join the trainer's group: {exc}") from exc

    def leave(self) -> None:
        with self._lock:
            group, self._group = self._group, None
        if group is not None:
            leave_group(group)

    @property
    def joined(self) -> bool:
        return self._group is not None

    def receive(self, update: WeightUpdate) -> None:
        """On the engine thread: every tensor of ``update``, copied into the model."""

        def weight_of(meta: TensorMeta) -> torch.Tensor | None:
            weight = self._runner.weights[meta.name].detach()
            return weight if weight.dtype == meta.dtype and weight.is_contiguous() else None

        self._receive(update, self._runner.copy_weight, weight_of)

    def receive_tensors(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """Every tensor of ``update`` into new tensors (an adapter's factors; any thread: the
        model is not touched)."""
        received: dict[str, torch.Tensor] = {}
        self._receive(update, received.__setitem__, None)
        return received

    def _receive(
        self,
        update: WeightUpdate,
        take: Callable[[str, torch.Tensor], None],
        target: Callable[[TensorMeta], torch.Tensor | None] | None,
    ) -> None:
        group = self._open_group()
        try:
            receive(
                update.tensors,
                group,
                self._runner.device,
                take,
                packed=update.packed,
                buffer_size_bytes=update.buffer_size_bytes,
                target=target,
            )
        except Exception as exc:
            self.leave()
            raise WeightTransferError(f"the weight broadcast broke off: {exc}") from exc

    def _open_group(self) -> Any:
        group = self._group
        if group is None:
            raise WeightTransferError("no weight-transfer group is open")
        return group
