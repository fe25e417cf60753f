"""Routed experts on the wire (R3): which requests may ask, and the two peers' encodings.

The engine captures the routing under ``--enable-return-routed-experts`` (its feature
"routed_experts"); a choice holds its rows (``Choice.routed_experts``). vLLM 0.33 returns them on
every choice while the server captures, as base64 ``.npy`` of ``(num_tokens - 1 - start, layers,
top_k)`` uint8/uint16 from ``sampling_params.routed_experts_prompt_start`` on; SGLang 0.5.23
returns them when a request sets ``return_routed_experts``, as base64 of the raw int32 values
(``(-1, layers, top_k)`` once reshaped) from ``routed_experts_start_len`` on.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from tokenwire.pipeline.errors import InvalidRequest

if TYPE_CHECKING:  # the session store encodes routes too, and the context imports the store
    from tokenwire.pipeline.context import ModelRuntime

FEATURE = "routed_experts"


def captures_routing(runtime: ModelRuntime) -> bool:
    """Whether the served engine captures routed experts."""
    return FEATURE in runtime.engine.features


def check_routing_request(
    runtime: ModelRuntime, prompt_len: int, *, asked: bool, start: int, param: str, start_param: str
) -> None:
    """A request that asks for routing needs an engine that captures it; a start position
    must lie within the prompt (vLLM's and SGLang's rule), checked only while capturing (vLLM
    ignores the field otherwise)."""
    if not captures_routing(runtime):
        if asked:
            raise InvalidRequest(
                f"{param}: this server does not capture routed experts (start it with "
                "--enable-return-routed-experts, on the hf engine, with a mixture-of-experts "
                "model)",
                param,
            )
        return
    if not 0 <= start <= prompt_len:
        raise InvalidRequest(
            f"{start_param} must be between 0 and the prompt length ({prompt_len}), "
            f"inclusive; got {start}",
            start_param,
        )


def routing_start(runtime: ModelRuntime, prompt_lens: Iterable[int], start: int) -> int | None:
    """Where the routing of an OpenAI route's choices starts (vLLM 0.33's
    ``routed_experts_prompt_start``), checked against every prompt; None: the server does not
    capture, and its choices carry none."""
    if not captures_routing(runtime):
        return None
    param = "routed_experts_prompt_start"
    for length in prompt_lens:
        check_routing_request(
            runtime, length, asked=False, start=start, param=param, start_param=param
        )
    return start


def routed_experts_npy(rows: np.ndarray | None) -> str | None:
    """vLLM's ``routed_experts``: ``np.load(io.BytesIO(base64.b64decode(s)))`` reads it back."""
    if rows is None:
        return None
    with io.BytesIO() as buffer:
        np.save(buffer, rows, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def routes_of_npy(value: str) -> np.ndarray:
    """``routed_experts_npy`` read back (the server's own copy of the client's decoder: the
    server does not import the client)."""
    return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)


def routed_experts_int32(rows: np.ndarray | None) -> str | None:
    """SGLang's ``meta_info.routed_experts``: the flat little-endian int32 values, base64."""
    if rows is None:
        return None
    return base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii")
