"""Prefix cache: KV of earlier prompts (and of finished outputs) reused by prefill, by token ids.

Keys: a hash chain of fixed-size blocks, as vLLM does. Block ``i`` (tokens ``16i .. 16i+15``)
has the key ``blake2b(key of block i-1 + its ids)``, so one key names the whole prefix up to the
end of its block, and a lookup walks a prompt's keys until the first miss. blake2b, not Python's
``hash``: ids come from clients, and a crafted collision would serve another prompt's KV. A
request's ``cache_salt`` (vLLM's) seeds the chain in place of the empty key, so requests with
different salts never share a block: without one, a client can tell from ``cached_tokens`` (or
timing) whether another sent a prefix, as on vLLM.

Storage: segments. A segment holds, per layer, the keys and values ``[kv_heads, 16 * blocks,
head_dim]`` of consecutive blocks one request added beyond what was cached already, and its
parent (the segment and block its first block follows). The index maps a block key to (segment,
block). A hit is the concatenation along the parent chain. So the n choices of a GRPO group store
their prompt once (and each only its own output blocks), and turn k of a rollout stores only what
turn k-1 did not. Segments are filled after a prefill (the prompt) and when a row leaves the
running batch (prompt and output, minus the last sampled token, whose KV was never computed).

Eviction: least recently used within a byte budget, per segment. A hit touches its path from the
leaf to the root, so a parent is always more recent than its children; evicting a segment evicts
its descendants too (nothing can reach them without it). ``budget_bytes == 0`` disables the cache.

With routing capture on, a segment also holds its tokens' routed experts (``routing``), taken
from the same forward as their KV: a hit returns them with the KV (``routes``).

Only full blocks are kept, and a hit always leaves at least one prompt token to prefill (its
logits sample the first token): at most 16 prompt tokens are recomputed. Prompts with images
bypass the cache (their KV depends on pixels the ids do not name; see the scheduler).
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 16
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [H, T, D]


def salt_key(cache_salt: str | None) -> bytes:
    """What a request's first block chains from: b"" without a salt."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"cache_salt").digest()


def block_keys(
    tokens: Sequence[int], known: Sequence[bytes] = (), salt: bytes = b""
) -> list[bytes]:
    """The keys of every full block of ``tokens``; ``known`` are keys of a prefix of them;
    ``salt`` is the request's ``salt_key``."""
    count = len(tokens) // BLOCK_TOKENS
    keys = list(known[:count])
    prev = keys[-1] if keys else salt
    for i in range(len(keys), count):
        ids = array("q", tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]).tobytes()
        prev = hashlib.blake2b(prev + ids, digest_size=16).digest()
        keys.append(prev)
    return keys


@dataclass(slots=True)
class RowKV:
    """One row's KV in a padded cache: per-layer [rows, H, cols, D] windows and the row's real
    columns in order (token t of the row sits at column ``cols[t]``)."""

    layers: LayerKV
    row: int
    cols: torch.Tensor  # [tokens] long

    @property
    def length(self) -> int:
        return int(self.cols.numel())

    def take(self, start: int, stop: int) -> LayerKV:
        """Copies of tokens ``start .. stop`` of the row, per layer ([H, stop - start, D])."""
        cols = self.cols[start:stop]
        return [
            (k[self.row].index_select(1, cols), v[self.row].index_select(1, cols))
            for k, v in self.layers
        ]


@dataclass(eq=False, slots=True)
class _Segment:
    kv: LayerKV
    keys: list[bytes]
    parent: tuple[_Segment, int] | None  # (segment, index of the block this one follows)
    nbytes: int
    routes: np.ndarray | None  # [16 * blocks, layers, top_k] with routing capture on
    children: list[_Segment] = field(default_factory=list)


