"""vLLM's four-phase weight transfer, and SGLang's names for it: weights from the trainer's
memory, no checkpoint on disk.

``init`` joins the trainer's process group (``--weight-transfer-config``'s backend; the trainer
is rank 0, this server ``rank_offset``); ``start`` opens an update and pauses generation
(``keep``) unless the client paused already; each ``update`` checks its tensors against the
model, then receives them (one broadcast each, or vLLM's packed chunks); ``finish`` publishes
the version once every weight came, and lifts the pause ``start`` took; ``shutdown`` leaves the
group. An update that breaks off (the trainer died or stalled past ``timeout_s``) or finishes
incomplete leaves the weights broken: generation is refused with the reason until a complete
update or a checkpoint reload (``control.weights_whole``), never served half-updated.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, NoReturn

from tokenwire.engine.base import (
    EngineError,
    WeightGroup,
    WeightsError,
    WeightTransferError,
    WeightUpdate,
)
from tokenwire.pipeline import control, lora
from tokenwire.pipeline.context import Pipeline, StagedAdapter, TransferGroup, TransferState
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.protocol.control import (
    InitWeightsUpdateGroupBody,
    TransferInitInfo,
    TransferUpdateInfo,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
)
from tokenwire.weight_transfer import (
    DEFAULT_GROUP_NAME,
    DEFAULT_TIMEOUT_S,
    TensorMeta,
    dtype_named,
)

_RECOVER = "send a complete update or reload a checkpoint (/update_weights {weight_dir})"


def _config_backend(pipeline: Pipeline) -> tuple[str, float]:
    config = pipeline.config.weight_transfer
    if config is None:
        raise InvalidRequest(
            "Weight transfer not configured: start the server with --weight-transfer-config "
            '\'{"backend": "gloo"}\' (vLLM\'s flag)',
            "init_info",
        )
    return config.backend, config.timeout_s


def _timeout_s(pipeline: Pipeline) -> float:
    config = pipeline.config.weight_transfer
    return config.timeout_s if config is not None else DEFAULT_TIMEOUT_S


async def update_weights(
    pipeline: Pipeline,
    weight_dir: str | None,
    version: str | None,
    update_info: TransferUpdateInfo | list[TransferUpdateInfo] | None,
) -> str | None:
    """``/update_weights``: prime-rl's form loads ``weight_dir`` (returns its version);
    vLLM's receives ``update_info`` over the group (returns None)."""
    if weight_dir is not None and update_info is not None:
        raise InvalidRequest(
            "update_info: send weight_dir (prime-rl's form) or update_info (vLLM's), not both",
            "update_info",
        )
    if update_info is not None:
        await update(pipeline, update_info)
        return None
    if weight_dir is None:
        raise InvalidRequest(
            'weight_dir: Field required: /update_weights takes prime-rl\'s {"weight_dir": ..., '
            '"weight_version"?} (a checkpoint directory) or vLLM\'s {"update_info": ...} '
            "(after POST /init_weight_transfer_engine)",
            "weight_dir",
        )
    return await control.load_weights(pipeline, weight_dir, version)


async def init(pipeline: Pipeline, info: TransferInitInfo) -> None:
    """vLLM's ``/init_weight_transfer_engine``."""
    backend, timeout_s = _config_backend(pipeline)
    if info.nccl_unique_id_b64 is not None:
        raise InvalidRequest(
            "init_info.nccl_unique_id_b64: an NCCL unique id is not taken here; send "
            "master_address and master_port",
            "init_info.nccl_unique_id_b64",
        )
    if info.master_address is None or info.master_port is None:
        raise InvalidRequest(
            "init_info: need both master_address and master_port", "init_info.master_address"
        )
    await _join(
        pipeline,
        WeightGroup(
            master_address=info.master_address,
            master_port=info.master_port,
            rank=info.rank_offset,
            world_size=info.world_size,
            backend=backend,
            group_name=DEFAULT_GROUP_NAME,
            timeout_s=timeout_s,
        ),
        TransferGroup(DEFAULT_GROUP_NAME, info.packed, info.packed_buffer_size_bytes),
        "init_info",
    )


async def init_group(pipeline: Pipeline, body: InitWeightsUpdateGroupBody) -> None:
    """SGLang's ``/init_weights_update_group``: the backend comes with the body."""
    await _join(
        pipeline,
        WeightGroup(
            master_address=body.master_address,
            master_port=body.master_port,
            rank=body.rank_offset,
            world_size=body.world_size,
            backend=body.backend,
            group_name=body.group_name,
            timeout_s=_timeout_s(pipeline),
        ),
        TransferGroup(body.group_name, packed=False, buffer_size_bytes=0),
        "backend",
    )


