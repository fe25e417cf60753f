"""RL-loop control: pause and resume around weight reloads, and weight versions.

A trainer pauses the server, loads new weights, names their version and resumes; every output
token carries the version that sampled it. Pause modes are vLLM's: ``abort`` ends requests in
flight now (with their partial tokens), ``wait`` lets them finish, ``keep`` freezes them until
resume (``clear_cache``: they recompute their KV with the weights loaded by then). While paused
by ``abort`` or ``wait`` (or asleep), new requests get a 503 until resume, as in vLLM 0.33;
under ``keep`` they queue. SGLang's pause holds new requests until resume instead (a
bounded number, each until its client leaves). Sleep puts memory tags to sleep (vLLM's
``weights`` and ``kv_cache``, SGLang's also ``cuda_graph``); the server sleeps until every one
is woken.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from tokenwire.engine.base import EngineError, PauseMode, WeightTransferError
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.errors import InvalidRequest, NotReady

PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")
# The memory vLLM's /sleep releases, and SGLang's /release_memory_occupation by default; a
# wake-up (or resume) may name some of them.
VLLM_MEMORY_TAGS = ("weights", "kv_cache")
SGLANG_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
_FLUSH_RETRY_S = 0.05  # between two tries of a flush that waits for the engine
# SGLang's pause modes in vLLM's terms: (mode, drop the kept requests' KV).
SGLANG_PAUSE_MODES: dict[str, tuple[str, bool]] = {
    "abort": ("abort", False),
    "retract": ("keep", True),
    "in_place": ("keep", False),
}


def admit(pipeline: Pipeline) -> None:
    """Refuse a new request while asleep or paused by vLLM's ``abort`` / ``wait``. Under
    SGLang's pause one that got past ``wait_admitted`` queues in the paused engine."""
    pipeline.ready()  # shutting down: a request not yet in the engine never enters it
    state = pipeline.control
    if state.transfer.failed is not None:
        raise NotReady(
            f"The weights are not whole ({state.transfer.failed}); generation waits for a "
            "complete weight update or a checkpoint reload"
        )
    if state.sleeping:
        raise NotReady("The engine is sleeping; wake it up first")
    if state.pause_mode in ("abort", "wait") and not state.holding:
        raise NotReady("The engine is paused; new requests are refused until resume")


async def wait_admitted(pipeline: Pipeline) -> None:
    """Hold a new request while SGLang's /pause_generation lasts, as SGLang does (AReaL gives
    up after three 503s); at most --max-held-requests at once, more get a 503. Cancel it when
    the client leaves: nothing has started yet. ``admit`` then decides as for any request."""
    state = pipeline.control
    while state.holding:
        pipeline.ready()  # woken by a shutdown: a 503, not another wait
        if state.held >= pipeline.config.max_held_requests:
            raise NotReady(
                f"Generation is paused and {state.held} requests already wait for "
                "/continue_generation (--max-held-requests)"
            )
        state.held += 1
        try:
            await state.continued.wait()
        finally:
            state.held -= 1


def is_holding(pipeline: Pipeline) -> bool:
    """Whether new requests wait in ``wait_admitted`` now."""
    return pipeline.control.holding


async def pause(pipeline: Pipeline, mode: str, *, clear_cache: bool = False) -> bool:
    """Pause the engine; return whether it is still paused when the pause is done: a resume
    may overtake a ``wait`` pause while its requests drain (every concurrent caller is
    answered then, and told so)."""
    if mode not in PAUSE_MODES:
        raise InvalidRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
    engine = pipeline.ready().engine
    state = pipeline.control
    resumes = state.resumes
    previous, state.pause_mode = state.pause_mode, mode  # type: ignore[assignment]
    try:
        await engine.pause(mode, clear_cache=clear_cache)  # type: ignore[arg-type]
    except BaseException:
        if state.resumes == resumes:
            state.pause_mode = previous
        raise
    return state.resumes == resumes


async def pause_generation(pipeline: Pipeline, mode: str) -> None:
    """SGLang's pause: requests in flight by ``mode``, new ones held until resume."""
    if mode not in SGLANG_PAUSE_MODES:
        modes = ", ".join(SGLANG_PAUSE_MODES)
        raise InvalidRequest(f"mode must be one of {modes}, got {mode!r}", "mode")
    vllm_mode, clear_cache = SGLANG_PAUSE_MODES[mode]
    state = pipeline.control
    # Before the engine pauses: a request arriving meanwhile must wait, not get a 503.
    holding, state.holding = state.holding, True
    state.continued.clear()
    try:
        await pause(pipeline, vllm_mode, clear_cache=clear_cache)
    except BaseException:
        state.holding = holding
        if not holding:
            state.continued.set()
        raise


async def resume(pipeline: Pipeline) -> None:
    """Resume, unless new weights are half in: then the answer says what completes them."""
    transfer = pipeline.control.transfer
    if transfer.failed is not None:
        raise InvalidRequest(
            f"not resumed: the weights are not whole ({transfer.failed}); send a complete "
            "weight update or reload a checkpoint first"
        )
    if transfer.updating:
        raise InvalidRequest(
            "not resumed: a weight update is in progress; /finish_weight_update first"
        )
    await end_pause(pipeline)


async def end_pause(pipeline: Pipeline) -> None:
    """Resume without the checks of ``resume`` (a weight update lifting its own pause)."""
    await pipeline.ready().engine.resume()
    state = pipeline.control
    state.resumes += 1
    state.pause_mode = None
    state.asleep = frozenset()
    # Last: a held request goes on to ``admit``, which must find the pause over.
    state.holding = False
    state.continued.set()


