"""Processed media items kept between requests, bounded by the bytes their tensors hold.

RL loops send the same images turn after turn; a hit skips the fetch, the decode and the
processor. Items are keyed by content hash; a client ``uuid`` is an alias onto the same entry,
in its own namespace so a uuid can never shadow a content hash. Least recently used entries go
first once the byte budget is exceeded; evicting an entry drops its aliases with it.

One lock guards every operation and nothing inside it blocks, so the cache is safe from the
event loop and from an engine thread alike.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from tokenwire.media.processing import ProcessedMedia


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A consistent snapshot, for /metrics and tests."""

    hits: int
    misses: int
    bytes: int
    items: int
    evictions: int
    max_bytes: int


@dataclass(slots=True)
class _Entry:
    item: ProcessedMedia
    uuids: set[str] = field(default_factory=set)


class MediaCache:
    """LRU of ``ProcessedMedia`` by content hash, with uuid aliases; ``max_bytes=0`` disables."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._uuids: dict[str, str] = {}  # uuid -> content hash
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def get(self, content_hash: str) -> ProcessedMedia | None:
        """The item with this content hash (render's ``mm_hashes`` entry), refreshed as used."""
        with self._lock:
            return self._lookup(content_hash)

    def get_by_uuid(self, uuid: str) -> ProcessedMedia | None:
        """The item a client named with ``uuid`` in an earlier request, refreshed as used."""
        with self._lock:
            content_hash = self._uuids.get(uuid)
            if content_hash is None:
                self._misses += 1
                return None
            return self._lookup(content_hash)

    def put(self, item: ProcessedMedia, *, uuid: str | None = None) -> bool:
        """Store ``item`` under its content hash (and ``uuid``); False when it can never fit.

        An item already cached under the same hash is kept (same bytes, same tensors) and only
        refreshed; a ``uuid`` that named another item is moved to this one.
        """
        with self._lock:
            if item.nbytes > self.max_bytes:
                return False
            entry = self._entries.get(item.content_hash)
            if entry is None:
                entry = _Entry(item)
                self._entries[item.content_hash] = entry
                self._bytes += item.nbytes
            else:
                self._entries.move_to_end(item.content_hash)
            if uuid is not None:
                self._alias(uuid, item.content_hash, entry)
            self._evict_over_budget(keep=item.content_hash)
            return True

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                bytes=self._bytes,
                items=len(self._entries),
                evictions=self._evictions,
                max_bytes=self.max_bytes,
            )

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._uuids.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: object) -> bool:
        """Membership without touching recency or the hit counters."""
        return content_hash in self._entries

    # -- under the lock -----------------------------------------------------------------------

    def _lookup(self, content_hash: str) -> ProcessedMedia | None:
        entry = self._entries.get(content_hash)
        if entry is None:
            self._misses += 1
            return None
        self._entries.move_to_end(content_hash)
        self._hits += 1
        return entry.item

    def _alias(self, uuid: str, content_hash: str, entry: _Entry) -> None:
        previous = self._uuids.get(uuid)
        if previous is not None and previous != content_hash:
            old = self._entries.get(previous)
            if old is not None:
                old.uuids.discard(uuid)
        self._uuids[uuid] = content_hash
        entry.uuids.add(uuid)

    def _evict_over_budget(self, *, keep: str) -> None:
        while self._bytes > self.max_bytes:
            content_hash = next(iter(self._entries))
            if content_hash == keep:  # cannot happen while keep fits, but never drop it
                break
            entry = self._entries.pop(content_hash)
            self._bytes -= entry.item.nbytes
            for uuid in entry.uuids:
                del self._uuids[uuid]
            self._evictions += 1
