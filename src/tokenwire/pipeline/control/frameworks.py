"""What RL frameworks' own bundled servers add beyond vLLM's and SGLang's routes, in terms of the
control plane: SkyRL's ``/collective_rpc`` methods (its vLLM worker extension,
``new_inference_worker_wrap.NewInferenceWorkerWrap``) and its ``/fetch_weights``.

``/collective_rpc`` runs a worker method by name in vLLM. Here it serves exactly the methods
SkyRL's client calls, each one control-plane call, and nothing else: any other name is a 400
listing these. No state lives here; the gate, the transfer and the adapter registry own it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from pydantic import BaseModel, ValidationError

from tokenwire.pipeline.control import ControlPlane
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.protocol.frameworks import (
    CollectiveRpcBody,
    DiscardInMemoryLoraKwargs,
    SetLoraReceiveTargetKwargs,
    SleepForWeightSyncKwargs,
    WakeForWeightSyncKwargs,
)


async def _sleep_for_weight_sync(control: ControlPlane, kwargs: SleepForWeightSyncKwargs) -> None:
    """SkyRL sleeps vLLM's allocator with the scheduler KEEP-paused (its caller paused first),
    so frozen requests resume after the sync; there is no device memory to free here. A keep
    pause (new requests queue, as in vLLM's paused scheduler) is what stays, and ``offload_kv:
    false`` (SkyRL discards the KV) makes the frozen requests recompute theirs on resume."""
    await control.gate.pause("keep", clear_cache=not kwargs.offload_kv)


async def _wake_for_weight_sync(control: ControlPlane, kwargs: WakeForWeightSyncKwargs) -> None:
    """Nothing slept (see ``_sleep_for_weight_sync``); like SkyRL's, it does not resume."""


async def _set_lora_receive_target(
    control: ControlPlane, kwargs: SetLoraReceiveTargetKwargs
) -> None:
    target = kwargs.receive_target
    await control.transfer.arm_lora_target(target.lora_name, target.adapter_config, target.aliases)


async def _discard_in_memory_lora(control: ControlPlane, kwargs: DiscardInMemoryLoraKwargs) -> bool:
    """SkyRL's worker keeps an in-memory adapter's tensors apart from vLLM's LoRA manager and
    frees them after the unload; here the registry holds them, and the unload freed them.
    Nothing is left to discard: False, as SkyRL answers for a name it does not stage."""
    return False


_Handler = Callable[[ControlPlane, Any], Awaitable[Any]]
# method -> (its kwargs, what it does); the only methods /collective_rpc runs.
RPC_METHODS: dict[str, tuple[type[BaseModel], _Handler]] = {
    "skyrl_sleep_for_weight_sync": (SleepForWeightSyncKwargs, _sleep_for_weight_sync),
    "skyrl_wake_for_weight_sync": (WakeForWeightSyncKwargs, _wake_for_weight_sync),
    "skyrl_set_lora_receive_target": (SetLoraReceiveTargetKwargs, _set_lora_receive_target),
    "skyrl_discard_in_memory_lora": (DiscardInMemoryLoraKwargs, _discard_in_memory_lora),
}


async def collective_rpc(control: ControlPlane, body: CollectiveRpcBody) -> list[Any]:
    """Run one served method; vLLM's ``results``: one per worker, and this server is one."""
    served = RPC_METHODS.get(body.method)
    if served is None:
        raise InvalidRequest(
            f"method {body.method!r} is not served: /collective_rpc runs only "
            f"{', '.join(RPC_METHODS)} (SkyRL's worker extension), never arbitrary code",
            "method",
        )
    if body.args:
        raise InvalidRequest(
            f"args: {body.method} takes its arguments by name in kwargs, as SkyRL sends them",
            "args",
        )
    model, handler = served
    try:
        kwargs = model.model_validate(body.kwargs)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(["kwargs", *(str(part) for part in error["loc"])])
        raise InvalidRequest(f"{field}: {error['msg']}", field) from exc
    return [await handler(control, kwargs)]


def refuse_fetch_weights() -> NoReturn:
    """SkyRL's ``/fetch_weights``: its delta backend's workers download a compressed checkpoint
    delta (SkyRL's own format, from ``sync_dir`` or an object-store ``uri``) and apply it
    before a paused reload. tokenwire has no such store or format, and its
    ``/init_weight_transfer_engine`` refuses the delta backend's ``init_info`` before this is
    ever called; a clear 400 rather than a 404."""
    raise InvalidRequest(
        "fetch_weights: SkyRL's checkpoint-delta weight sync (weight_sync_backend=delta) is not "
        "served here; sync weights over a broadcast group (/init_weight_transfer_engine or "
        "/init_weights_update_group) or reload a checkpoint directory (/update_weights "
        '{"weight_dir": ...})'
    )