def is_paused(pipeline: Pipeline) -> bool:
    return pipeline.control.pause_mode is not None


async def sleep(
    pipeline: Pipeline,
    level: int,
    *,
    mode: str = "abort",
    tags: Collection[str] = VLLM_MEMORY_TAGS,
) -> None:
    """vLLM's sleep: requests in flight are paused by ``mode`` (vLLM's default: they end now)
    and new ones are refused until every one of ``tags`` is woken. The hf engine keeps its
    weights in memory at every level (there is no device memory to free)."""
    if level not in (1, 2):
        raise InvalidRequest(f"level must be 1 or 2, got {level}", "level")
    _check_tags(tags)
    await pause(pipeline, mode)
    pipeline.control.asleep |= frozenset(tags)


async def wake_up(pipeline: Pipeline, tags: Collection[str] | None = None) -> None:
    """Wake ``tags`` (None: all); once none sleeps, resume."""
    state = pipeline.control
    if tags is None:
        state.asleep = frozenset()
    else:
        _check_tags(tags)
        state.asleep -= frozenset(tags)
    if not state.asleep:
        await resume(pipeline)


def _check_tags(tags: Collection[str]) -> None:
    unknown = sorted(set(tags) - set(SGLANG_MEMORY_TAGS))
    if unknown:
        raise InvalidRequest(
            f"tags: unknown memory tags {unknown}; known: {', '.join(SGLANG_MEMORY_TAGS)}",
            "tags",
        )


async def flush_cache(pipeline: Pipeline, timeout_s: float = 0.0) -> bool:
    """SGLang's flush: reset the prefix cache, retrying for up to ``timeout_s`` while an engine
    refuses (vLLM's does while running requests hold cached blocks)."""
    engine = pipeline.ready().engine
    deadline = time.monotonic() + timeout_s
    while not await engine.reset_prefix_cache():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_FLUSH_RETRY_S)
    return True


async def abort_requests(pipeline: Pipeline, request_ids: list[str] | None = None) -> int:
    """Abort running requests by id (None or empty: all); return how many were running.

    Aborted requests end with ``finish_reason: "abort"`` and keep the tokens made so far.
    """
    pipeline.ready()
    return len(await pipeline.jobs.abort(request_ids or pipeline.jobs.ids()))


def _checkpoint_path(weight_dir: str) -> Path:
    """The path of a checkpoint directory; a 400 when the OS cannot even look it up (a
    component over 255 bytes, say) rather than the engine's OSError."""
    path = Path(weight_dir)
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass  # the engine says what is missing
    except OSError as exc:
        raise InvalidRequest(
            f"weights not loaded: {weight_dir!r} cannot be looked up: {exc.strerror}",
            "weight_dir",
        ) from exc
    return path


async def load_weights(
    pipeline: Pipeline,
    weight_dir: str,
    version: str | None,
    *,
    abort_all_requests: bool = False,
) -> str:
    """Swap in a checkpoint directory between engine steps; return its version.

    A checkpoint that does not fit the model is a 400 and the old weights stay.
    """
    engine = pipeline.ready().engine
    path = _checkpoint_path(weight_dir)  # before anything is aborted
    if abort_all_requests:
        await abort_requests(pipeline)
    state = pipeline.control
    if version is None:
        version = str(state.reloads + 1)
    try:
        await engine.load_weights(path, version)
    except EngineError as exc:
        raise InvalidRequest(f"weights not loaded: {exc}", "weight_dir") from exc
    except WeightTransferError as exc:  # part of the model holds the new weights
        state.transfer.failed = f"a checkpoint reload broke off: {exc}"
        raise InvalidRequest(
            f"weights not loaded: {exc}; generation is refused until a checkpoint loads whole "
            "(or a complete weight update)",
            "weight_dir",
        ) from exc
    state.reloads += 1
    await weights_whole(pipeline)
    return version


async def weights_whole(pipeline: Pipeline) -> None:
    """Every weight was just replaced (a checkpoint, or a complete transfer): an update that
    broke off is mended, and the pause a weight update took is lifted."""
    transfer = pipeline.control.transfer
    transfer.failed = None
    transfer.updating = False
    transfer.received = set()
    if transfer.paused:
        transfer.paused = False
        await end_pause(pipeline)


async def set_weight_version(
    pipeline: Pipeline, version: str, *, abort_all_requests: bool = False
) -> None:
    engine = pipeline.ready().engine
    if abort_all_requests:
        await abort_requests(pipeline)
    await engine.set_weight_version(version)


def num_paused_requests(pipeline: Pipeline) -> int:
    if not is_paused(pipeline):
        return 0
    stats = pipeline.ready().engine.stats()
    return stats.running + stats.waiting


def load(pipeline: Pipeline) -> int:
    """Requests running or waiting in the engine: what routers balance on."""
    stats = pipeline.ready().engine.stats()
    return stats.running + stats.waiting


def model_info(pipeline: Pipeline) -> dict[str, Any]:
    """SGLang's ``/model_info``."""
    runtime = pipeline.ready()
    return {
        "model_path": pipeline.config.model_root,
        "tokenizer_path": pipeline.config.model_root,
        "is_generation": True,
        "served_model_name": pipeline.config.served_name,
        "weight_version": runtime.engine.weight_version,
        "max_model_len": runtime.max_model_len,
    }
