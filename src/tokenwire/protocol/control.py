"""RL-loop control bodies: vLLM's, prime-rl's and SGLang's names for the same operations."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from tokenwire.protocol.common import Int64, RequestModel

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


class SleepBody(RequestModel):
    """vLLM reads ``/sleep``'s ``level`` and ``mode`` from the query; skyrl-train sends them in
    the JSON body, which wins when both are given."""

    level: Int64 | None = None
    mode: Literal["abort", "wait", "keep"] | None = None


class WakeUpBody(RequestModel):
    """``/wake_up``'s ``tags`` in the body (skyrl-train), as the query's ``tags`` (vLLM)."""

    tags: list[str] | None = None

    @field_validator("tags", mode="before")
    @classmethod
    def _tags_as_list(cls, value: Any) -> Any:
        # skyrl-train sends ``tags: 1`` when its caller names none (its default): wake all.
        if isinstance(value, int):
            return None
        return [value] if isinstance(value, str) else value


class MemoryOccupationBody(RequestModel):
    """SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``: the memory
    ``tags`` (None: all of them)."""

    tags: list[str] | None = None


class LoadLoraAdapterBody(RequestModel):
    """vLLM's ``/v1/load_lora_adapter`` (SGLang's ``/load_lora_adapter`` sends the same names);
    ``weight_version`` (tokenwire's) labels the tokens it samples."""

    lora_name: str = Field(max_length=256)
    lora_path: str = Field(max_length=4096)
    load_inplace: bool = False
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)


class UnloadLoraAdapterBody(RequestModel):
    lora_name: str = Field(max_length=256)
