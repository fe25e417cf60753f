"""Bodies of the routes RL frameworks' own bundled servers add (SkyRL's and skyrl-train's vLLM
servers, AReaL's): each as the framework's released client sends it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from tokenwire.protocol.common import Int64, RequestModel, StrictRequestModel
from tokenwire.protocol.control import (
    Dim,
    InitWeightsUpdateGroupBody,
    LenientPort,
    LoraConfig,
    LoraName,
    PositiveInt,
)


class CollectiveRpcBody(RequestModel):
    """vLLM's ``/collective_rpc`` (dev mode): a worker method by name and its arguments. Only
    the methods ``pipeline.control.frameworks.RPC_METHODS`` names are served; ``kwargs`` are
    checked against that method's own model there. ``timeout`` is accepted: every call here
    is bounded by the weight transfer's own timeout."""

    method: str = Field(max_length=256)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


class SleepForWeightSyncKwargs(StrictRequestModel):
    """SkyRL's ``skyrl_sleep_for_weight_sync``: keep the frozen requests' KV (offload it) or
    drop it."""

    offload_kv: bool = True


class WakeForWeightSyncKwargs(StrictRequestModel):
    """SkyRL's ``skyrl_wake_for_weight_sync``: the allocator tags to wake (None: all)."""

    tags: list[Literal["weights", "kv_cache"]] | None = None


class LoraReceiveTarget(RequestModel):
    """SkyRL's LoRA receive target (``weight_sync/lora_target.py``): the next weight update
    carries this adapter's factors; ``aliases`` maps a factor not sent to the sent one it
    shares (``{public_key: sent_key}``)."""

    kind: Literal["lora"]
    lora_name: LoraName
    adapter_config: LoraConfig
    aliases: dict[str, str] = Field(default_factory=dict)


class SetLoraReceiveTargetKwargs(StrictRequestModel):
    receive_target: LoraReceiveTarget


class DiscardInMemoryLoraKwargs(StrictRequestModel):
    lora_name: LoraName


class FetchWeightsBody(RequestModel):
    """SkyRL's ``/fetch_weights`` (its checkpoint-delta backend): the version to fetch, from
    ``sync_dir`` or ``uri``."""

    target_version: Int64
    sync_dir: str | None = None
    uri: str | None = None


class InitWeightUpdateCommunicatorBody(RequestModel):
    """skyrl-train's vLLM server: ``asdict(BroadcastInitInfo)``. The group is formed as
    SGLang's (``init_custom_process_group``, keyed by ``group_name``)."""

    master_addr: str = Field(min_length=1, max_length=255)
    master_port: LenientPort
    rank_offset: PositiveInt
    world_size: Annotated[int, Field(ge=2, le=65536)]
    group_name: str = Field(min_length=1, max_length=256)
    backend: str
    # skyrl-train's receiver asserts this dtype; here floating dtypes are cast on copy.
    model_dtype_str: str | None = None
    # False: an open group is kept and this init does nothing (skyrl-train's worker).
    override_existing_receiver: bool = True

    def as_group(self) -> InitWeightsUpdateGroupBody:
        """The same group in SGLang's names."""
        return InitWeightsUpdateGroupBody(
            master_address=self.master_addr,
            master_port=self.master_port,
            rank_offset=self.rank_offset,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
        )


class ArealUpdateWeightsBody(RequestModel):
    """AReaL's ``/areal_update_weights``: a checkpoint directory. Its ``load_format`` and
    ``abort_all_requests`` are ignored, as AReaL's server does (it aborts every request in flight
    whatever they say)."""

    model_path: str = Field(min_length=1)


class ArealWeightMetaBody(RequestModel):
    """AReaL's ``/areal_set_update_weight_meta``: the tensors, in broadcast order, that the next
    ``/areal_update_weights_xccl`` receives over group ``group_name`` (AReaL's
    ``UpdateWeightsFromXcclRequest``; its update call then carries ``{}``)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[Dim]]
    group_name: str = Field(min_length=1, max_length=256)


class ArealLoraWeightMetaBody(ArealWeightMetaBody):
    """AReaL's ``/areal_set_update_weight_meta_lora`` and ``/areal_update_weights_lora_xccl``
    (both carry it, its ``UpdateWeightsFromXcclRequestLora``): a LoRA adapter's factors, in
    broadcast order, for the adapter vLLM numbers ``lora_int_id``, served as ``lora_name`` (a
    new name each version, ``<name>-v<N>``) once they came; its adapter config in AReaL's
    fields. ``base_model_name`` is accepted (one base model here)."""

    lora_name: LoraName
    lora_int_id: PositiveInt
    lora_target_modules: list[Annotated[str, Field(max_length=256)]] | str
    lora_rank: PositiveInt
    lora_alpha: int | float
    lora_bias: str = Field(max_length=64)
    base_model_name: str | None = Field(default=None, max_length=4096)

    def lora_config(self) -> dict[str, Any]:
        """The fields as PEFT's ``adapter_config.json`` names them (AReaL's worker builds its
        ``PEFTHelper`` from the same four)."""
        return {
            "peft_type": "LORA",
            "r": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "target_modules": self.lora_target_modules,
            "bias": self.lora_bias,
        }
