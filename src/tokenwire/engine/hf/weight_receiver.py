"""The hf engine's end of a trainer's weight-transfer group (see ``tokenwire.weight_transfer``).

Joining and receiving run on worker threads (a rendezvous may wait for the trainer; generation
goes on meanwhile); the group is held by ``tokenwire.group_process`` in a child process, so a
broadcast gloo aborts on, or one NCCL's watchdog tears down, ends the child, not the server.
Each update call comes whole and checked into new tensors, which the engine then copies into
the model between two steps: a call that fails leaves the model as it was (``WeightsError``),
and the group is closed.
"""

from __future__ import annotations

import threading

import torch

from tokenwire.engine.base import (
    EngineError,
    WeightGroup,
    WeightsError,
    WeightTransferError,
    WeightUpdate,
)
from tokenwire.engine.hf.runner import ModelRunner
from tokenwire.group_process import Group, GroupLost, open_group
from tokenwire.weight_transfer import ReceivedTensorError


class WeightReceiver:
    """At most one group at a time; its calls come one after another (the pipeline's lock)."""

    def __init__(self, runner: ModelRunner, *, allow_nonfinite: bool) -> None:
        self._runner = runner
        self._allow_nonfinite = allow_nonfinite
        self._group: Group | None = None
        self._lock = threading.Lock()  # join against leave (the engine's shutdown)

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
                self._group = open_group(
                    self._runner.device,
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
            group.close()

    @property
    def joined(self) -> bool:
        return self._group is not None

    def receive(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """Every tensor of ``update``, checked, in tensors of the group's buffer (valid until
        the next call; the model is not touched).
        ``WeightsError`` when they did not come as announced, or the group broke; the group
        is then closed."""
        group = self._group
        if group is None:
            raise WeightsError("no weight-transfer group is open")
        try:
            return group.receive(
                update.tensors,
                packed=update.packed,
                buffer_size_bytes=update.buffer_size_bytes,
                allow_nonfinite=self._allow_nonfinite,
            )
        except (ReceivedTensorError, GroupLost) as exc:
            self.leave()
            raise WeightsError(str(exc)) from exc
