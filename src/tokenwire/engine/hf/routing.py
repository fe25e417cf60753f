"""Routed experts (R3): the experts each MoE layer's router chose, for every token a forward ran.

A trainer replays them (forces each layer's top-k) so its forward routes as the sampler did; a
routing recomputed later, in another batch shape, can differ. So the rows are the ones the
forward that made a position's KV chose, and they live with that KV: in the request's log while
it runs, in the prefix cache beside the blocks it keeps (a hit returns the cached positions'
rows, never a recomputation).

Capture is a forward hook on each router, installed only with ``--enable-return-routed-experts``:
with it off the model runs untouched. Rows are ``[layers, top_k]`` per token, in vLLM's shape:
one row per decoder layer (a dense layer's stays 0), uint8 up to 256 experts, else uint16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenwire.engine.base import EngineError

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def routing_dtype(num_experts: int) -> np.dtype[Any]:
    """vLLM's: the narrowest unsigned type that holds every expert id."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


class RoutingCapture:
    """Records the top-k expert ids each router returns; ``take`` reads the last forward's."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config.get_text_config(decoder=True)
        num_experts = getattr(config, "num_experts", None) or getattr(
            config, "num_local_experts", None
        )
        top_k = getattr(config, "num_experts_per_tok", None)
        routers = _routers(model)
        if not routers or not num_experts or not top_k:
            raise EngineError(
                "--enable-return-routed-experts needs a mixture-of-experts model; "
                f"{type(model).__name__} has no expert routers"
            )
        self.num_layers = int(config.num_hidden_layers)
        self.top_k = int(top_k)
        self.dtype = routing_dtype(int(num_experts))
        self.row_shape = (self.num_layers, self.top_k)  # one token's
        self._ids: list[torch.Tensor | None] = [None] * self.num_layers
        self._sparse = [layer for layer, _ in routers]
        for layer, router in routers:
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int) -> Any:
        def record(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            # Qwen3-MoE's (and Mixtral's) routers return (logits, weights, top-k ids).
            self._ids[layer] = output[-1]

        return record

    def take(self) -> np.ndarray:
        """The last forward's rows, ``[tokens, layers, top_k]``, tokens in the forward's
        flattened (row-major) order."""
        ids = self._ids
        if len(self._sparse) == self.num_layers:
            stacked = torch.stack([ids[i] for i in self._sparse], dim=1)  # type: ignore[misc]
        else:
            first = ids[self._sparse[0]]
            assert first is not None
            stacked = first.new_zeros(first.shape[0], self.num_layers, self.top_k)
            for i in self._sparse:
                stacked[:, i] = ids[i]  # type: ignore[assignment]
        return stacked.cpu().numpy().astype(self.dtype)


def _routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer, router) of each sparse layer: the modules transformers records
    ``router_logits`` from."""
    recorder = getattr(model, "_can_record_outputs", {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    if target is None:
        return []
    found = []
    for name, module in model.named_modules():
        match = _LAYER_INDEX.search(f".{name}.")
        if isinstance(module, target) and match is not None:
            found.append((int(match.group(1)), module))
    return found


@dataclass(slots=True)
class RouteLog:
    """A request's routing rows: position t holds the routing of context position t's KV.

    Rows are sent with the engine's outputs as they come (``unsent``). A recomputed context
    (a pause that dropped KV) keeps the rows already logged, the ones its sampled tokens saw;
    where the recomputation routed differently, the request's KV no longer matches its log and
    is not kept in the prefix cache (``kv_differs``).
    """

    chunks: list[np.ndarray] = field(default_factory=list)
    length: int = 0
    sent: int = 0
    kv_differs: bool = False

    def add(self, position: int, rows: np.ndarray) -> None:
        """Rows of positions ``position ..``; those already logged are only compared."""
        overlap = min(self.length - position, len(rows))
        if overlap > 0:
            if not np.array_equal(self.rows()[position : position + overlap], rows[:overlap]):
                self.kv_differs = True
            rows = rows[overlap:]
        if len(rows):
            self.chunks.append(rows)
            self.length += len(rows)

    def rows(self) -> np.ndarray:
        """Every logged row, ``[length, layers, top_k]`` (only when some are)."""
        if len(self.chunks) > 1:
            self.chunks = [np.concatenate(self.chunks)]
        return self.chunks[0]

    def unsent(self) -> np.ndarray | None:
        """The rows logged since the last call (None: none): read from the last chunks, so a
        step costs its own rows, never a copy of the whole log."""
        need = self.length - self.sent
        if not need:
            return None
        self.sent = self.length
        parts: list[np.ndarray] = []
        for chunk in reversed(self.chunks):
            parts.append(chunk[-need:])
            need -= len(parts[-1])
            if not need:
                break
        return parts[0] if len(parts) == 1 else np.concatenate(parts[::-1])
