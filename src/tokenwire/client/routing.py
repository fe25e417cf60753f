"""Routed experts as servers return them, decoded for a trainer's replay (R3).

Row t of the decoded array is the routing of sequence position ``start + t`` (the prompt then
the output ids; the last output id has none, it was never fed): ``[layers, top_k]`` expert ids,
one row per decoder layer, in the order the router ranked them. A trainer forces each layer's
top-k to these ids in its forward of the same sequence, so it routes as the sampler did.
"""

from __future__ import annotations

import base64
import io

import numpy as np


def decode_routed_experts(value: str) -> np.ndarray:
    """vLLM's ``routed_experts`` (base64 ``.npy``): ``[rows, layers, top_k]``, uint8 or
    uint16 as the server sent it."""
    return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)


def decode_sglang_routed_experts(value: str, num_layers: int, top_k: int) -> np.ndarray:
    """SGLang's ``meta_info.routed_experts`` (base64 of flat int32 values): the same rows,
    int32, shaped by the model's ``num_layers`` and ``top_k`` (the wire carries no shape)."""
    flat = np.frombuffer(base64.b64decode(value), dtype="<i4")
    return flat.reshape(-1, num_layers, top_k)