async def _join(pipeline: Pipeline, spec: WeightGroup, group: TransferGroup, param: str) -> None:
    engine = pipeline.ready().engine
    state = pipeline.control.transfer
    backends = engine.weight_transfer_backends()
    if spec.backend not in backends:
        working = ", ".join(backends) or "none (load checkpoints with /update_weights)"
        raise InvalidRequest(
            f"backend {spec.backend!r} cannot move this server's weights; backends that "
            f"work here: {working}",
            param,
        )
    async with state.lock:
        if state.group is not None:
            raise InvalidRequest(
                "a weight-transfer group is already open; shut it down first "
                "(/shutdown_weight_transfer_engine or /destroy_weights_update_group)",
                param,
            )
        try:
            await engine.join_weight_group(spec)
        except (EngineError, WeightTransferError) as exc:
            raise InvalidRequest(f"weight transfer not initialised: {exc}", param) from exc
        state.group = group


async def shutdown(pipeline: Pipeline, group_name: str | None = None) -> None:
    """vLLM's ``/shutdown_weight_transfer_engine`` (refused during an update, as vLLM does)
    and SGLang's ``/destroy_weights_update_group``."""
    engine = pipeline.ready().engine
    state = pipeline.control.transfer
    async with state.lock:
        if state.updating:
            raise InvalidRequest("Cannot release a trainer connection during a weight update")
        if group_name is not None and (state.group is None or state.group.group_name != group_name):
            raise InvalidRequest(f"no weight-transfer group named {group_name!r}", "group_name")
        if state.group is None:
            return  # nothing to leave (vLLM's shutdown is a no-op then too)
        await engine.leave_weight_group()
        state.group = None


