"""The session store: each session's recorded turns and its head (what the next turn extends),
in SQLite.

One connection, used from one thread (the one writer), in WAL mode: every recorded turn is
committed before its answer is complete, so a restart or a SIGTERM loses none. The store is
bounded: sessions idle longer than the TTL go first, then the least recently updated ones
until the total is under the byte budget (never the session just written).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    turns INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    head BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (
    session_id TEXT NOT NULL,
    turn INTEGER NOT NULL,
    segment INTEGER NOT NULL,
    reason TEXT,
    data BLOB NOT NULL,
    PRIMARY KEY (session_id, turn)
);
CREATE INDEX IF NOT EXISTS sessions_by_update ON sessions (updated);
"""


@dataclass(frozen=True, slots=True)
class Head:
    """What the next turn of a session starts from."""

    turns: int
    segment: int
    token_ids: list[int]  # the last turn's prompt + sampled ids
    messages: list[dict[str, Any]]  # the last turn's chat messages, ending with its reply
    context: str  # tools and template options the ids were rendered with

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "turns": self.turns,
                "segment": self.segment,
                "token_ids": self.token_ids,
                "messages": self.messages,
                "context": self.context,
            }
        )

    @classmethod
    def from_json(cls, data: bytes) -> Head:
        return cls(**orjson.loads(data))


@dataclass(frozen=True, slots=True)
class Turn:
    """One recorded turn: exactly what the engine was given and sampled."""

    segment: int
    reason: str | None  # why this turn starts a new segment (None: it extends the last one)
    data: dict[str, Any]  # prompt_ids, sampled_ids, logprobs, finish_reason, weight_versions


class SessionStore:
    def __init__(self, path: str, *, max_bytes: int, ttl_s: float) -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-store")
        self._db = self._thread.submit(self._open).result()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # with WAL: a killed process loses nothing
        db.executescript(_SCHEMA)
        return db

    async def _call(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    async def head(self, session_id: str) -> Head | None:
        def read() -> Head | None:
            row = self._db.execute(
                "SELECT head FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
            return Head.from_json(row[0]) if row else None

        return await self._call(read)

    async def append(self, session_id: str, turn: Turn, head: Head) -> None:
        """Record ``turn`` as the session's turn ``head.turns - 1`` and make ``head`` its head,
        in one transaction."""
        data = orjson.dumps(turn.data)
        head_json = head.to_json()

        def write() -> None:
            now = time.time()
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT INTO turns VALUES (?, ?, ?, ?, ?)",
                    (session_id, head.turns - 1, turn.segment, turn.reason, data),
                )
                db.execute(
                    "INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE "
                    "SET updated = excluded.updated, turns = excluded.turns, "
                    "bytes = sessions.bytes - length(sessions.head) + excluded.bytes, "
                    "head = excluded.head",
                    (session_id, now, now, head.turns, len(data) + len(head_json), head_json),
                )
                self._evict(session_id, now)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

        await self._call(write)

    def _evict(self, keep: str, now: float) -> None:
        db = self._db
        expired = db.execute(
            "SELECT id FROM sessions WHERE updated < ? AND id != ?", (now - self.ttl_s, keep)
        ).fetchall()
        for (session_id,) in expired:
            self._delete(session_id)
        (total,) = db.execute("SELECT coalesce(sum(bytes), 0) FROM sessions").fetchone()
        oldest = db.execute(
            "SELECT id, bytes FROM sessions WHERE id != ? ORDER BY updated", (keep,)
        )
        for session_id, size in oldest.fetchall():
            if total <= self.max_bytes:
                break
            self._delete(session_id)
            total -= size

    def _delete(self, session_id: str) -> bool:
        self._db.execute("DELETE FROM turns WHERE session_id = ?", (session_id,))
        return self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,)).rowcount > 0

    async def delete(self, session_id: str) -> bool:
        def delete() -> bool:
            with self._db:
                return self._delete(session_id)

        return await self._call(delete)

    async def turns(self, session_id: str) -> list[Turn] | None:
        """The session's turns in order; None for an unknown (or expired) session."""

        def read() -> list[Turn] | None:
            row = self._db.execute(
                "SELECT updated FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
            if row is None or row[0] < time.time() - self.ttl_s:
                return None
            rows = self._db.execute(
                "SELECT segment, reason, data FROM turns WHERE session_id = ? ORDER BY turn",
                (session_id,),
            )
            return [Turn(segment, reason, orjson.loads(data)) for segment, reason, data in rows]

        return await self._call(read)

    async def sessions(self) -> list[dict[str, Any]]:
        def read() -> list[dict[str, Any]]:
            rows = self._db.execute(
                "SELECT id, turns, bytes, created, updated FROM sessions WHERE updated >= ? "
                "ORDER BY updated DESC",
                (time.time() - self.ttl_s,),
            )
            keys = ("id", "turns", "bytes", "created", "updated")
            return [dict(zip(keys, row, strict=True)) for row in rows]

        return await self._call(read)

    def close(self) -> None:
        self._thread.submit(self._db.close).result()
        self._thread.shutdown()
