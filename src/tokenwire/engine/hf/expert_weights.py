"""MoE expert weights under their checkpoint names as well as transformers' fused ones.

transformers 5 holds a layer's experts as two 3-D parameters (``experts.gate_up_proj``
``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``) and converts on load from the per-expert
names checkpoints use (``experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj``
``[H, I]``), which are also what trainers send and vLLM loads. Each per-expert name is a view
into the fused parameter, so a checkpoint reload or a weight transfer by either name copies into
the model in place.
"""

from __future__ import annotations

import torch


def expert_views(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """For each fused expert parameter (by its state-dict name), its per-expert views by
    checkpoint name."""
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for prefix, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if getattr(module, "is_transposed", False) or not _fused_pair(gate_up, down):
            continue
        assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
        inter = down.shape[2]
        gate_parts: dict[str, torch.Tensor] = {}
        down_parts: dict[str, torch.Tensor] = {}
        for e in range(gate_up.shape[0]):
            gate_parts[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :inter]
            gate_parts[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, inter:]
            down_parts[f"{prefix}.{e}.down_proj.weight"] = down[e]
        fused[f"{prefix}.gate_up_proj"] = gate_parts
        fused[f"{prefix}.down_proj"] = down_parts
    return fused


def _fused_pair(gate_up: object, down: object) -> bool:
    """Qwen3-MoE's layout: ``[E, 2I, H]`` and ``[E, H, I]`` parameters (not a transposed one,
    whose per-expert names would need a transpose)."""
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    experts, two_inter, hidden = gate_up.shape
    return tuple(down.shape) == (experts, hidden, two_inter // 2) and two_inter % 2 == 0
