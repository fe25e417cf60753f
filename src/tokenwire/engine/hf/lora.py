"""LoRA adapters in PEFT's format, served per row of one batch.

An adapter comes from its directory (``adapter_files``: what ``peft``'s ``save_pretrained``
writes; ``read_adapter``) or from a trainer's memory as the same config and tensors;
``check_adapter`` checks it against the model before anything changes. ``AdapterSlots`` keeps
up to ``max_loras`` adapters stacked per target module, and each target ``nn.Linear`` adds
``scaling * B_s A_s x`` for its row's slot ``s`` (slot 0 is the base model: no delta). Several
adapters and the base share one forward that way (the batched gather-matmul vLLM calls punica),
and a new version of an adapter loads into a free slot while rows of the old one finish under
it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenwire import adapter_files
from tokenwire.engine.base import AdapterTensors, WeightsError
from tokenwire.engine.hf.expert_weights import expert_views
from tokenwire.engine.lora_rules import (
    check_config,
    check_factor,
    check_no_expert_targets,
    check_update,
)
from tokenwire.engine.weight_rules import all_finite
from tokenwire.weight_transfer import TensorMeta


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter checked against the model: per target module (the model's module path),
    ``A`` [r, in] and ``B`` [out, r] with the scaling folded into ``B``."""

    rank: int
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def target_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The ``nn.Linear`` modules of the text decoder an adapter may target, by module path
    from the root (as PEFT names them). Not the LM head (prompt scoring projects [positions, H]
    through it without rows) nor a vision tower (other batch shapes)."""
    decoder = {id(m) for m in model.get_decoder().modules()}
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and id(module) in decoder
    }


def read_adapter(path: Path) -> AdapterTensors:
    """A PEFT adapter directory, read into memory (checked by ``check_adapter``)."""
    try:
        return AdapterTensors(adapter_files.read_config(path), adapter_files.read_weights(path))
    except adapter_files.AdapterFileError as exc:
        raise WeightsError(str(exc)) from exc


def check_adapter(
    adapter: AdapterTensors,
    linears: Mapping[str, tuple[int, int]],
    *,
    max_rank: int,
    dtype: torch.dtype,
    experts: Collection[str] = (),
) -> AdapterWeights:
    """Check a PEFT LoRA adapter fits the model (``experts``: the module paths of its fused MoE
    experts, which no factor may target); ``WeightsError`` says why not."""
    config = adapter.config
    check_no_expert_targets(adapter.tensors, experts)
    rank, scaling = check_config(config, max_rank=max_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.tensors.items():
        module, factor = check_factor(key, tuple(tensor.shape), config, rank, linears)
        if not all_finite(tensor):
            raise WeightsError(f"{module}.{factor} holds NaN or infinite values")
        pairs.setdefault(module, {})[factor] = tensor
    if not pairs:
        raise WeightsError("the adapter holds no LoRA factors")
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise WeightsError(f"{module}: needs both lora_A and lora_B, has {sorted(pair)}")
        a, b = pair["lora_A"], pair["lora_B"]
        if config.get("fan_in_fan_out"):
            a, b = a.T, b.T
        b = (b.to(torch.float32) * scaling).to(dtype)
        if not all_finite(b):  # a large alpha overflows the model's dtype
            raise WeightsError(f"{module}.lora_B times the scaling overflows {dtype}")
        factors[module] = (a.to(dtype).contiguous(), b)
    return AdapterWeights(rank=rank, factors=factors)


class AdapterSlots:
    """Up to ``max_loras`` adapters stacked per target linear, and which slot each row of the
    next forward uses (``rows``; ``None`` while every row runs the base model)."""

    def __init__(self, model: torch.nn.Module, *, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.linears = target_linears(model)
        # (in, out) features of each target: what lora_rules checks factors against.
        self.features = {
            name: (linear.in_features, linear.out_features) for name, linear in self.linears.items()
        }
        # A MoE model's fused expert modules: no linear layers, and no LoRA on them.
        self.experts = frozenset(name.rsplit(".", 1)[0] for name in expert_views(model))
        self.rows: torch.Tensor | None = None
        param = next(model.parameters())
        self._device, self._dtype = param.device, param.dtype
        # Stacks per target module, made when an adapter first targets it: slot 0 stays zero.
        self._a: dict[str, torch.Tensor] = {}
        self._b: dict[str, torch.Tensor] = {}
        self._used: dict[int, AdapterWeights] = {}

    def check(self, adapter: AdapterTensors) -> AdapterWeights:
        return check_adapter(
            adapter, self.features, max_rank=self.max_rank, dtype=self._dtype, experts=self.experts
        )

    def read(self, path: Path) -> AdapterWeights:
        return self.check(read_adapter(path))

    def check_update(self, config: Mapping[str, Any], tensors: Sequence[TensorMeta]) -> None:
        """Each tensor a trainer announces is a factor of the model under ``config``."""
        check_update(config, tensors, self.features, max_rank=self.max_rank, experts=self.experts)

    def put(self, slot: int, adapter: AdapterWeights) -> None:
        """Write ``adapter`` into ``slot``, replacing what it held."""
        if slot in self._used:
            self.clear(slot)
        for module, (a, b) in adapter.factors.items():
            if module not in self._a:
                self._install(module)
            r = a.shape[0]
            self._a[module][slot, :r] = a.to(self._device)
            self._b[module][slot, :, :r] = b.to(self._device)
        self._used[slot] = adapter

    def clear(self, slot: int) -> None:
        for module in self._used.pop(slot).factors:
            self._a[module][slot].zero_()
            self._b[module][slot].zero_()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self._a.values(), *self._b.values()))

    def _install(self, module: str) -> None:
        linear = self.linears[module]
        slots = self.max_loras + 1
        kwargs = {"device": self._device, "dtype": self._dtype}
        a = self._a[module] = torch.zeros(slots, self.max_rank, linear.in_features, **kwargs)
        b = self._b[module] = torch.zeros(slots, linear.out_features, self.max_rank, **kwargs)
        # Wrap whatever forward the linear has now (the batch-invariance padding, maybe).
        linear.forward = functools.partial(_lora_forward, linear.forward, self, a, b)


def _lora_forward(
    base: Callable[[torch.Tensor], torch.Tensor],
    slots: AdapterSlots,
    a: torch.Tensor,
    b: torch.Tensor,
    x: torch.Tensor,
) -> torch.Tensor:
    out = base(x)
    rows = slots.rows
    if rows is None:
        return out
    if x.dim() != 3 or x.shape[0] != rows.shape[0]:
        raise RuntimeError(f"adapter rows {tuple(rows.shape)} do not match input {tuple(x.shape)}")
    # [B, T, in] @ [B, in, r] @ [B, r, out]: each row through its own slot's factors.
    low = torch.bmm(x, a.index_select(0, rows).transpose(1, 2))
    return out + torch.bmm(low, b.index_select(0, rows).transpose(1, 2))
