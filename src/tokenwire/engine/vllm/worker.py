"""Methods tokenwire adds to each vLLM worker (vLLM's ``--worker-extension-cls``).

This module is imported inside vLLM's worker processes, which have tokenwire installed beside
vLLM; ``collective_rpc("tokenwire_reload_weights", ...)`` calls the method on every worker.

Weights from a trainer's group (``tokenwire.weight_transfer``) come in here too: the group is
held by ``tokenwire.group_process`` (gloo: in a child process of this worker, so a broadcast
longer than announced, which gloo answers with ``std::terminate``, ends that child and not
vLLM's engine); each update's tensors are received whole first, so a broadcast that breaks off
leaves the model as it was, and only then loaded through vLLM's in-place reload (which repacks
them for its kernels).
vLLM fuses some checkpoint tensors into one layer (q/k/v into ``qkv_proj``) and its reload
rebuilds a layer from what it is given, so a layer loads only once all of its tensors came (in
this update or an earlier one); until then they wait here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

WORKER_EXTENSION = "tokenwire.engine.vllm.worker.TokenwireWorkerExtension"
# vLLM's reload warns about every layer a partial load leaves alone (one line each).
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload"


class TokenwireWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``...)."""

    model_runner: Any
    device: Any
    _tokenwire_group: Any = None  # the trainer's process group, once joined
    _tokenwire_layer_of: dict[str, str] | None = None  # checkpoint name -> vLLM layer
    _tokenwire_staged: dict[str, Any] | None = None  # received, waiting for their layer

    def tokenwire_reload_weights(self, weights_path: str, allow_nonfinite: bool) -> dict[str, Any]:
        """A checkpoint directory, one file at a time: each read into memory the tensors own
        (``engine.checkpoint``: a file a trainer rewrites under the reader is an error, where
        vLLM's mapped read faulted and killed the engine), then loaded as received tensors
        are (``_tokenwire_load``). Tensors still waiting for their layer are dropped: the
        checkpoint replaces them. Returns ``error`` (None when every layer loaded) and
        ``partial``: whether layers had loaded before the error."""
        from pathlib import Path

        from tokenwire.engine.base import WeightsError
        from tokenwire.engine.checkpoint import checkpoint_files, read_checkpoint_file

        self._tokenwire_staged = {}
        layers = self._tokenwire_layer_of or {}
        loaded, waiting = 0, []
        try:
            for file in checkpoint_files(Path(weights_path)):
                tensors = read_checkpoint_file(file, allow_nonfinite=allow_nonfinite)
                unknown = sorted(set(tensors) - set(layers))
                if unknown:  # rewritten since the engine checked its names
                    raise WeightsError(f"{file.name} changed: {unknown[0]} is not the model's")
                before = len(self._tokenwire_staged or {})
                waiting = self._tokenwire_load(tensors.items())
                loaded += before + len(tensors) - len(waiting)
        except WeightsError as exc:
            self._tokenwire_staged = {}
            return {"error": str(exc), "partial": loaded > 0}
        if waiting:  # the files' names changed since the engine checked them
            self._tokenwire_staged = {}
            return {"error": f"{len(waiting)} tensors came without their layer", "partial": True}
        return {"error": None, "partial": False}

    def _repack_tied_head(self) -> None:
        """On CPU vLLM packs each linear weight for its GEMM kernels once, after loading. A tied
        ``lm_head`` shares the embedding's weight but loads nothing of its own, so a reload
        leaves its packed copy holding the OLD embedding: logprobs then drift by ~2e-2 from a
        forward with the new weights. Packing it again restores parity (~6e-6 measured)."""
        from vllm.platforms import current_platform

        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = head is not None and embed is not None and head.weight is embed.weight
        if tied and current_platform.is_cpu():
            head.quant_method.process_weights_after_loading(head)

    def tokenwire_weight_layers(self, names: Sequence[str]) -> dict[str, Any]:
        """Remember which vLLM layer each checkpoint tensor loads into. Returns the device type
        and, for a tied output layer, ``lm_head.weight``'s twin (trainers may send it: vLLM's
        loaders skip it).

        The layer is the deepest module of the model on the tensor's path, after vLLM's own
        renaming of fused parts (``packed_modules_mapping``); a path the model does not have
        ends at the root, so such tensors load together with every other one."""
        model = self.model_runner.get_model()
        fused = getattr(model, "packed_modules_mapping", {}) or {}
        renamed = {part: whole for whole, parts in fused.items() for part in parts}
        modules = dict(model.named_modules())
        layers = {}
        for name in names:
            path = name.split(".")[:-1]
            if path and path[-1] in renamed:
                path[-1] = renamed[path[-1]]
            while path and ".".join(path) not in modules:
                path.pop()
            layers[name] = ".".join(path)
        twin = None
        head = getattr(model, "lm_head", None)
        if head is not None and "lm_head.weight" not in layers:
            twin = next(
                (
                    f"{path}.weight"
                    for path, module in modules.items()
                    if module is not head
                    and getattr(module, "weight", None) is head.weight
                    and f"{path}.weight" in layers
                ),
                None,
            )
            if twin is not None:
                layers["lm_head.weight"] = "lm_head"
        self._tokenwire_layer_of = layers
        self._tokenwire_staged = {}
        return {"device": str(self.device.type), "tied_head": twin}

    def tokenwire_join_group(self, spec: dict[str, Any]) -> str | None:
        """Join the trainer's group: ``spec`` is ``join_group``'s keywords (a ``WeightGroup``).
        Returns why it did not form (None: it did), in ``join_group``'s words only: vLLM's RPC
        error would carry this process's details to the client."""
        from tokenwire.group_process import open_group
        from tokenwire.weight_transfer import GroupJoinError

        if self._tokenwire_group is not None:
            return "a weight-transfer group is already open"
        try:
            self._tokenwire_group = open_group(self.device, **spec)
        except GroupJoinError as exc:
            return str(exc)
        return None

    def tokenwire_leave_group(self) -> None:
        """Leave the group; tensors received over it and still waiting are dropped."""
        group, self._tokenwire_group = self._tokenwire_group, None
        self._tokenwire_staged = {}
        if group is not None:
            group.close()

    def tokenwire_receive_weights(
        self,
        tensors: Sequence[tuple[str, str, list[int]]],
        packed: bool,
        buffer_size_bytes: int,
        allow_nonfinite: bool,
    ) -> dict[str, Any]:
        """Receive one update (names checked by the engine), then load every layer whose
        tensors all came: ``{"refused": None, "result": the names still waiting for the rest of
        their layer}``, or ``{"refused": why}`` when the call came other than announced (nothing
        of it loaded; the group is left)."""
        return self._tokenwire_answer(
            tensors,
            packed,
            buffer_size_bytes,
            allow_nonfinite,
            lambda r: self._tokenwire_load(r.items(), borrowed=True),
        )

    def tokenwire_receive_tensors(
        self,
        tensors: Sequence[tuple[str, str, list[int]]],
        packed: bool,
        buffer_size_bytes: int,
        allow_nonfinite: bool,
    ) -> dict[str, Any]:
        """Receive one update that is not the model's (a LoRA adapter's factors: the engine
        loads them as an adapter) and hand it back as one safetensors file, in
        ``tokenwire_receive_weights``' answer."""
        from tokenwire.weight_transfer import safetensors_bytes

        return self._tokenwire_answer(
            tensors, packed, buffer_size_bytes, allow_nonfinite, safetensors_bytes
        )

    def _tokenwire_answer(
        self,
        tensors: Sequence[tuple[str, str, list[int]]],
        packed: bool,
        buffer_size_bytes: int,
        allow_nonfinite: bool,
        then: Callable[[dict[str, Any]], Any],
    ) -> dict[str, Any]:
        """Receive one call, and answer ``then`` of what came, or why it was refused."""
        try:
            received = self._tokenwire_receive(tensors, packed, buffer_size_bytes, allow_nonfinite)
        except _Refused as exc:
            return {"refused": str(exc)}
        return {"refused": None, "result": then(received)}

    def _tokenwire_receive(
        self,
        tensors: Sequence[tuple[str, str, list[int]]],
        packed: bool,
        buffer_size_bytes: int,
        allow_nonfinite: bool,
    ) -> dict[str, Any]:
        """One call's tensors, checked; they live in the group's buffer until its next call."""
        from tokenwire.group_process import GroupAborted
        from tokenwire.weight_transfer import ReceivedTensorError, TensorMeta, dtype_named

        group = self._tokenwire_group
        if group is None:
            raise RuntimeError("no weight-transfer group is open")
        metas = [TensorMeta(n, dtype_named(d), tuple(s)) for n, d, s in tensors]  # type: ignore[arg-type]
        try:
            return group.receive(
                metas,
                packed=packed,
                buffer_size_bytes=buffer_size_bytes,
                allow_nonfinite=allow_nonfinite,
            )
        except ReceivedTensorError as exc:  # in step, but not what was announced
            self.tokenwire_leave_group()
            raise _Refused(str(exc)) from exc
        except GroupAborted as exc:  # more bytes than announced: gloo ended the group's process
            self.tokenwire_leave_group()
            raise _Refused(str(exc)) from exc
        except Exception as exc:  # the trainer died or stalled past the group's timeout
            self.tokenwire_leave_group()
            raise RuntimeError(f"the weight broadcast broke off: {exc}") from exc

    def tokenwire_copy_weights(self, data: bytes) -> list[str]:
        """Tensors from the server process (checked there; one safetensors file), loaded as
        received ones are."""
        from safetensors.torch import load

        return self._tokenwire_load((n, t.to(self.device)) for n, t in load(data).items())

    def _tokenwire_load(
        self, tensors: Iterable[tuple[str, Any]], *, borrowed: bool = False
    ) -> list[str]:
        """Stage ``tensors``, load the layers now complete in one in-place reload, and return
        the names still waiting. ``borrowed``: the tensors live in the group's buffer, which
        its next call overwrites: those left waiting are copied out."""
        layer_of = self._tokenwire_layer_of
        staged = self._tokenwire_staged
        if layer_of is None or staged is None:
            raise RuntimeError("tokenwire_weight_layers was not called")
        given = dict(tensors)
        staged.update(given)
        waiting_layers = {layer_of[n] for n in layer_of if n not in staged}
        ready = [(n, t) for n, t in staged.items() if layer_of[n] not in waiting_layers]
        if ready:
            for name, _ in ready:
                del staged[name]
            partial = len(ready) < len(layer_of)
            reload_logger = logging.getLogger(_RELOAD_LOGGER)
            level = reload_logger.level
            if partial:  # the layers left alone are meant to be
                reload_logger.setLevel(logging.ERROR)
            try:
                self.model_runner.reload_weights(weights_iterator=ready, is_checkpoint_format=True)
            finally:
                reload_logger.setLevel(level)
            self._repack_tied_head()
        if borrowed:
            for name in given.keys() & staged.keys():
                staged[name] = staged[name].clone()
        return sorted(staged)


class _Refused(Exception):
    """A received call that came other than announced: answered as a value, since vLLM's RPC
    error would be a generic failure (and carry this process's details)."""
