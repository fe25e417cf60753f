"""Read-only answers about the server: vLLM's ``/server_info``, SGLang's ``/model_info``,
the models list.

``/server_info`` is the resolved configuration, in ``VllmConfig``'s JSON shape.

TRL's trainers read it first (``vllm_config.model_config.dtype`` for the weights they send,
the weight-transfer config); vLLM serves it in dev mode, tokenwire with the RL control routes.
Only what tokenwire can state is filled in, under vLLM's section and field names: one process
(as ``/get_world_size`` says), LoRA's limits when it is on, no speculative decoding, and the
weight-transfer config as ``--weight-transfer-config`` gave it (null without the flag).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # the pipeline composes the control plane
    from tokenwire.pipeline.context import Pipeline

ConfigFormat = Literal["text", "json"]


def server_info(pipeline: Pipeline, config_format: ConfigFormat) -> dict[str, Any]:
    """vLLM's answer: ``vllm_config`` as a JSON object, or as one line of text (its default)."""
    config = vllm_config(pipeline)
    return {
        "vllm_config": config if config_format == "json" else _as_text(config),
        # vLLM lists its VLLM_* variables and collect_env's report; tokenwire reads neither.
        "vllm_env": {},
        "system_env": {},
    }


def vllm_config(pipeline: Pipeline) -> dict[str, Any]:
    runtime = pipeline.ready()
    engine = runtime.engine
    serving = pipeline.config
    return {
        "model_config": {
            "model": serving.model_root,
            "served_model_name": serving.served_name,
            "tokenizer": serving.model_root,
            "skip_tokenizer_init": False,
            "dtype": engine.dtype,
            "max_model_len": runtime.max_model_len,
            "max_logprobs": serving.max_logprobs,
            "logprobs_mode": serving.logprobs_mode,
        },
        "parallel_config": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "world_size": 1,
        },
        "scheduler_config": {
            "max_num_seqs": engine.stats().max_num_seqs,
            "max_model_len": runtime.max_model_len,
        },
        "lora_config": (
            {"max_loras": serving.max_loras, "max_lora_rank": serving.max_lora_rank}
            if serving.max_loras
            else None
        ),
        "speculative_config": None,
        "weight_transfer_config": pipeline.control.transfer.config_json(),
    }


def _as_text(config: dict[str, Any]) -> str:
    """``name=value, ...`` over every field, as ``str(VllmConfig)`` reads."""
    fields: list[str] = []
    for name, value in config.items():
        items = value.items() if isinstance(value, dict) else [(name, value)]
        fields += [f"{key}={item!r}" for key, item in items]
    return ", ".join(fields)


def model_info(pipeline: Pipeline) -> dict[str, Any]:
    """SGLang's ``/model_info``."""
    runtime = pipeline.ready()
    return {
        "model_path": pipeline.config.model_root,
        "tokenizer_path": pipeline.config.model_root,
        "is_generation": True,
        "served_model_name": pipeline.config.served_name,
        "weight_version": runtime.engine.weight_version,
        "max_model_len": runtime.max_model_len,
    }


def models(pipeline: Pipeline, created: int) -> list[dict[str, Any]]:
    """``/v1/models``' entries: each served name, then each loaded LoRA adapter."""
    runtime = pipeline.ready()
    config = pipeline.config

    def entry(name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "tokenwire",
            "root": root,
            "parent": parent,
            "max_model_len": runtime.max_model_len,
        }

    adapters = pipeline.control.adapters.loaded.values()
    return [entry(name, config.model_root, None) for name in config.model_names] + [
        entry(adapter.name, adapter.path, config.served_name) for adapter in adapters
    ]
