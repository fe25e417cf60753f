"""Batch-invariant forwards for seeded requests: a row's logits must not depend on what else runs.

A seed promises the same ids whatever else is in the batch, but a sampled draw lands on the other
side of a CDF boundary when the logits move by ~1e-6. On CPU, batch shape moves them in three
places (measured by ``bench/bench_seed_invariance.py --sources``):

- GEMM rows: torch's CPU sgemm computes rows in blocks (4 here); rows of a partial last block,
  and M = 1 (gemv), take other kernels. Every ``nn.Linear`` pads its rows to a multiple of the
  block that ``gemm_row_block`` probes at load, in forwards that hold a seeded row (free when
  the batch already is a multiple).
- Decode attention: SDPA's reductions over the KV window depend on the window's length (the
  longest row's) and on the row's offset in it. A seeded row's attention is recomputed over
  exactly its own tokens, the same call it gets when it runs alone (``ATTENTION``).
- Prefill padding: a seeded request is prefilled alone (the scheduler's ``_next_group``).

Everything else in a forward (norms, rotary, activations, the sampler's softmax and cumsum) is
per row already. GPUs pick GEMM kernels by shape too; the guarantee is the CPU engine's.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

logger = logging.getLogger(__name__)

# The attention implementation name models are loaded with: SDPA, plus exact rows (see module).
ATTENTION = "tokenwire_sdpa_rows"
# Row blocks tried by the probe; rows are padded to the first whose GEMM rows are invariant.
_ROW_BLOCKS = (1, 2, 4, 8, 16)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    exact_rows: tuple[tuple[int, int], ...] = (),
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """SDPA; in a decode step, each ``(row, length)`` of ``exact_rows`` attends over only its
    last ``length`` columns (its own tokens, left padding excluded), unmasked: what it computes
    when alone, whatever the window."""
    if not exact_rows or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if len(exact_rows) == query.shape[0]:
        out = torch.empty(
            query.shape[0],
            1,
            query.shape[1],
            query.shape[3],
            dtype=query.dtype,
            device=query.device,
        )
    else:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    for row, length in exact_rows:
        k, v = key[row : row + 1, :, -length:], value[row : row + 1, :, -length:]
        out[row], _ = sdpa_attention_forward(module, query[row : row + 1], k, v, None, **kwargs)
    return out, None


def register() -> None:
    """Make ``ATTENTION`` a name transformers accepts (masks built as for SDPA)."""
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def gemm_row_block(device: torch.device) -> int:
    """The smallest row block whose F.linear rows are bitwise the same at any multiple of it and
    any position (1 on non-CPU devices: there is no such guarantee to find)."""
    if device.type != "cpu":
        return 1
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(320, 256, generator=gen)
    x = torch.randn(512, 256, generator=gen)
    for block in _ROW_BLOCKS:
        ref = torch.cat([F.linear(x[i : i + block], weight) for i in range(0, 64, block)])
        sizes = (block, 3 * block, 64, 512)
        if all(torch.equal(F.linear(x[:m], weight)[:64], ref) for m in sizes if m >= 64) and all(
            torch.equal(F.linear(x[:m], weight), ref[:m]) for m in sizes if m < 64
        ):
            return block
    logger.warning("no GEMM row block up to %d is batch-invariant here", _ROW_BLOCKS[-1])
    return _ROW_BLOCKS[-1]


class RowPadding:
    """The switch the runner sets per forward: only a forward with a seeded row pays for padding
    (an unseeded decode alone would otherwise run M = 4 instead of a gemv: -34% tokens/s)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.active = False


def _padded_linear(module: torch.nn.Linear, padding: RowPadding, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    extra = -rows % padding.block if padding.active else 0
    if not extra:
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(extra, flat.shape[-1])])
    return F.linear(flat, module.weight, module.bias)[:rows].view(*x.shape[:-1], -1)


def pad_linear_rows(model: torch.nn.Module, block: int) -> RowPadding:
    """Make every ``nn.Linear`` of ``model`` run its GEMM on a multiple of ``block`` rows while
    the returned switch is active."""
    padding = RowPadding(block)
    if block > 1:
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.forward = functools.partial(_padded_linear, module, padding)
    return padding
