"""RL-loop control bodies: vLLM's, prime-rl's and SGLang's names for the same operations."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from tokenwire.protocol.common import (
    INT64_MAX,
    Int64,
    RequestModel,
    ServerPath,
    StrictRequestModel,
)
from tokenwire.weight_transfer import (
    DEFAULT_GROUP_NAME,
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
)

Version = str  # a weight version label, as the trainer names it
# tokenwire's fields that point a weight update at a LoRA adapter (docs/api.md "LoRA"): its
# name, and its adapter_config.json's fields (needed when the adapter is not loaded yet).
LoraName = Annotated[str, Field(min_length=1, max_length=256)]
LoraConfig = dict[str, Any]


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


Port = Annotated[int, Field(ge=1, le=65535)]


def _port_number(value: Any) -> Any:
    """SGLang takes a port as a string of digits (AReaL sends ``str(port)``)."""
    return int(value) if isinstance(value, str) and value.isascii() and value.isdigit() else value


# A port from an SGLang-style body: an int, or its digits.
LenientPort = Annotated[Port, BeforeValidator(_port_number)]
PositiveInt = Annotated[int, Field(ge=1, le=INT64_MAX)]
Dim = Annotated[int, Field(ge=0, le=INT64_MAX)]


class TransferInitInfo(StrictRequestModel):
    """vLLM's NCCL ``init_info`` (``NCCLWeightTransferInitInfo``): the trainer is rank 0 and
    this server joins at ``rank_offset``; ``packed`` and the buffer sizes live here in vLLM
    0.33 (older clients send ``packed`` in ``update_info``, also read)."""

    master_address: str | None = Field(default=None, min_length=1, max_length=255)
    master_port: Port | None = None
    rank_offset: PositiveInt
    world_size: Annotated[int, Field(ge=2, le=65536)]
    # tokenwire's: the trainer made its group as SGLang's init_custom_process_group does, under
    # this name (tokenwire's WeightSender); None: with torch's init_process_group.
    group_name: str | None = Field(default=None, min_length=1, max_length=256)
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: PositiveInt = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: PositiveInt = DEFAULT_PACKED_NUM_BUFFERS

    @model_validator(mode="after")
    def _rank_in_group(self) -> TransferInitInfo:
        if self.rank_offset >= self.world_size:
            raise ValueError(
                f"rank_offset {self.rank_offset} is outside a group of world_size "
                f"{self.world_size} (the trainer is rank 0, servers 1..world_size-1)"
            )
        return self


class InitWeightTransferBody(RequestModel):
    init_info: TransferInitInfo


class TransferUpdateInfo(StrictRequestModel):
    """vLLM's ``update_info``: the tensors the trainer broadcasts next, in order. Empty lists
    repeat the previous update's tensors. ``packed`` and the buffer size here are older
    clients' (vLLM 0.33 reads them from ``init_info``); ``is_checkpoint_format`` is accepted
    and has no effect (the hf engine takes checkpoint names)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[Dim]]
    packed: bool | None = None
    packed_buffer_size_bytes: PositiveInt | None = None
    packed_num_buffers: PositiveInt | None = None
    is_checkpoint_format: bool = True
    lora_name: LoraName | None = None
    lora_config: LoraConfig | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> TransferUpdateInfo:
        # vLLM's own messages (NCCLWeightTransferUpdateInfo.__post_init__)
        if len(self.dtype_names) != len(self.names):
            raise ValueError(
                "`dtype_names` should be of the same size as `names`: "
                f"got {len(self.dtype_names)} and {len(self.names)}"
            )
        if len(self.shapes) != len(self.names):
            raise ValueError(
                "`shapes` should be of the same size as `names`: "
                f"got {len(self.shapes)} and {len(self.names)}"
            )
        return self


class UpdateWeightsBody(RequestModel):
    """``/update_weights`` in one of three clients' forms: prime-rl's checkpoint directory of
    the same architecture (``weight_dir``), vLLM's weight-transfer step (``update_info``,
    tensors from the trainer's group; a list holds one entry per receiving rank, as vLLM's
    data-parallel form: this server is rank 0 of it), or skyrl-train's vLLM server's
    ``asdict(BroadcastWeightUpdateRequest)`` (``names``/``dtypes``/``shapes``: received and
    loaded at once, as SGLang's ``/update_weights_from_distributed``);
    ``pipeline.control.update_weights`` tells them apart."""

    weight_dir: ServerPath | None = Field(default=None, min_length=1)
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)
    update_info: TransferUpdateInfo | list[TransferUpdateInfo] | None = None
    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[Dim]] | None = None

    def named_update(self) -> UpdateWeightsFromDistributedBody | None:
        """skyrl-train's form as the SGLang body it means (None: another form). Missing or
        unequal lists are ``update_from_distributed``'s 400."""
        if self.names is None and self.dtypes is None and self.shapes is None:
            return None
        return UpdateWeightsFromDistributedBody(
            names=self.names if self.names is not None else [],
            dtypes=self.dtypes,
            shapes=self.shapes,
            weight_version=self.weight_version,
        )