async def start(pipeline: Pipeline) -> None:
    """vLLM's ``/start_weight_update``: pause generation (``keep``) unless already paused."""
    pipeline.ready()
    _config_backend(pipeline)
    state = pipeline.control.transfer
    async with state.lock:
        if state.updating:
            raise InvalidRequest(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        await _begin(pipeline, state)


async def _begin(pipeline: Pipeline, state: TransferState) -> None:
    if not control.is_paused(pipeline):
        await control.pause(pipeline, "keep")
        state.paused = True
    state.updating = True
    state.received = set()


def _metas(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> tuple[TensorMeta, ...]:
    metas = []
    for i, (name, dtype_text, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        dtype = dtype_named(dtype_text)
        if dtype is None:
            raise InvalidRequest(f"dtype {dtype_text!r} (tensor {i}, {name}) is not a torch dtype")
        metas.append(TensorMeta(name, dtype, tuple(shape)))
    return tuple(metas)


async def update(
    pipeline: Pipeline, update_info: TransferUpdateInfo | list[TransferUpdateInfo]
) -> None:
    """vLLM's ``/update_weights {update_info}``: receive while the trainer broadcasts (into the
    model, or, with ``lora_name``, into the adapter that finish loads)."""
    pipeline.ready()
    state = pipeline.control.transfer
    if isinstance(update_info, list):
        if not update_info:
            raise InvalidRequest("update_info: an empty list names no receiving rank")
        update_info = update_info[0]  # vLLM's list is indexed by receiving rank: this is 0
    metas = _metas(update_info.names, update_info.dtype_names, update_info.shapes)
    async with state.lock:
        group = state.group
        if group is None:
            raise InvalidRequest(
                "update_info: the weight-transfer engine is not initialised: POST "
                "/init_weight_transfer_engine first (or, to load a checkpoint directory, send "
                'prime-rl\'s {"weight_dir": ..., "weight_version": ...})',
                "update_info",
            )
        if not state.updating:
            raise InvalidRequest(
                "start_weight_update must be called before update_weights.", "update_info"
            )
        if not metas:
            if not state.previous:
                raise InvalidRequest(
                    "update_info: empty lists repeat the previous update, and there is none",
                    "update_info",
                )
            metas = state.previous
        packed = group.packed if update_info.packed is None else update_info.packed
        size = update_info.packed_buffer_size_bytes or group.buffer_size_bytes
        update = WeightUpdate(metas, packed, size)
        if update_info.lora_name is None and state.adapter is None:
            await _receive(pipeline, update, "update_info")
        else:
            await _receive_adapter(pipeline, update, update_info.lora_name, update_info.lora_config)
        state.previous = metas


async def _receive(pipeline: Pipeline, update: WeightUpdate, param: str) -> None:
    """Check, then receive into the model; the caller holds the lock and an update is open."""
    engine = pipeline.ready().engine
    state = pipeline.control.transfer
    try:
        engine.check_weight_update(update.tensors)
    except WeightsError as exc:
        await _refuse(pipeline, exc, param)
    try:
        await engine.receive_weights(update)
    except WeightTransferError as exc:
        state.group = None
        _break(state, f"an update broke off: {exc}")
        raise InvalidRequest(
            f"weights not updated: {exc}; generation stays paused until you {_RECOVER}", param
        ) from exc
    state.received.update(meta.name for meta in update.tensors)


async def _receive_adapter(
    pipeline: Pipeline,
    update: WeightUpdate,
    name: str | None,
    config: dict[str, Any] | None,
) -> None:
    """Check, then receive a LoRA adapter's factors into ``state.adapter`` (the model is not
    touched: a broadcast that breaks off leaves every adapter as it was)."""
    state = pipeline.control.transfer
    staged = state.adapter
    param = "update_info.lora_name"
    try:
        if name is None or state.received or (staged is not None and staged.name != name):
            raise WeightsError(
                "one update carries the model's weights or one LoRA adapter's factors (the "
                "same lora_name in every update_info), not both"
            )
        if staged is None:
            staged = StagedAdapter(name, lora.config_for(pipeline, name, config, param))
        pipeline.ready().engine.check_adapter_update(staged.config, update.tensors)
    except (WeightsError, InvalidRequest) as exc:
        await _refuse(pipeline, exc, param)
    state.adapter = staged
    try:
        staged.tensors.update(await pipeline.ready().engine.receive_tensors(update))
    except WeightTransferError as exc:
        state.group = None
        state.adapter = None
        await _end(pipeline, state)
        raise InvalidRequest(f"LoRA adapter {name!r} not updated: {exc}", param) from exc


async def _refuse(pipeline: Pipeline, exc: Exception, param: str) -> NoReturn:
    """The trainer is broadcasting what this server will not take: the group cannot carry on
    in step, so it is closed (nothing was received; the weights are as they were)."""
    engine = pipeline.ready().engine
    state = pipeline.control.transfer
    await engine.leave_weight_group()
    state.group = None
    state.adapter = None
    if state.received:  # earlier tensors of this update are in already
        _break(state, "an update was refused after some of its tensors came")
    else:
        await _end(pipeline, state)
    message = exc.message if isinstance(exc, InvalidRequest) else str(exc)
    raise InvalidRequest(
        f"weights not updated (nothing received; the group is closed, init again): {message}",
        param,
    ) from exc


def _break(state: TransferState, reason: str) -> None:
    state.failed = reason
    state.updating = False


async def _end(pipeline: Pipeline, state: TransferState) -> None:
    """Close an update that changed no base weight; lift the pause it took."""
    state.updating = False
    state.adapter = None
    if state.paused and state.failed is None:
        state.paused = False
        await control.end_pause(pipeline)


async def finish(pipeline: Pipeline, version: str | None) -> None:
    """vLLM's ``/finish_weight_update {weight_version?}``: every weight must have come."""
    engine = pipeline.ready().engine
    state = pipeline.control.transfer
    async with state.lock:
        if not state.updating:
            raise InvalidRequest(
                "finish_weight_update called without a matching start_weight_update."
            )
        if state.adapter is not None:
            await _finish_adapter(pipeline, state, state.adapter, version)
            return
        missing = engine.missing_weights(state.received)
        if missing:
            _break(state, f"an update finished without {len(missing)} weights")
            raise InvalidRequest(
                f"weights not updated: {len(missing)} of the model's weights were not sent "
                f"({', '.join(missing[:5])}); generation stays paused until you {_RECOVER}",
                "weight_version",
            )
        if version is not None:
            await engine.set_weight_version(version)
        await control.weights_whole(pipeline)


async def _finish_adapter(
    pipeline: Pipeline, state: TransferState, staged: StagedAdapter, version: str | None
) -> None:
    """Load the adapter whose factors came (in place when loaded), then lift the pause."""
    try:
        await lora.load_adapter_tensors(
            pipeline,
            staged.name,
            staged.tensors,
            config=staged.config,
            version=version,
            param="update_info.lora_name",
        )
    finally:
        await _end(pipeline, state)


async def update_from_distributed(
    pipeline: Pipeline, body: UpdateWeightsFromDistributedBody
) -> None:
    """SGLang's ``/update_weights_from_distributed``: receive and load at once (SGLang loads
    the tensors it names; others keep their values), generation paused meanwhile; with
    ``lora_name``, an adapter's factors, loaded in place while generation goes on."""
    if body.names is not None:
        if body.dtypes is None or body.shapes is None:
            raise InvalidRequest("names needs dtypes and shapes of the same length", "names")
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            raise InvalidRequest("names, dtypes and shapes must have the same length", "names")
        metas = _metas(body.names, body.dtypes, body.shapes)
    elif body.name is not None and body.dtype is not None and body.shape is not None:
        metas = _metas([body.name], [body.dtype], [body.shape])
    else:
        raise InvalidRequest(
            "send names, dtypes and shapes (or one name, dtype and shape)", "names"
        )
    if not metas:
        raise InvalidRequest("names: no tensors to update", "names")
    if body.abort_all_requests:
        await control.abort_requests(pipeline)
    state = pipeline.control.transfer
    async with state.lock:
        if state.group is None or state.group.group_name != body.group_name:
            raise InvalidRequest(
                f"no weight-transfer group named {body.group_name!r}: POST "
                "/init_weights_update_group first",
                "group_name",
            )
        if state.updating:
            raise InvalidRequest("a vLLM-style weight update is open; finish it first")
        if body.lora_name is not None:
            # No pause: the factors come into new tensors, and the adapter loads between steps.
            state.updating, state.received = True, set()
            await _receive_adapter(pipeline, WeightUpdate(metas), body.lora_name, body.lora_config)
            assert state.adapter is not None
            await _finish_adapter(pipeline, state, state.adapter, body.weight_version)
            return
        await _begin(pipeline, state)
        await _receive(pipeline, WeightUpdate(metas), "names")
        await _partial_done(pipeline, state, body.weight_version)


async def _partial_done(pipeline: Pipeline, state: TransferState, version: str | None) -> None:
    """SGLang's one-call updates: a partial update is complete as sent."""
    if version is not None:
        await pipeline.ready().engine.set_weight_version(version)
    if state.failed is None:
        await _end(pipeline, state)
    else:  # an earlier broken update: only a complete one mends it
        state.updating = False


async def update_from_tensor(pipeline: Pipeline, body: UpdateWeightsFromTensorBody) -> None:
    """SGLang's ``/update_weights_from_tensor`` with safetensors entries (never pickles); with
    ``lora_name``, an adapter's factors (loaded in place, or new with ``lora_config``)."""
    tensors = decode_tensors(body.load_format, body.serialized_named_tensors[0])
    engine = pipeline.ready().engine
    if body.abort_all_requests:
        await control.abort_requests(pipeline)
    if body.lora_name is not None:
        await lora.load_adapter_tensors(
            pipeline,
            body.lora_name,
            tensors,
            config=body.lora_config,
            version=body.weight_version,
        )
        return
    state = pipeline.control.transfer
    async with state.lock:
        if state.updating:
            raise InvalidRequest("a vLLM-style weight update is open; finish it first")
        await _begin(pipeline, state)
        try:
            await engine.copy_weights(tensors)
        except WeightsError as exc:
            await _end(pipeline, state)
            raise InvalidRequest(f"weights not updated: {exc}", "serialized_named_tensors") from exc
        await _partial_done(pipeline, state, body.weight_version)


def decode_tensors(load_format: str | None, entry: str) -> dict[str, Any]:
    """One of SGLang's ``serialized_named_tensors`` entries: the base64 of a safetensors file
    (SGLang's own entries are pickles, which this server never loads: they can run code)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if load_format != "safetensors":
        raise InvalidRequest(
            f"load_format {load_format!r}: SGLang's serialized tensors are pickles, which "
            'this server never loads (they can run code); send load_format "safetensors" with '
            "each entry the base64 of a safetensors file",
            "load_format",
        )
    try:
        raw = base64.b64decode(entry, validate=True)
        return load(raw)
    except (binascii.Error, ValueError, SafetensorError) as exc:
        raise InvalidRequest(
            f"serialized_named_tensors[0] is not base64 of a safetensors file: {exc}",
            "serialized_named_tensors",
        ) from exc


def config_json(pipeline: Pipeline) -> dict[str, Any] | None:
    """``/server_info``'s ``weight_transfer_config``."""
    config = pipeline.config.weight_transfer
    return None if config is None else config.as_json()
