"""RL-loop control routes, under vLLM's, prime-rl's and SGLang's names (``--enable-rl-control``).

Every route here needs the control key (``api.control_key``: the router's ``CONTROL`` tag) when
the server has one; off unless the flag is given, since any caller could otherwise stop the
server or load weights from its disk.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import PlainTextResponse, Response

from tokenwire.api.control_key import CONTROL
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import pipeline_of
from tokenwire.pipeline.control.gate import SGLANG_MEMORY_TAGS
from tokenwire.pipeline.control.info import ConfigFormat, server_info
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.protocol.control import (
    DestroyWeightsUpdateGroupBody,
    FinishWeightUpdateBody,
    InitWeightsUpdateGroupBody,
    InitWeightTransferBody,
    MemoryOccupationBody,
    PauseGenerationBody,
    SleepBody,
    UpdateWeightsBody,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
    UpdateWeightVersionBody,
    WakeUpBody,
)
from tokenwire.protocol.responses import (
    IsPausedResponse,
    IsSleepingResponse,
    MessageResponse,
    MessageStatusResponse,
    ServerInfoResponse,
    StatusResponse,
    SuccessMessageResponse,
    SuccessResponse,
    UpdateWeightsFromDiskResponse,
    UpdateWeightsResponse,
    UpdateWeightVersionResponse,
    WeightInfoResponse,
    WorldSizeResponse,
)

router = APIRouter(tags=[CONTROL])

# SGLang's answers: JSON null (memory routes) and a text (flush; clients match its start).
_SGLANG_NULL: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON null, as SGLang answers",
        "content": {"application/json": {"schema": {"type": "null"}}},
    }
}
_SGLANG_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


@router.post("/pause", response_model=StatusResponse)
async def pause(request: Request, mode: str = "abort", clear_cache: bool = False) -> Response:
    paused = await pipeline_of(request).control.gate.pause(mode, clear_cache=clear_cache)
    return OrjsonResponse({"status": "paused" if paused else "resumed"})


@router.post("/resume", response_model=StatusResponse)
async def resume(request: Request) -> Response:
    await pipeline_of(request).control.resume()
    return OrjsonResponse({"status": "resumed"})


@router.get("/is_paused", response_model=IsPausedResponse)
async def is_paused(request: Request) -> Response:
    return OrjsonResponse({"is_paused": pipeline_of(request).control.gate.paused})


@router.post("/sleep", response_model=StatusResponse)
async def sleep(
    request: Request, body: SleepBody | None = None, level: int = 1, mode: str = "abort"
) -> Response:
    """vLLM's sleep (level and mode in the query); skyrl-train's body and ``{"status": "ok"}``."""
    if body is not None:
        level = level if body.level is None else body.level
        mode = mode if body.mode is None else body.mode
    await pipeline_of(request).control.sleep(level, mode=mode)
    return OrjsonResponse({"status": "ok"})


@router.post("/wake_up", response_model=StatusResponse)
async def wake_up(
    request: Request,
    body: WakeUpBody | None = None,
    tags: Annotated[list[str] | None, Query()] = None,
) -> Response:
    """vLLM's wake-up (``tags`` repeated in the query); skyrl-train's body and answer."""
    if body is not None and body.tags is not None:
        tags = body.tags
    await pipeline_of(request).control.wake_up(tags)
    return OrjsonResponse({"status": "ok"})


@router.get("/is_sleeping", response_model=IsSleepingResponse)
async def is_sleeping(request: Request) -> Response:
    return OrjsonResponse({"is_sleeping": pipeline_of(request).control.gate.sleeping})


@router.post("/update_weight_version", response_model=UpdateWeightVersionResponse)
async def update_weight_version(body: UpdateWeightVersionBody, request: Request) -> Response:
    await pipeline_of(request).control.set_weight_version(
        body.new_version, abort_all_requests=body.abort_all_requests
    )
    return OrjsonResponse(
        {"success": True, "new_version": body.new_version, "message": "weight version updated"}
    )


@router.get("/weight_info", response_model=WeightInfoResponse)
async def weight_info(request: Request) -> Response:
    return OrjsonResponse(pipeline_of(request).control.weight_info())


@router.post(
    "/update_weights", response_model=UpdateWeightsResponse | MessageResponse | StatusResponse
)
async def update_weights(body: UpdateWeightsBody, request: Request) -> Response:
    """prime-rl's checkpoint directory, vLLM's ``update_info`` (between start and finish), or
    skyrl-train's ``names``/``dtypes``/``shapes`` (answered as its vLLM server does)."""
    named = body.named_update()
    version = await pipeline_of(request).control.update_weights(
        body.weight_dir, body.weight_version, body.update_info, named
    )
    if named is not None:
        return OrjsonResponse({"status": "ok"})
    if version is None:
        return OrjsonResponse({"message": "Weights updated"})
    return OrjsonResponse({"success": True, "weight_version": version})


# -- weight transfer: vLLM's four phases, then SGLang's names ---------------------------------


@router.post("/init_weight_transfer_engine", response_model=MessageResponse)
async def init_weight_transfer_engine(body: InitWeightTransferBody, request: Request) -> Response:
    """Join the trainer's group (answers once every rank joined)."""
    await pipeline_of(request).control.transfer.init(body.init_info)
    return OrjsonResponse({"message": "Weight transfer initialized"})


@router.post("/start_weight_update", response_model=MessageResponse)
async def start_weight_update(request: Request) -> Response:
    await pipeline_of(request).control.transfer.start()
    return OrjsonResponse({"message": "Weight update started"})


