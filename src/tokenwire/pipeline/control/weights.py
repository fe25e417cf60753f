"""The weight lifecycle: the served weights are whole, being updated, or broken, and every change
of them is a transition of this one object, under its one lock.

- **whole**: generation runs on a complete set of weights (``version`` names it).
- **updating**: an update is open (vLLM's ``start_weight_update`` .. ``finish_weight_update``,
  or one of SGLang's one-call updates); generation is paused (``keep``) unless the client had
  paused it. An open update has a deadline: when no call of it came for ``deadline_s``, it is
  abandoned as if the trainer had gone.
- **broken**: some of the model holds new tensors and some old (a broadcast that broke off, an
  update finished or abandoned with weights missing, a checkpoint reload that failed half way);
  generation is refused with the reason until a complete update or a checkpoint reload.

An update that ends before any byte reached the model (refused, abandoned, finished with no
tensors) leaves the weights whole and lifts the pause it took. Version labels are assigned
inside the lock, so two reloads never get the same one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tokenwire.engine.base import (
    Engine,
    EngineError,
    WeightsError,
    WeightTransferError,
    WeightUpdate,
)
from tokenwire.pipeline.control.gate import Gate
from tokenwire.pipeline.errors import InvalidRequest

logger = logging.getLogger(__name__)

WeightState = Literal["whole", "updating", "broken"]
RECOVER = "send a complete update or reload a checkpoint (/update_weights {weight_dir})"


@dataclass(eq=False, slots=True)
class OpenUpdate:
    """An update between its start and its end."""

    took_pause: bool  # the update paused generation itself (lifted when it ends whole)
    deadline: float  # monotonic time after which it is abandoned
    on_abandon: Callable[[], Awaitable[None]] | None  # what its protocol closes then
    received: set[str] = field(default_factory=set)  # model weights written so far
    # Protocol state the update carries (a LoRA adapter's factors gathering, say): dropped
    # with the update.
    staged: Any = None


class WeightLifecycle:
    """The served weights' state and its transitions (see the module docstring).

    Transitions need the lock (``async with weights.locked():``); reads do not."""

    def __init__(self, engine: Callable[[], Engine], gate: Gate, *, deadline_s: float) -> None:
        self._engine = engine
        self._gate = gate
        self.deadline_s = deadline_s
        self._lock = asyncio.Lock()
        self._update: OpenUpdate | None = None
        self._broken: str | None = None
        # The pause an update took, held while the weights are broken.
        self._held_pause = False
        self._reloads = 0  # numbers the versions of reloads that name none
        self._expiry: asyncio.Task[None] | None = None

    # -- what clients read --------------------------------------------------------------------

    @property
    def state(self) -> WeightState:
        if self._broken is not None:
            return "broken"
        return "updating" if self._update is not None else "whole"

    @property
    def broken(self) -> str | None:
        """Why the weights are not whole (None: they are, or an update is open)."""
        return self._broken

    @property
    def update(self) -> OpenUpdate | None:
        return self._update

    def refusal(self) -> str | None:
        """Why generation may not run on these weights now (None: it may)."""
        if self._broken is None:
            return None
        return (
            f"The weights are not whole ({self._broken}); generation waits for a complete "
            "weight update or a checkpoint reload"
        )

    @contextlib.asynccontextmanager
    async def locked(self) -> AsyncIterator[None]:
        async with self._lock:
            yield

    # -- transitions (the caller holds the lock) ----------------------------------------------

    async def reload(self, path: Path, version: str | None) -> str:
        """Swap in a checkpoint directory between engine steps; return its version. One that
        does not fit is a 400 and the old weights stay; one that fails half way breaks them."""
        self._require_lock()
        if self._update is not None:
            raise InvalidRequest(
                "weights not loaded: a weight update is open; finish it, or /resume to end it "
                "(nothing of it has reached the model)"
                if not self._update.received
                else "weights not loaded: a weight update is open; finish it first",
                "weight_dir",
            )
        version = version or str(self._reloads + 1)
        try:
            await self._engine().load_weights(path, version)
        except EngineError as exc:
            raise InvalidRequest(f"weights not loaded: {exc}", "weight_dir") from exc
        except WeightTransferError as exc:  # part of the model holds the new weights
            self._broken = f"a checkpoint reload broke off: {exc}"
            raise InvalidRequest(
                f"weights not loaded: {exc}; generation is refused until a checkpoint loads "
                "whole (or a complete weight update)",
                "weight_dir",
            ) from exc
        self._reloads += 1
        await self._whole()
        return version

    async def set_version(self, version: str) -> None:
        self._require_lock()
        await self._engine().set_weight_version(version)

    async def begin(self, on_abandon: Callable[[], Awaitable[None]] | None = None) -> OpenUpdate:
        """Open an update; pause generation (``keep``) unless it is paused already."""
        self._require_lock()
        if self._update is not None:
            raise InvalidRequest(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        took_pause = not self._gate.paused
        if took_pause:
            await self._gate.pause("keep")
        self._update = OpenUpdate(took_pause, self._next_deadline(), on_abandon)
        self._arm_expiry()
        return self._update

    def open_update(self) -> OpenUpdate:
        """The open update (a 400 when there is none)."""
        if self._update is None:
            raise InvalidRequest(
                "start_weight_update must be called before update_weights.", "update_info"
            )
        return self._update

    def extend_deadline(self) -> None:
        """A call of the open update came: its deadline counts from now."""
        if self._update is not None:
            self._update.deadline = self._next_deadline()

    async def receive(self, update: WeightUpdate, param: str) -> None:
        """Receive tensors (checked by the caller) into the model. ``WeightsError`` passes to
        the caller untouched: the engine refused the call before any of it reached the model."""
        self._require_lock()
        current = self.open_update()
        try:
            await self._engine().receive_weights(update)
        except WeightTransferError as exc:
            self._break(f"an update broke off: {exc}")
            raise InvalidRequest(
                f"weights not updated: {exc}; generation stays paused until you {RECOVER}",
                param,
            ) from exc
        current.received.update(meta.name for meta in update.tensors)
        self.extend_deadline()

    async def copy(self, tensors: dict[str, Any], param: str) -> None:
        """Copy some of the model's weights from memory (checked first: a misfit changes
        nothing)."""
        self._require_lock()
        current = self.open_update()
        try:
            await self._engine().copy_weights(tensors)
        except WeightsError as exc:
            raise InvalidRequest(f"weights not updated: {exc}", param) from exc
        current.received.update(tensors)

    async def finish(self, version: str | None) -> None:
        """End the open update: every weight must have come (or none: then nothing changed)."""
        self._require_lock()
        current = self.open_update()
        if not current.received:
            await self.end()
            raise InvalidRequest(
                "weights not updated: the update carried no tensors; the weights are as "
                "they were and generation goes on",
                "weight_version",
            )
        missing = self._engine().missing_weights(current.received)
        if missing:
            self._break(f"an update finished without {len(missing)} weights")
            raise InvalidRequest(
                f"weights not updated: {len(missing)} of the model's weights were not sent "
                f"({', '.join(missing[:5])}); generation stays paused until you {RECOVER}",
                "weight_version",
            )
        if version is not None:
            await self._engine().set_weight_version(version)
        await self._whole()

    async def end(self, version: str | None = None) -> None:
        """End the open update as it stands: what it wrote is complete as sent (SGLang's
        partial updates), or it wrote nothing. Lifts the pause it took unless the weights are
        broken from before."""
        self._require_lock()
        current = self.open_update()
        self._update = None
        if version is not None and current.received:
            await self._engine().set_weight_version(version)
        if self._broken is None:
            await self._lift(current.took_pause)
        else:  # only a complete update or a checkpoint mends them; keep the pause till then
            self._held_pause = self._held_pause or current.took_pause

    async def abandon(self, reason: str) -> None:
        """End the open update without its trainer: whole as before when nothing reached the
        model, else broken with ``reason``. Its protocol's ``on_abandon`` runs first."""
        self._require_lock()
        current = self.open_update()
        if current.on_abandon is not None:
            await current.on_abandon()
        if current.received:
            self._break(reason)
        else:
            await self.end()

    # -- internals ----------------------------------------------------------------------------

    def _require_lock(self) -> None:
        assert self._lock.locked(), "weight transitions run under WeightLifecycle.locked()"

    def _break(self, reason: str) -> None:
        current, self._update = self._update, None
        self._broken = reason
        self._held_pause = self._held_pause or (current is not None and current.took_pause)

    async def _whole(self) -> None:
        """Every weight was just replaced: a broken state is mended, and the pause an update
        took is lifted."""
        current, self._update = self._update, None
        self._broken = None
        await self._lift(current is not None and current.took_pause)

    async def _lift(self, took_pause: bool) -> None:
        held, self._held_pause = self._held_pause or took_pause, False
        if held:
            await self._gate.lift()

    def _next_deadline(self) -> float:
        return time.monotonic() + self.deadline_s

    def _arm_expiry(self) -> None:
        if self._expiry is None or self._expiry.done():
            self._expiry = asyncio.create_task(self._expire(), name="tokenwire-update-deadline")

    async def _expire(self) -> None:
        """Abandon an open update once its deadline passed with no call of it."""
        while self._update is not None:
            await asyncio.sleep(max(self._update.deadline - time.monotonic(), 0.0))
            async with self._lock:
                current = self._update
                if current is None or time.monotonic() < current.deadline:
                    continue
                reason = f"an update was abandoned: no call of it came for {self.deadline_s:g} s"
                logger.warning("%s", reason)
                try:
                    await self.abandon(reason)
                except Exception:  # the engine is gone: nothing is left to lift
                    logger.exception("abandoning the open weight update failed")
                    self._update = None

    def close(self) -> None:
        """Stop watching deadlines (the server is shutting down)."""
        if self._expiry is not None:
            self._expiry.cancel()
