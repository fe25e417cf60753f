"""Routes RL frameworks' own bundled servers add (``--enable-rl-control``, the control key):
SkyRL's ``/collective_rpc`` methods and ``/fetch_weights``, skyrl-train's
``/init_weight_update_communicator``, AReaL's ``/areal_*`` (its checkpoint reload and its
two-step distributed update, of base weights and of a LoRA adapter, included). Bodies and
answers are theirs; each route is one control-plane call (``pipeline.control.frameworks`` for
SkyRL's methods)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.control_key import CONTROL
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import pipeline_of
from tokenwire.pipeline.control import frameworks
from tokenwire.protocol.control import InitWeightsUpdateGroupBody
from tokenwire.protocol.frameworks import (
    ArealLoraWeightMetaBody,
    ArealUpdateWeightsBody,
    ArealWeightMetaBody,
    CollectiveRpcBody,
    FetchWeightsBody,
    InitWeightUpdateCommunicatorBody,
)
from tokenwire.protocol.responses import (
    CollectiveRpcResponse,
    StatusResponse,
    SuccessMessageResponse,
)

router = APIRouter(tags=[CONTROL])

# AReaL's server answers each worker's outcome (``build_response``): one worker here.
_AREAL_RANK_OK = "TP rank: 0 success\n"


@router.post("/collective_rpc", response_model=CollectiveRpcResponse)
async def collective_rpc(body: CollectiveRpcBody, request: Request) -> Response:
    """vLLM's worker RPC, limited to the methods SkyRL's client calls (any other: a 400)."""
    results = await frameworks.collective_rpc(pipeline_of(request).control, body)
    return OrjsonResponse({"results": results})


@router.post(
    "/fetch_weights",
    response_class=Response,
    responses={200: {"description": "Never: SkyRL's delta backend is not served (400)"}},
)
async def fetch_weights(body: FetchWeightsBody, request: Request) -> Response:
    frameworks.refuse_fetch_weights()


@router.post("/init_weight_update_communicator", response_model=StatusResponse)
async def init_weight_update_communicator(
    body: InitWeightUpdateCommunicatorBody, request: Request
) -> Response:
    """skyrl-train's vLLM server: join the trainer's group (SGLang's way)."""
    await pipeline_of(request).control.transfer.init_group(
        body.as_group(), replace=body.override_existing_receiver
    )
    return OrjsonResponse({"status": "ok"})


@router.post("/areal_pause_generation", response_model=SuccessMessageResponse)
async def areal_pause_generation(request: Request) -> Response:
    """AReaL's: requests in flight end now, new ones wait for /areal_continue_generation."""
    await pipeline_of(request).control.gate.hold("abort")
    return OrjsonResponse(
        {"success": True, "message": "Generation paused and all requests aborted"}
    )


@router.post("/areal_continue_generation", response_model=SuccessMessageResponse)
async def areal_continue_generation(request: Request) -> Response:
    await pipeline_of(request).control.resume()
    return OrjsonResponse({"success": True, "message": "Generation continued"})


@router.post("/areal_update_weights", response_model=SuccessMessageResponse)
async def areal_update_weights(body: ArealUpdateWeightsBody, request: Request) -> Response:
    """AReaL's checkpoint reload: requests in flight end first, as AReaL's server pauses
    (without waiting for them) around the load."""
    await pipeline_of(request).control.reload(body.model_path, None, abort_all_requests=True)
    return OrjsonResponse({"success": True, "message": _AREAL_RANK_OK})


@router.post("/areal_init_weights_update_group", response_model=SuccessMessageResponse)
async def areal_init_weights_update_group(
    body: InitWeightsUpdateGroupBody, request: Request
) -> Response:
    """AReaL's group: SGLang's fields, joined as SGLang's ``init_weights_update_group``."""
    await pipeline_of(request).control.transfer.init_group(body)
    return OrjsonResponse({"success": True, "message": _AREAL_RANK_OK})


@router.post("/areal_set_update_weight_meta", response_model=SuccessMessageResponse)
async def areal_set_update_weight_meta(body: ArealWeightMetaBody, request: Request) -> Response:
    """AReaL's first step of a distributed update: the tensors the next
    /areal_update_weights_xccl receives (checked against the model now)."""
    transfer = pipeline_of(request).control.transfer
    await transfer.announce(body.names, body.dtypes, body.shapes, body.group_name)
    return OrjsonResponse({"success": True, "message": _AREAL_RANK_OK})


@router.post("/areal_update_weights_xccl", response_model=SuccessMessageResponse)
async def areal_update_weights_xccl(request: Request) -> Response:
    """AReaL's second step (its body is ``{}``, and read by nobody): requests in flight end,
    the announced tensors come over the group and load; a hold from /areal_pause_generation
    stays until /areal_continue_generation."""
    await pipeline_of(request).control.transfer.receive_announced()
    return OrjsonResponse({"success": True, "message": _AREAL_RANK_OK})


@router.post("/areal_set_update_weight_meta_lora", response_model=SuccessMessageResponse)
async def areal_set_update_weight_meta_lora(
    body: ArealLoraWeightMetaBody, request: Request
) -> Response:
    """AReaL's first step of a LoRA update: the factors the next
    /areal_update_weights_lora_xccl receives for adapter ``lora_int_id`` (checked now)."""
    await pipeline_of(request).control.transfer.announce_adapter(body)
    return OrjsonResponse({"success": True, "message": _AREAL_RANK_OK})


@router.post("/areal_update_weights_lora_xccl", response_model=SuccessMessageResponse)
async def areal_update_weights_lora_xccl(
    body: ArealLoraWeightMetaBody, request: Request
) -> Response:
    """AReaL's second step (the same body): requests in flight end, the announced factors
    come over the group, and the adapter is replaced and served as ``lora_name``."""
    await pipeline_of(request).control.transfer.receive_announced_adapter(body.lora_name)
    return OrjsonResponse({"success": True, "message": _AREAL_RANK_OK})