class FinishWeightUpdateBody(RequestModel):
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)


class InitWeightsUpdateGroupBody(RequestModel):
    """SGLang's ``/init_weights_update_group``."""

    master_address: str = Field(min_length=1, max_length=255)
    master_port: LenientPort
    rank_offset: PositiveInt
    world_size: Annotated[int, Field(ge=2, le=65536)]
    group_name: str = Field(default=DEFAULT_GROUP_NAME, min_length=1, max_length=256)
    backend: str = "nccl"


class UpdateWeightsFromDistributedBody(RequestModel):
    """SGLang's ``/update_weights_from_distributed``: ``names``/``dtypes``/``shapes`` lists,
    or an older client's one ``name``/``dtype``/``shape``."""

    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[Dim]] | None = None
    name: str | None = None
    dtype: str | None = None
    shape: list[Dim] | None = None
    # None: the one open group (SGLang keeps one and uses it; skyrl-train names none).
    group_name: str | None = Field(default=None, min_length=1, max_length=256)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)
    load_format: str | None = None
    lora_name: LoraName | None = None
    lora_config: LoraConfig | None = None


class DestroyWeightsUpdateGroupBody(RequestModel):
    group_name: str | None = Field(default=None, min_length=1, max_length=256)  # None: the open one


class UpdateWeightsFromTensorBody(RequestModel):
    """SGLang's ``/update_weights_from_tensor``: one serialized entry per tensor-parallel rank
    (this server reads the first). Only ``load_format: "safetensors"`` (each entry the base64
    of a safetensors file) is taken; SGLang's default is pickled tensors."""

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)
    lora_name: LoraName | None = None
    lora_config: LoraConfig | None = None


class UpdateWeightsFromDiskBody(RequestModel):
    """SGLang's ``/update_weights_from_disk``."""

    model_path: ServerPath = Field(min_length=1)
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
    lora_path: ServerPath
    load_inplace: bool = False
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)


class SkyRLLoadLoraAdapterBody(RequestModel):
    """SkyRL's ``/skyrl/v1/load_lora_adapter``: ``lora_path``, or ``in_memory: true`` for the
    adapter its last weight update carried (``lora.sync_mode=memory``)."""

    lora_name: str = Field(max_length=256)
    lora_path: str | None = Field(default=None, max_length=4096)
    in_memory: bool = False
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_source(self) -> SkyRLLoadLoraAdapterBody:
        if self.in_memory == (self.lora_path is not None):
            raise ValueError("send lora_path or in_memory: true (one of them)")
        return self


class LoadLoraAdapterFromTensorsBody(RequestModel):
    """SGLang's ``/load_lora_adapter_from_tensors``: ``config_dict`` (adapter_config.json's
    fields) and the factors as one serialized entry (``serialized_tensors``, SGLang 0.5.8) or
    one per tensor-parallel rank (``serialized_named_tensors``, later; the first is read).
    Entries must be ``load_format: "safetensors"``, as for ``/update_weights_from_tensor``."""

    lora_name: LoraName
    config_dict: LoraConfig
    serialized_tensors: str | None = None
    serialized_named_tensors: list[str] | None = Field(default=None, min_length=1)
    load_format: str | None = None
    pinned: bool = False
    added_tokens_config: dict[str, Any] | None = None
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_entry(self) -> LoadLoraAdapterFromTensorsBody:
        if (self.serialized_tensors is None) == (self.serialized_named_tensors is None):
            raise ValueError("send serialized_tensors or serialized_named_tensors (one of them)")
        if self.added_tokens_config:
            raise ValueError("added_tokens_config: adapters that add tokens are not served")
        return self

    @property
    def entry(self) -> str:
        """The serialized factors (this server's one rank's)."""
        if self.serialized_named_tensors is not None:
            return self.serialized_named_tensors[0]
        assert self.serialized_tensors is not None
        return self.serialized_tensors


class UnloadLoraAdapterBody(RequestModel):
    lora_name: str = Field(max_length=256)