@router.post("/finish_weight_update", response_model=MessageResponse)
async def finish_weight_update(
    request: Request, body: FinishWeightUpdateBody | None = None
) -> Response:
    version = None if body is None else body.weight_version
    await pipeline_of(request).control.transfer.finish(version)
    return OrjsonResponse({"message": "Weight update finished"})


@router.post("/shutdown_weight_transfer_engine", response_model=MessageResponse)
async def shutdown_weight_transfer_engine(request: Request) -> Response:
    await pipeline_of(request).control.transfer.shutdown()
    return OrjsonResponse({"message": "Weight transfer shut down"})


@router.post("/init_weights_update_group", response_model=SuccessMessageResponse)
async def init_weights_update_group(body: InitWeightsUpdateGroupBody, request: Request) -> Response:
    await pipeline_of(request).control.transfer.init_group(body)
    return OrjsonResponse(
        {"success": True, "message": "Succeeded to initialize custom process group."}
    )


@router.post("/update_weights_from_distributed", response_model=SuccessMessageResponse)
async def update_weights_from_distributed(
    body: UpdateWeightsFromDistributedBody, request: Request
) -> Response:
    await pipeline_of(request).control.transfer.update_from_distributed(body)
    return OrjsonResponse(
        {"success": True, "message": "Succeeded to update parameter online from distributed."}
    )


@router.post("/destroy_weights_update_group", response_model=SuccessMessageResponse)
async def destroy_weights_update_group(
    request: Request, body: DestroyWeightsUpdateGroupBody | None = None
) -> Response:
    group_name = None if body is None else body.group_name
    await pipeline_of(request).control.transfer.shutdown(group_name)
    return OrjsonResponse(
        {"success": True, "message": "Succeeded to destroy custom process group."}
    )


@router.post("/update_weights_from_tensor", response_model=SuccessMessageResponse)
async def update_weights_from_tensor(
    body: UpdateWeightsFromTensorBody, request: Request
) -> Response:
    await pipeline_of(request).control.transfer.update_from_tensor(body)
    return OrjsonResponse({"success": True, "message": "Succeeded to update model weights."})


@router.post("/update_weights_from_disk", response_model=UpdateWeightsFromDiskResponse)
async def update_weights_from_disk(body: UpdateWeightsFromDiskBody, request: Request) -> Response:
    pipeline = pipeline_of(request)
    version = await pipeline.control.reload(
        body.model_path, body.weight_version, abort_all_requests=body.abort_all_requests
    )
    return OrjsonResponse(
        {
            "success": True,
            "message": f"Succeeded to update model weights (version {version}).",
            "num_paused_requests": pipeline.control.num_paused_requests(),
        }
    )


@router.post("/pause_generation", response_model=MessageStatusResponse)
async def pause_generation(request: Request, body: PauseGenerationBody | None = None) -> Response:
    """SGLang's pause; new requests wait for /continue_generation. AReaL sends no body."""
    mode = "abort" if body is None else body.mode
    await pipeline_of(request).control.gate.hold(mode)
    return OrjsonResponse({"message": "Generation paused.", "status": "ok"})


@router.post("/continue_generation", response_model=MessageStatusResponse)
async def continue_generation(request: Request) -> Response:
    await pipeline_of(request).control.resume()
    return OrjsonResponse({"message": "Generation continued.", "status": "ok"})


@router.get("/release_memory_occupation", responses=_SGLANG_NULL)
@router.post("/release_memory_occupation", responses=_SGLANG_NULL)
async def release_memory_occupation(
    request: Request, body: MemoryOccupationBody | None = None
) -> Response:
    """SGLang's sleep: the ``tags`` (default: all of SGLang's) sleep until resumed."""
    tags = SGLANG_MEMORY_TAGS if body is None or body.tags is None else body.tags
    await pipeline_of(request).control.sleep(1, tags=tags)
    return OrjsonResponse(None)


@router.get("/resume_memory_occupation", responses=_SGLANG_NULL)
@router.post("/resume_memory_occupation", responses=_SGLANG_NULL)
async def resume_memory_occupation(
    request: Request, body: MemoryOccupationBody | None = None
) -> Response:
    await pipeline_of(request).control.wake_up(None if body is None else body.tags)
    return OrjsonResponse(None)


@router.get("/flush_cache", response_class=PlainTextResponse)
@router.post("/flush_cache", response_class=PlainTextResponse)
async def flush_cache(request: Request, timeout: Annotated[float, Query(ge=0.0)] = 0.0) -> Response:
    """SGLang's name for resetting the prefix cache, answered with SGLang's text."""
    if not await pipeline_of(request).control.flush_cache(timeout):
        # SGLang answers a refused flush with a 400 too.
        raise InvalidRequest(
            "Flush cache failed: running requests hold cached blocks; retry when idle"
        )
    return PlainTextResponse(_SGLANG_FLUSHED)


@router.post("/reset_prefix_cache", response_model=SuccessResponse)
async def reset_prefix_cache(request: Request) -> Response:
    success = await pipeline_of(request).control.flush_cache()
    return OrjsonResponse({"success": success})


@router.get("/server_info", response_model=ServerInfoResponse)
async def show_server_info(request: Request, config_format: ConfigFormat = "text") -> Response:
    """vLLM's (dev mode): the resolved configuration; TRL asks ``config_format=json``."""
    return OrjsonResponse(server_info(pipeline_of(request), config_format))


@router.get("/get_world_size", response_model=WorldSizeResponse)
async def get_world_size(request: Request) -> Response:
    pipeline_of(request).ready()
    return OrjsonResponse({"world_size": 1})