class PrefixCache:
    """Blocks of KV by prefix key, LRU within ``budget_bytes`` (see the module docstring).

    Counters (``hits``, ``misses``, ``hit_tokens``, ``evicted_bytes``) and ``bytes`` are plain
    ints the engine publishes as metrics.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("prefix cache budget must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self._index: dict[bytes, tuple[_Segment, int]] = {}
        self._lru: OrderedDict[int, _Segment] = OrderedDict()  # oldest first
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0
        self.evicted_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` are cached (touches nothing)."""
        count = 0
        for key in keys:
            if key not in self._index:
                break
            count += 1
        return count

    def record(self, blocks: int) -> None:
        """Count a lookup that reuses ``blocks`` blocks (0: a miss)."""
        if blocks:
            self.hits += 1
            self.hit_tokens += blocks * BLOCK_TOKENS
        else:
            self.misses += 1

    def fetch(self, keys: Sequence[bytes]) -> LayerKV:
        """The KV of the cached blocks ``keys`` (all must be cached), per layer [H, T, D]."""
        path = self._path(self._index[keys[-1]])
        self._touch(path)
        parts = [
            [
                (k[:, : (upto + 1) * BLOCK_TOKENS], v[:, : (upto + 1) * BLOCK_TOKENS])
                for k, v in seg.kv
            ]
            for seg, upto in reversed(path)
        ]
        if len(parts) == 1:
            return parts[0]
        return [
            (torch.cat([p[i][0] for p in parts], dim=1), torch.cat([p[i][1] for p in parts], dim=1))
            for i in range(len(parts[0]))
        ]

    def routes(self, keys: Sequence[bytes]) -> np.ndarray:
        """The routed experts of the cached blocks ``keys`` (all cached, kept with routes)."""
        parts = []
        for seg, upto in reversed(self._path(self._index[keys[-1]])):
            assert seg.routes is not None, "a block kept without routes under routing capture"
            parts.append(seg.routes[: (upto + 1) * BLOCK_TOKENS])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def stats(self) -> dict[str, int]:
        """The counters, named as the engine's metrics."""
        return {
            "prefix_cache_hits": self.hits,
            "prefix_cache_misses": self.misses,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_bytes": self.bytes,
            "prefix_cache_evicted_bytes": self.evicted_bytes,
        }

    def keep(
        self,
        keys: Sequence[bytes],
        length: int,
        source: Callable[[], RowKV],
        routes: np.ndarray | None = None,
    ) -> None:
        """Store the blocks ``keys`` of a row that holds ``length`` tokens' KV (and, with
        routing capture on, ``routes``: those tokens' routed experts).

        The cache is an optimisation: a row whose KV (or routes) does not have ``length``
        tokens is not kept, and a failed copy (out of memory) is logged and fails no request.
        """
        if not keys or not self.enabled or self.match(keys) == len(keys):
            return
        if routes is not None and len(routes) != length:
            return
        try:
            row = source()
            if row.length == length:
                self._store(keys, row, routes)
        except Exception:
            logger.exception("prefix cache: could not keep a row")

    def _store(self, keys: Sequence[bytes], source: RowKV, routes: np.ndarray | None) -> None:
        """Keep the blocks ``keys`` (of the row in ``source``) that are not cached yet."""
        start = self.match(keys)
        lo, hi = start * BLOCK_TOKENS, len(keys) * BLOCK_TOKENS
        kv = source.take(lo, hi)
        kept_routes = routes[lo:hi].copy() if routes is not None else None
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        nbytes += kept_routes.nbytes if kept_routes is not None else 0
        parent = self._index[keys[start - 1]] if start else None
        path = self._path(parent) if parent is not None else []
        keep = {id(seg) for seg, _ in path}
        for seg in list(self._lru.values()):  # oldest first: leaves (see _touch)
            if self.bytes + nbytes <= self.budget_bytes:
                break
            if id(seg) not in keep:
                self._evict(seg)
        if self.bytes + nbytes > self.budget_bytes:
            return
        segment = _Segment(kv, list(keys[start:]), parent, nbytes, kept_routes)
        if parent is not None:
            parent[0].children.append(segment)
        for i, key in enumerate(segment.keys):
            self._index[key] = (segment, i)
        self._lru[id(segment)] = segment
        self.bytes += nbytes
        self._touch(path)

    @staticmethod
    def _path(node: tuple[_Segment, int]) -> list[tuple[_Segment, int]]:
        """The (segment, last block used) pairs from ``node`` up to the root, leaf first."""
        path: list[tuple[_Segment, int]] = []
        current: tuple[_Segment, int] | None = node
        while current is not None:
            path.append(current)
            current = current[0].parent
        return path

    def _touch(self, path: list[tuple[_Segment, int]]) -> None:
        """Mark a path used, leaf first: every parent stays more recent than its children, so
        the least recently used segment is always a leaf."""
        for seg, _ in path:
            self._lru.move_to_end(id(seg))

    def _evict(self, segment: _Segment) -> None:
        """Drop a segment and everything that follows it."""
        for child in segment.children:
            self._evict(child)
        segment.children.clear()
        if self._lru.pop(id(segment), None) is None:
            return
        for key in segment.keys:
            if self._index.get(key, (None, 0))[0] is segment:
                del self._index[key]
        if segment.parent is not None:
            siblings = segment.parent[0].children
            if segment in siblings:
                siblings.remove(segment)
        self.bytes -= segment.nbytes
        self.evicted_bytes += segment.nbytes

    def clear(self) -> None:
        """Forget every block (a weight reload, ``/reset_prefix_cache``)."""
        self._index.clear()
        self._lru.clear()
        self.bytes = 0
