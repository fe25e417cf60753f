"""One left-padded KV cache for all running sequences, appended in place.

transformers has no public way to join two caches along the batch or to drop rows cheaply, and its
``DynamicCache`` re-concatenates every layer's keys and values on each decode step. This cache
keeps preallocated buffers ``[rows_cap, kv_heads, cols_cap, head_dim]`` per layer and exposes only
a window: rows ``[0, rows)`` and columns ``[start, end)``. Every row's tokens end at column ``end``
(left padding), and a boolean ``mask[row, col]`` says which columns hold real tokens.

- decode: the model writes one column at ``end`` in place (no copy of the past);
- join: a prefilled group is written into free rows, right-aligned at ``end``; when its prompts are
  longer than the window, the window grows to the left (the older rows see padding there);
- drop: a finished row is overwritten by a surviving row from the tail (only that row is copied);
- trim: leading columns that are padding in every row are skipped by moving ``start`` (no copy).

Buffers start zeroed and only ever receive finite keys/values, so masked columns hold finite
garbage and never turn attention into NaN.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _WindowLayer(CacheLayerMixin):
    """One layer's buffers; reads and writes go through the owning cache's window."""

    def __init__(self, owner: PaddedBatchCache) -> None:
        super().__init__()
        self.owner = owner
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("PaddedBatchCache layers are filled by join(), not lazily")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new columns at ``end`` and return the whole window (views, no copy)."""
        o = self.owner
        assert self.kbuf is not None and self.vbuf is not None
        q = key_states.shape[2]
        self.kbuf[: o.rows, :, o.end : o.end + q].copy_(key_states)
        self.vbuf[: o.rows, :, o.end : o.end + q].copy_(value_states)
        self.keys = self.kbuf[: o.rows, :, o.start : o.end + q]
        self.values = self.vbuf[: o.rows, :, o.start : o.end + q]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return -1


