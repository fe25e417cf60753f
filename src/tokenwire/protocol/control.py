"""RL-loop control bodies: vLLM's, prime-rl's and SGLang's names for the same operations."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tokenwire.protocol.common import RequestModel

Version = str  # a weight version label, as the trainer names it


class AbortRequestsBody(RequestModel):
    """vLLM ``/abort_requests``: missing or empty ``request_ids`` aborts everything."""

    request_ids: list[str] | None = None


class InferenceAbortBody(RequestModel):
    request_ids: list[str]


class AbortRequestBody(RequestModel):
    """SGLang ``/abort_request``."""

    rid: str = ""
    abort_all: bool = False


class UpdateWeightVersionBody(RequestModel):
    new_version: str = Field(min_length=1, max_length=256)
    abort_all_requests: bool = False


class UpdateWeightsBody(RequestModel):
    """``/update_weights`` in either client's form: prime-rl's checkpoint directory of the same
    architecture (``weight_dir``), or vLLM's weight-transfer step (``update_info``, tensors
    from the trainer's group); ``pipeline.control.update_weights`` tells them apart."""

    weight_dir: str | None = Field(default=None, min_length=1)
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)
    update_info: dict[str, Any] | None = None


class UpdateWeightsFromDiskBody(RequestModel):
    """SGLang's ``/update_weights_from_disk``."""

    model_path: str = Field(min_length=1)
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)
    abort_all_requests: bool = False
    flush_cache: bool = True


class PauseGenerationBody(RequestModel):
    """SGLang's ``/pause_generation``: ``retract`` recomputes kept requests on resume."""

    mode: Literal["abort", "retract", "in_place"] = "abort"
