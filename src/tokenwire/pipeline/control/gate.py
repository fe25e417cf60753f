"""The gate: whether a new request may start now, and the pause, sleep and hold that decide it.

Pause modes are vLLM's: ``abort`` ends requests in flight now (with their partial tokens),
``wait`` lets them finish, ``keep`` freezes them until resume (``clear_cache``: they recompute
their KV with the weights loaded by then). While paused by ``abort`` or ``wait`` (or asleep),
new requests get a 503 until resume, as in vLLM 0.33; under ``keep`` they queue in the paused
engine. SGLang's pause holds new requests until resume instead (a bounded number, each until
its client leaves). Sleep puts memory tags to sleep (vLLM's ``weights`` and ``kv_cache``,
SGLang's also ``cuda_graph``); the server sleeps until ``weights`` and ``kv_cache`` are both
woken (there are no CUDA graphs here: AReaL's documented wake-up names only those two).
Draining (shutdown) refuses every request not yet in the engine.

The gate is the only writer of this state; ``ControlPlane.admit`` asks it, with the weights'
own answer, once per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection

from tokenwire.engine.base import Engine, PauseMode
from tokenwire.pipeline.errors import InvalidRequest, NotReady

PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")
# The memory vLLM's /sleep releases, and SGLang's /release_memory_occupation by default; a
# wake-up (or resume) may name some of them.
VLLM_MEMORY_TAGS = ("weights", "kv_cache")
SGLANG_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
# What must be awake to serve: memory this server really has.
_AWAKE_TO_SERVE = frozenset(VLLM_MEMORY_TAGS)
# SGLang's pause modes in vLLM's terms: (mode, drop the kept requests' KV).
SGLANG_PAUSE_MODES: dict[str, tuple[PauseMode, bool]] = {
    "abort": ("abort", False),
    "retract": ("keep", True),
    "in_place": ("keep", False),
}


class Gate:
    """Pause, sleep, SGLang's hold and draining; see the module docstring."""

    def __init__(self, engine: Callable[[], Engine], *, max_held_requests: int) -> None:
        self._engine = engine  # the running engine (raises NotReady before it is loaded)
        self._max_held = max_held_requests
        self._pause_mode: PauseMode | None = None
        # Memory tags put to sleep and not woken yet.
        self._asleep: frozenset[str] = frozenset()
        # SGLang's /pause_generation: new requests wait (``_held`` of them now) until
        # ``_continued`` is set by a resume.
        self._holding = False
        self._continued = asyncio.Event()
        self._held = 0
        # Counts resumes, so a pause that a resume overtook (a "wait" still draining) can say so.
        self._resumes = 0
        self._draining = False

    # -- what clients read --------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._pause_mode is not None

    @property
    def sleeping(self) -> bool:
        return bool(self._asleep & _AWAKE_TO_SERVE)

    @property
    def holding(self) -> bool:
        """Whether new requests wait in ``wait_while_held`` now."""
        return self._holding

    @property
    def draining(self) -> bool:
        return self._draining

    def refusal(self) -> str | None:
        """Why a new request may not start now (None: it may)."""
        if self._draining:
            return "The server is shutting down"
        if self.sleeping:
            return "The engine is sleeping; wake it up first"
        if self._pause_mode in ("abort", "wait") and not self._holding:
            return "The engine is paused; new requests are refused until resume"
        return None

    async def wait_while_held(self) -> None:
        """Hold a new request while SGLang's /pause_generation lasts, as SGLang does (AReaL
        gives up after three 503s); at most --max-held-requests at once, more get a 503. The
        caller cancels it when the client leaves: nothing has started yet."""
        while self._holding and not self._draining:
            if self._held >= self._max_held:
                raise NotReady(
                    f"Generation is paused and {self._held} requests already wait for "
                    "/continue_generation (--max-held-requests)"
                )
            self._held += 1
            try:
                await self._continued.wait()
            finally:
                self._held -= 1

    # -- transitions --------------------------------------------------------------------------

    async def pause(self, mode: str, *, clear_cache: bool = False) -> bool:
        """Pause the engine; return whether it is still paused when the pause is done: a resume
        may overtake a ``wait`` pause while its requests drain (every concurrent caller is
        answered then, and told so)."""
        if mode not in PAUSE_MODES:
            modes = ", ".join(PAUSE_MODES)
            raise InvalidRequest(f"mode must be one of {modes}, got {mode!r}", "mode")
        engine = self._engine()
        resumes = self._resumes
        previous, self._pause_mode = self._pause_mode, mode  # type: ignore[assignment]
        try:
            await engine.pause(mode, clear_cache=clear_cache)  # type: ignore[arg-type]
        except BaseException:
            if self._resumes == resumes:
                self._pause_mode = previous
            raise
        return self._resumes == resumes

    async def hold(self, mode: str) -> None:
        """SGLang's pause: requests in flight by ``mode``, new ones held until resume."""
        if mode not in SGLANG_PAUSE_MODES:
            modes = ", ".join(SGLANG_PAUSE_MODES)
            raise InvalidRequest(f"mode must be one of {modes}, got {mode!r}", "mode")
        vllm_mode, clear_cache = SGLANG_PAUSE_MODES[mode]
        # Before the engine pauses: a request arriving meanwhile must wait, not get a 503.
        holding, self._holding = self._holding, True
        self._continued.clear()
        try:
            await self.pause(vllm_mode, clear_cache=clear_cache)
        except BaseException:
            self._holding = holding
            if not holding:
                self._continued.set()
            raise

    async def lift(self) -> None:
        """End every pause, sleep and hold (the caller checked that the weights allow it)."""
        await self._engine().resume()
        self._resumes += 1
        self._pause_mode = None
        self._asleep = frozenset()
        # Last: a held request goes on to admission, which must find the pause over.
        self._holding = False
        self._continued.set()

    async def sleep(self, level: int, *, mode: str, tags: Collection[str]) -> None:
        """vLLM's sleep: requests in flight are paused by ``mode`` (vLLM's default: they end
        now) and new ones are refused until every one of ``tags`` is woken. The hf engine keeps
        its weights in memory at every level (there is no device memory to free)."""
        if level not in (1, 2):
            raise InvalidRequest(f"level must be 1 or 2, got {level}", "level")
        _check_tags(tags)
        await self.pause(mode)
        self._asleep |= frozenset(tags)

    def wake(self, tags: Collection[str] | None) -> bool:
        """Wake ``tags`` (None: all); return whether the server may serve again."""
        if tags is None:
            self._asleep = frozenset()
        else:
            _check_tags(tags)
            self._asleep -= frozenset(tags)
        return not self.sleeping

    def drain(self) -> None:
        """Refuse every request not yet in the engine (503), from now on and those held by
        SGLang's pause now; requests in the engine go on."""
        self._draining = True
        self._continued.set()  # held requests look again, and find the server closing


def _check_tags(tags: Collection[str]) -> None:
    unknown = sorted(set(tags) - set(SGLANG_MEMORY_TAGS))
    if unknown:
        raise InvalidRequest(
            f"tags: unknown memory tags {unknown}; known: {', '.join(SGLANG_MEMORY_TAGS)}",
            "tags",
        )