class PaddedBatchCache(Cache):
    """The running batch's KV cache and attention mask (see the module docstring)."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self._window_layers = [_WindowLayer(self) for _ in range(num_layers)]
        super().__init__(layers=list(self._window_layers))
        self.device = device
        self.rows = 0
        self.start = 0
        self.end = 0
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)

    @property
    def length(self) -> int:
        """Columns in the window: the longest row's token count (after trimming)."""
        return self.end - self.start

    @property
    def _rows_cap(self) -> int:
        return self.mask.shape[0]

    @property
    def _cols_cap(self) -> int:
        return self.mask.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes the KV buffers hold (their capacity, not the window)."""
        return sum(
            buf.nbytes
            for layer in self._window_layers
            for buf in (layer.kbuf, layer.vbuf)
            if buf is not None
        )

    def window_mask(self, extra: int = 0) -> torch.Tensor:
        """The [rows, length + extra] attention mask; columns past ``end`` must be set first."""
        return self.mask[: self.rows, self.start : self.end + extra]

    def window_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the window's keys and values [rows, kv_heads, length, head_dim] (views)."""
        s, e, n = self.start, self.end, self.rows
        return [
            (layer.kbuf[:n, :, s:e], layer.vbuf[:n, :, s:e])  # type: ignore[index]
            for layer in self._window_layers
        ]

    # -- capacity -----------------------------------------------------------------------------

    def release(self) -> None:
        """Drop every row and the buffers themselves; the next ``join`` allocates afresh.

        Explicit because the layers and the cache refer to each other: left to the collector,
        the buffers of a replaced cache lived until the next full collection (1 GiB per idle
        period of a 64-row batch, measured).
        """
        for layer in self._window_layers:
            layer.kbuf = layer.vbuf = None
            layer.keys = layer.values = None
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.rows = self.start = self.end = 0

    def _realloc(self, rows_cap: int, cols_cap: int, offset: int = 0) -> None:
        """Move the window into fresh zeroed buffers at column ``offset`` (the only full copy)."""
        n, length = self.rows, self.length
        mask = torch.zeros(rows_cap, cols_cap, dtype=torch.bool, device=self.device)
        mask[:n, offset : offset + length] = self.mask[:n, self.start : self.end]
        self.mask = mask
        for layer in self._window_layers:
            for name in ("kbuf", "vbuf"):
                old: torch.Tensor = getattr(layer, name)
                new = old.new_zeros(rows_cap, old.shape[1], cols_cap, old.shape[3])
                new[:n, :, offset : offset + length] = old[:n, :, self.start : self.end]
                setattr(layer, name, new)
        self.start, self.end = offset, offset + length

    def reserve(self, new_cols: int) -> None:
        """Make room for ``new_cols`` more columns at ``end`` (growth is geometric)."""
        if self.end + new_cols <= self._cols_cap:
            return
        need = self.length + new_cols
        self._realloc(self._rows_cap, max(need + 64, int(need * 1.5)))

    def begin_decode(self) -> torch.Tensor:
        """Open column ``end`` for every row and return the mask the decode forward needs."""
        self.reserve(1)
        self.mask[: self.rows, self.end] = True
        return self.window_mask(1)

    def commit(self, new_cols: int) -> None:
        """Advance ``end`` once a forward has written ``new_cols`` columns in every layer."""
        self.end += new_cols

    # -- rows -----------------------------------------------------------------------------------

    def join(
        self, layers_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, rows_cap: int
    ) -> None:
        """Append a prefilled group (its own left-padded cache and [n, P] mask) as new rows.

        ``rows_cap`` bounds how many rows the buffers may be sized for (max_num_seqs).
        """
        n, p = mask.shape
        if len(layers_kv) != len(self._window_layers):
            raise ValueError("prefill cache has a different number of layers")
        if self._window_layers[0].kbuf is None:
            for layer, (k, v) in zip(self._window_layers, layers_kv, strict=True):
                layer.kbuf = k.new_zeros(0, k.shape[1], 0, k.shape[3])
                layer.vbuf = v.new_zeros(0, v.shape[1], 0, v.shape[3])
        if self.rows == 0:  # empty: reuse the buffers, the group's columns end at p
            self.start = self.end = p if p <= self._cols_cap else 0
        grow_left = max(0, p - self.length)
        new_rows = self.rows + n
        if new_rows > self._rows_cap or grow_left > self.start:
            rows = self._rows_cap
            if new_rows > rows:
                rows = max(new_rows, min(rows_cap, max(8, 2 * rows)))
            new_len = self.length + grow_left
            cols = max(self._cols_cap, new_len + 64, int(new_len * 1.25))
            self._realloc(rows, cols, offset=grow_left)
        self.start -= grow_left
        self.mask[: self.rows, self.start : self.start + grow_left] = False
        r0, c0 = self.rows, self.end - p
        self.mask[r0:new_rows, self.start : self.end] = False
        self.mask[r0:new_rows, c0 : self.end] = mask
        for layer, (k, v) in zip(self._window_layers, layers_kv, strict=True):
            assert layer.kbuf is not None and layer.vbuf is not None
            layer.kbuf[r0:new_rows, :, c0 : self.end] = k
            layer.vbuf[r0:new_rows, :, c0 : self.end] = v
        self.rows = new_rows

    def drop(self, rows: list[int]) -> list[tuple[int, int]]:
        """Remove rows; returns the (source, destination) moves the caller must mirror."""
        if not rows:
            return []
        gone = set(rows)
        keep = self.rows - len(gone)
        holes = [r for r in sorted(gone) if r < keep]
        sources = [r for r in range(keep, self.rows) if r not in gone]
        moves = list(zip(sources, holes, strict=True))
        if moves:
            src = torch.tensor(sources, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            s, e = self.start, self.end
            self.mask[dst, s:e] = self.mask[src, s:e]
            for layer in self._window_layers:
                for buf in (layer.kbuf, layer.vbuf):
                    assert buf is not None
                    buf[dst, :, s:e] = buf[src, :, s:e]
        self.rows = keep
        if keep == 0:
            self.start = self.end = 0
        else:
            self.trim()
        return moves

    def trim(self) -> None:
        """Skip leading columns that are padding in every row (moves ``start``, copies nothing)."""
        if self.rows == 0 or self.length == 0:
            return
        used = self.window_mask().any(dim=0)
        first = int(used.to(torch.int8).argmax().item())
        self.start += first
