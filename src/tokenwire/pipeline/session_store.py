"""The session store: each session's recorded turns, its head (what the next turn extends) and
its owner, in SQLite. The one owner of a session's state: a turn proposes what it ran, the
store decides in one transaction which turn and segment it is, or why it is not recorded.

One connection, used from one thread (the one writer), in WAL mode: every recorded turn is
committed before its answer is complete, so a restart or a SIGTERM loses none. The store is
bounded: a session that would grow past ``max_session_bytes`` is closed to appends (so it never
evicts every other one); otherwise sessions idle longer than the TTL go first, then the least
recently updated ones until the total is under the byte budget (never the session just written).
A session belongs to the credential that created it (kept as a hash): only that credential, or
the control key, reads, lists, appends to or deletes it; to anyone else it does not exist.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson

from tokenwire.pipeline.errors import SessionClosed, UnknownSession
from tokenwire.pipeline.routing import routed_experts_npy

T = TypeVar("T")
logger = logging.getLogger("tokenwire.sessions")

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
# Columns added since the first schema; a store written before them gets them on open (a
# session recorded without an owner is the control key's alone).
_ADDED_COLUMNS = {"owner": "TEXT", "closed": "TEXT"}

RACED = "another request of this session was recorded while this one ran"
REMOVED = "the session was deleted, expired or evicted while this turn ran"
TAKEN = "another credential started a session of this id while this turn ran"


@dataclass(frozen=True, slots=True)
class Owner:
    """Who asks: the hash of the credential it holds, and whether that is the control key
    (which sees every session)."""

    digest: str | None
    control: bool

    @classmethod
    def of(cls, credential: bytes | None, *, control: bool) -> Owner:
        if credential is None:
            return cls(None, control)
        # Salted with a fixed label, so the stored hash is of no use as another system's key.
        return cls(hashlib.sha256(b"tokenwire session owner\0" + credential).hexdigest(), control)

    def may(self, owner: str | None) -> bool:
        return self.control or (self.digest is not None and self.digest == owner)


@dataclass(frozen=True, slots=True)
class Head:
    """What the next turn of a session starts from."""

    turns: int
    segment: int
    token_ids: list[int]  # the last turn's prompt + sampled ids
    messages: list[dict[str, Any]]  # the last turn's chat messages, ending with its reply
    context: str  # tools and template options the ids were rendered with
    # The last answer's id (chatcmpl-, msg_, resp_): what Anthropic's ``thread`` and Responses'
    # ``previous_response_id`` name to continue from it.
    reply_id: str | None = None
    # When the session was created: a session deleted and made anew under the same id while a
    # turn ran is not the one that turn continues. Not stored in the head (the row has it).
    created: float = field(default=0.0, compare=False)

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "turns": self.turns,
                "segment": self.segment,
                "token_ids": self.token_ids,
                "messages": self.messages,
                "context": self.context,
                "reply_id": self.reply_id,
            }
        )

    @classmethod
    def from_json(cls, data: bytes, created: float) -> Head:
        return cls(**orjson.loads(data), created=created)


@dataclass(frozen=True, slots=True)
class Turn:
    """One recorded turn: exactly what the engine was given and sampled."""

    segment: int
    reason: str | None  # why this turn starts a new segment (None: it extends the last one)
    data: dict[str, Any]  # prompt_ids, sampled_ids, logprobs, finish_reason, weight_versions


@dataclass(frozen=True, slots=True)
class NewTurn:
    """A turn that ran, as its request built it; the store decides where it goes."""

    based_on: Head | None  # the head its prompt continued (None: the session was new)
    segment: int
    reason: str | None  # why its prompt did not extend ``based_on`` (None: it did)
    prompt_ids: list[int]
    sampled_ids: list[int]
    data: dict[str, Any]  # dialect, sampled_ids, logprobs, finish_reason, weight_versions
    messages: list[dict[str, Any]]  # the request's messages and the reply it got
    context: str
    reply_id: str  # the answer's id
    # The routed experts of its prompt and sampled ids (but the last), with routing capture on.
    routes: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class Recorded:
    """Where a turn went: its index, or why it was not recorded (the answer says so)."""

    turn: int | None
    unrecorded: str | None = None


@dataclass(frozen=True, slots=True)
class Stored:
    """A session as ``GET /v1/sessions/{id}`` reads it."""

    turns: list[Turn]
    closed: str | None  # why it takes no more turns (None: it does)


class SessionStore:
    def __init__(
        self, path: str, *, max_bytes: int, ttl_s: float, max_session_bytes: int | None = None
    ) -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        self.max_session_bytes = max_session_bytes or max_bytes
        self.ttl_s = ttl_s
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-store")
        self._db = self._thread.submit(self._open).result()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # with WAL: a killed process loses nothing
        db.executescript(_SCHEMA)
        present = {row[1] for row in db.execute("PRAGMA table_info(sessions)")}
        for column, kind in _ADDED_COLUMNS.items():
            if column not in present:
                db.execute(f"ALTER TABLE sessions ADD COLUMN {column} {kind}")
        return db

    async def _call(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    def _live(self, session_id: str, owner: Owner) -> tuple[Any, ...] | None:
        """The session's row (created, head, closed) if it exists for ``owner`` and has not
        expired; None otherwise (another credential's session does not exist for it)."""
        row = self._db.execute(
            "SELECT created, updated, head, closed, owner FROM sessions WHERE id = ?",
            (session_id,),
        ).fetchone()
        if row is None or row[1] < time.time() - self.ttl_s or not owner.may(row[4]):
            return None
        return row[0], row[2], row[3]

    async def head(self, session_id: str, owner: Owner) -> Head | None:
        """What ``owner``'s next turn of the session continues (None: the session is new).
        Another credential's session is a 404; a closed one a 409."""

        def read() -> Head | None:
            row = self._db.execute(
                "SELECT created, updated, head, closed, owner FROM sessions WHERE id = ?",
                (session_id,),
            ).fetchone()
            if row is None or row[1] < time.time() - self.ttl_s:
                return None  # an expired session is replaced when this turn is recorded
            created, _, head, closed, session_owner = row
            if not owner.may(session_owner):
                raise UnknownSession(
                    f"session {session_id!r} belongs to another API key", "X-Session-ID"
                )
            if closed is not None:
                raise SessionClosed(
                    f"session {session_id!r} takes no more turns: {closed}", "X-Session-ID"
                )
            return Head.from_json(head, created)

        return await self._call(read)

    async def record(self, session_id: str, owner: Owner, turn: NewTurn) -> Recorded:
        """Record ``turn`` as the session's next turn and make it the head, in one transaction;
        a store that fails (a full disk) leaves the session as it was and says why."""

        def write() -> Recorded:
            try:
                return self._transaction(lambda: self._record(session_id, owner, turn))
            except sqlite3.Error as exc:
                return Recorded(None, f"the session store failed: {exc}")

        recorded = await self._call(write)
        if recorded.unrecorded is not None:
            logger.warning("session %r: turn not recorded: %s", session_id, recorded.unrecorded)
        return recorded

    def _transaction(self, work: Callable[[], T]) -> T:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            result = work()
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # SQLite rolls back itself on some errors (a full disk)
                db.execute("ROLLBACK")
            raise
        return result

    def _record(self, session_id: str, owner: Owner, turn: NewTurn) -> Recorded:
        db = self._db
        now = time.time()
        row = db.execute(
            "SELECT created, updated, turns, bytes, length(head), owner, closed FROM sessions "
            "WHERE id = ?",
            (session_id,),
        ).fetchone()
        if row is not None and row[1] < now - self.ttl_s:
            self._delete(session_id)
            row = None
        based = turn.based_on
        if based is not None and (row is None or row[0] != based.created):
            return Recorded(None, REMOVED)
        if row is not None and not owner.may(row[5]):
            return Recorded(None, TAKEN)
        if row is not None and row[6] is not None:
            return Recorded(None, f"the session takes no more turns: {row[6]}")
        turns = row[2] if row is not None else 0
        segment, reason = turn.segment, turn.reason
        extends = based is not None and reason is None
        if turns != (based.turns if based is not None else 0):
            # Another turn was recorded since this one's prompt was built: this one does not
            # extend it, so it stands in a segment of its own.
            (last,) = db.execute(
                "SELECT segment FROM turns WHERE session_id = ? AND turn = ?",
                (session_id, turns - 1),
            ).fetchone()
            segment, reason, extends = last + 1, RACED, False
        # A turn that extends the head stores only what its prompt adds (a long episode would
        # otherwise store its context once per turn); the trajectory puts the prefix back.
        prompt: dict[str, list[int]] = {"prompt_ids": turn.prompt_ids}
        if extends:
            assert based is not None
            prompt = {"prompt_tail": turn.prompt_ids[len(based.token_ids) :]}
        routing: dict[str, Any] = {}
        if turn.routes is not None:
            # Likewise its routing: the rows from the head's last sampled id on (the first
            # position the previous turn has no row for), vLLM's routed_experts_prompt_start.
            start = len(based.token_ids) - 1 if extends and based is not None else 0
            routing = {
                "routed_experts": routed_experts_npy(turn.routes[start:]),
                "routed_experts_start": start,
            }
        data = orjson.dumps({**prompt, **turn.data, **routing})
        token_ids = [*turn.prompt_ids, *turn.sampled_ids]
        head = Head(turns + 1, segment, token_ids, turn.messages, turn.context, turn.reply_id)
        head_json = head.to_json()
        size = (row[3] - row[4] if row is not None else 0) + len(data) + len(head_json)
        if size > self.max_session_bytes:
            closed = (
                f"it would hold {size} bytes, over the bound of {self.max_session_bytes} on one "
                "session (--session-max-bytes); read it, then delete it or start another"
            )
            if row is not None:
                db.execute("UPDATE sessions SET closed = ? WHERE id = ?", (closed, session_id))
            return Recorded(None, f"the session takes no more turns: {closed}")
        db.execute(
            "INSERT INTO turns VALUES (?, ?, ?, ?, ?)", (session_id, turns, segment, reason, data)
        )
        db.execute(
            "INSERT INTO sessions (id, created, updated, turns, bytes, head, owner) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE "
            "SET updated = excluded.updated, turns = excluded.turns, bytes = excluded.bytes, "
            "head = excluded.head",
            (session_id, now, now, turns + 1, size, head_json, owner.digest),
        )
        self._evict(session_id, now)
        return Recorded(turns)

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

    async def delete(self, session_id: str, owner: Owner) -> bool:
        """Delete ``owner``'s session; False when it has none of this id (or it expired, and
        is deleted now). Deleting writes no new pages: it works on a full disk, and the
        pages it frees take the next turns."""

        def delete() -> bool:
            found = self._live(session_id, owner) is not None
            if found or self._expired(session_id):
                self._delete(session_id)
            return found

        return await self._call(lambda: self._transaction(delete))

    def _expired(self, session_id: str) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM sessions WHERE id = ? AND updated < ?",
            (session_id, time.time() - self.ttl_s),
        ).fetchone()
        return row is not None

    async def stored(self, session_id: str, owner: Owner) -> Stored | None:
        """The session's turns in order; None for an unknown, expired or other's session."""

        def read() -> Stored | None:
            live = self._live(session_id, owner)
            if live is None:
                return None
            rows = self._db.execute(
                "SELECT segment, reason, data FROM turns WHERE session_id = ? ORDER BY turn",
                (session_id,),
            )
            turns = [Turn(segment, reason, orjson.loads(data)) for segment, reason, data in rows]
            return Stored(turns, live[2])

        return await self._call(read)

    async def sessions(self, owner: Owner) -> list[dict[str, Any]]:
        """``owner``'s live sessions (every one, for the control key), the latest first."""

        def read() -> list[dict[str, Any]]:
            rows = self._db.execute(
                "SELECT id, turns, bytes, created, updated, closed, owner FROM sessions "
                "WHERE updated >= ? ORDER BY updated DESC",
                (time.time() - self.ttl_s,),
            )
            keys = ("id", "turns", "bytes", "created", "updated", "closed")
            return [dict(zip(keys, row[:-1], strict=True)) for row in rows if owner.may(row[-1])]

        return await self._call(read)

    def close(self) -> None:
        self._thread.submit(self._db.close).result()
        self._thread.shutdown()
