"""PEFT's LoRA rules both engines check an adapter by: which ``adapter_config.json`` fields are
served, and what each factor's name and shape must be for the model's linear layers. The hf
engine checks a whole adapter with them (``engine.hf.lora``); both engines check the factors a
trainer announces before a byte of them is received (``check_update``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from tokenwire.adapter_files import CONFIG_FILE
from tokenwire.engine.base import WeightsError
from tokenwire.weight_transfer import TensorMeta

# PEFT names a module's factors "<prefix><module path>.lora_A.weight" / ".lora_B.weight".
_PEFT_PREFIX = "base_model.model."
# Far beyond any trained alpha, and small enough that the scaling is a float.
_MAX_ALPHA = 1e30
# adapter_config.json fields whose non-default values change the math served here.
_UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    # PEFT's LoRA on a module's parameters (not its forward): a MoE model's fused experts.
    "target_parameters": None,
}


def check_update(
    config: Mapping[str, Any],
    tensors: Sequence[TensorMeta],
    linears: Mapping[str, tuple[int, int]],
    *,
    max_rank: int,
    experts: Collection[str] = (),
) -> None:
    """Each tensor a trainer announces is a floating factor of one of ``linears`` under
    ``config`` (none of ``experts``: see ``check_no_expert_targets``)."""
    check_no_expert_targets((meta.name for meta in tensors), experts)
    rank, _ = check_config(config, max_rank=max_rank)
    for meta in tensors:
        check_factor(meta.name, meta.shape, config, rank, linears)
        if not meta.dtype.is_floating_point:
            raise WeightsError(f"{meta.name}: a LoRA factor is not of dtype {meta.dtype}")


def check_no_expert_targets(keys: Iterable[str], experts: Collection[str]) -> None:
    """No factor targets a mixture-of-experts layer's fused experts (``experts``: their module
    paths, e.g. ``model.layers.0.mlp.experts``): one 3-D tensor per projection holds every
    expert there, so there is no linear layer to add a LoRA delta to. Checked before the
    config, whose other refusals (PEFT's ``target_parameters``, its ``rank_pattern`` for
    converted expert targets) would not say which module is the matter. An adapter names
    experts as PEFT's ``target_parameters`` does on transformers 5
    (``experts.lora_A.weight``, ``experts.base_layer.lora_A.weight``) or per expert as on
    transformers 4 and vLLM (``experts.3.gate_proj.lora_A.weight``)."""
    for key in keys:
        name = key.removeprefix(_PEFT_PREFIX)
        for fused in experts:
            if name.startswith(f"{fused}."):
                raise WeightsError(
                    f"the adapter targets {fused} ({key}): the fused experts of a "
                    "mixture-of-experts layer (one tensor per projection for all experts, no "
                    "linear layers), which LoRA is not served on; an adapter of this model may "
                    "target its linear layers, such as the attention projections"
                )


def check_config(config: Mapping[str, Any], *, max_rank: int) -> tuple[int, float]:
    """An adapter config's rank and scaling, if it is a LoRA this server serves."""
    if config.get("peft_type", "LORA") != "LORA":
        raise WeightsError(f"only LoRA adapters are served, not {config.get('peft_type')!r}")
    for field, default in _UNSUPPORTED.items():
        if config.get(field, default) not in (default, None, {}, [], False, "none"):
            raise WeightsError(f"{CONFIG_FILE}: {field}={config[field]!r} is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise WeightsError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise WeightsError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise WeightsError(f"{CONFIG_FILE}: lora_alpha must be a number")
    # NaN or infinity (or an integer past float's range) would scale every output to garbage.
    if abs(alpha) > _MAX_ALPHA or not math.isfinite(alpha):
        raise WeightsError(f"{CONFIG_FILE}: lora_alpha must be a finite number")
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def check_factor(
    key: str,
    shape: tuple[int, ...],
    config: Mapping[str, Any],
    rank: int,
    linears: Mapping[str, tuple[int, int]],
) -> tuple[str, str]:
    """The (module, ``lora_A``/``lora_B``) a tensor named ``key`` of ``shape`` is, if it fits
    one of ``linears``: the linear layers an adapter may target, by module path, as (in, out)
    features."""
    module, factor = _split_key(key)
    features = linears.get(module)
    if features is None:
        raise WeightsError(f"the adapter targets {module}, which is not a linear of the model")
    in_features, out_features = features
    expected = (rank, in_features) if factor == "lora_A" else (out_features, rank)
    if config.get("fan_in_fan_out"):
        expected = expected[::-1]
    if shape != expected:
        raise WeightsError(
            f"{module}.{factor} has shape {shape}; with r={rank} the model needs {expected}"
        )
    return module, factor


def _split_key(key: str) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A.weight`` -> (``<module>``, ``lora_A``)."""
    name = key.removeprefix(_PEFT_PREFIX)
    for factor in ("lora_A", "lora_B"):
        # PEFT writes ".lora_A.weight" (and ".lora_A.<adapter name>.weight" in some versions).
        head, sep, tail = name.partition(f".{factor}.")
        if sep and tail.endswith("weight"):
            return head, factor
    raise WeightsError(f"{key!r} is not a LoRA factor (lora_A / lora_B)")
