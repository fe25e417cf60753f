"""LoRA adapter routes (``--enable-rl-control`` with ``--enable-lora``): vLLM's, SkyRL's and
SGLang's names for loading and unloading an adapter (the control plane's adapter registry), from
its directory or (SGLang's ``/load_lora_adapter_from_tensors``) from a trainer's memory."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response

from tokenwire.api.control_key import CONTROL
from tokenwire.api.errors import expected_error
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import pipeline_of
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.control.transfer import decode_tensors
from tokenwire.protocol.control import (
    LoadLoraAdapterBody,
    LoadLoraAdapterFromTensorsBody,
    SkyRLLoadLoraAdapterBody,
    UnloadLoraAdapterBody,
)
from tokenwire.protocol.responses import SGLangLoraResponse

# Loading weights changes the server: the control key only (``api.control_key``).
router = APIRouter(tags=["lora", CONTROL])


async def _load(request: Request, body: LoadLoraAdapterBody, *, inplace: bool) -> None:
    await pipeline_of(request).control.adapters.load_path(
        body.lora_name,
        body.lora_path,
        load_inplace=inplace,
        version=body.weight_version,
    )


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(request: Request, body: LoadLoraAdapterBody) -> Response:
    """vLLM's: a name already loaded is a 400 unless ``load_inplace``."""
    await _load(request, body, inplace=body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/skyrl/v1/load_lora_adapter", response_class=PlainTextResponse)
async def skyrl_load_lora_adapter(request: Request, body: SkyRLLoadLoraAdapterBody) -> Response:
    """SkyRL's: always replaces the adapter of that name (its trainer rewrites the files); with
    ``in_memory``, the adapter its last weight update carried, loaded when that finished."""
    adapters = pipeline_of(request).control.adapters
    if body.lora_path is None:
        adapters.check_from_memory(body.lora_name)
    else:
        await adapters.load_path(
            body.lora_name, body.lora_path, load_inplace=True, version=body.weight_version
        )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(request: Request, body: UnloadLoraAdapterBody) -> Response:
    await pipeline_of(request).control.adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _sglang_answer(pipeline: Pipeline, error: BaseException | None) -> Response:
    """SGLang answers its LoRA routes with a success flag and the loaded adapters, and a 400
    (same body) when the call failed."""
    expected = None if error is None else expected_error(error)
    if error is not None and expected is None:
        raise error
    loaded = {name: a.path for name, a in pipeline.control.adapters.loaded.items()}
    message = None if expected is None else expected[1]
    body = {"success": error is None, "error_message": message, "loaded_adapters": loaded}
    return OrjsonResponse(body, status_code=200 if error is None else 400)


@router.post("/load_lora_adapter", response_model=SGLangLoraResponse)
async def sglang_load_lora_adapter(request: Request, body: LoadLoraAdapterBody) -> Response:
    try:
        await _load(request, body, inplace=body.load_inplace)
    except Exception as exc:
        return _sglang_answer(pipeline_of(request), exc)
    return _sglang_answer(pipeline_of(request), None)


@router.post("/load_lora_adapter_from_tensors", response_model=SGLangLoraResponse)
async def sglang_load_lora_adapter_from_tensors(
    request: Request, body: LoadLoraAdapterFromTensorsBody
) -> Response:
    """SGLang's: an adapter from the trainer's memory, loaded (or replaced in place)."""
    pipeline = pipeline_of(request)
    try:
        await pipeline.control.adapters.load_tensors(
            body.lora_name,
            decode_tensors(body.load_format, body.entry),
            config=body.config_dict,
            version=body.weight_version,
        )
    except Exception as exc:
        return _sglang_answer(pipeline, exc)
    return _sglang_answer(pipeline, None)


@router.post("/unload_lora_adapter", response_model=SGLangLoraResponse)
async def sglang_unload_lora_adapter(request: Request, body: UnloadLoraAdapterBody) -> Response:
    try:
        await pipeline_of(request).control.adapters.unload(body.lora_name)
    except Exception as exc:
        return _sglang_answer(pipeline_of(request), exc)
    return _sglang_answer(pipeline_of(request), None)
