"""The RL-loop control routes (``--enable-rl-control``) as ``client.control``: pause, load new
weights, name their version, resume; plus the load routers poll.

Only vLLM's and prime-rl's names are here; the server's SGLang aliases do the same things.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from tokenwire.client.calls import Call

T = TypeVar("T")
PauseMode = Literal["abort", "wait", "keep"]


def _key(name: str) -> Callable[[Any], Any]:
    return lambda data: data[name]


def _ignore(_: Any) -> None:
    return None


def pause(mode: PauseMode, clear_cache: bool) -> Call[bool]:
    params = {"mode": mode, "clear_cache": str(clear_cache).lower()}
    # "resumed": a resume overtook a "wait" pause while it drained; the server runs.
    return Call("POST", "/pause", lambda data: data["status"] == "paused", params=params)


def resume() -> Call[None]:
    return Call("POST", "/resume", _ignore)


def is_paused() -> Call[bool]:
    return Call("GET", "/is_paused", _key("is_paused"))


def sleep(level: int) -> Call[None]:
    return Call("POST", "/sleep", _ignore, params={"level": level})


def wake_up() -> Call[None]:
    return Call("POST", "/wake_up", _ignore)


def is_sleeping() -> Call[bool]:
    return Call("GET", "/is_sleeping", _key("is_sleeping"))


def update_weights(weight_dir: str, weight_version: str | None) -> Call[str]:
    body: dict[str, Any] = {"weight_dir": weight_dir}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return Call("POST", "/update_weights", _key("weight_version"), body)


def init_weight_transfer_engine(init_info: dict[str, Any]) -> Call[None]:
    return Call("POST", "/init_weight_transfer_engine", _ignore, {"init_info": init_info})


def start_weight_update() -> Call[None]:
    return Call("POST", "/start_weight_update", _ignore)


def receive_weights(update_info: dict[str, Any]) -> Call[None]:
    return Call("POST", "/update_weights", _ignore, {"update_info": update_info})


def finish_weight_update(weight_version: str | None) -> Call[None]:
    body = {} if weight_version is None else {"weight_version": weight_version}
    return Call("POST", "/finish_weight_update", _ignore, body)


def shutdown_weight_transfer_engine() -> Call[None]:
    return Call("POST", "/shutdown_weight_transfer_engine", _ignore)


def update_weight_version(new_version: str, abort_all_requests: bool) -> Call[None]:
    body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
    return Call("POST", "/update_weight_version", _ignore, body)


def weight_version() -> Call[str]:
    return Call("GET", "/weight_info", _key("weight_version"))


def reset_prefix_cache() -> Call[bool]:
    return Call("POST", "/reset_prefix_cache", _key("success"))


def load() -> Call[int]:
    return Call("GET", "/get_load", _key("load"))


class Control:
    """``client.control`` of the blocking client."""

    def __init__(self, send: Callable[[Call[Any]], Any]) -> None:
        self._send = send

    def pause(self, mode: PauseMode = "abort", *, clear_cache: bool = False) -> bool:
        """``abort``: in-flight requests end now; ``wait``: they finish first; ``keep``: they
        freeze and continue on resume (``clear_cache``: recomputed with the new weights).
        False when a resume overtook a ``wait`` pause: the server is not paused."""
        return self._send(pause(mode, clear_cache))

    def resume(self) -> None:
        self._send(resume())

    def is_paused(self) -> bool:
        return self._send(is_paused())

    def sleep(self, level: int = 1) -> None:
        self._send(sleep(level))

    def wake_up(self) -> None:
        self._send(wake_up())

    def is_sleeping(self) -> bool:
        return self._send(is_sleeping())

    def update_weights(self, weight_dir: str, weight_version: str | None = None) -> str:
        """Load a checkpoint directory; returns the version now serving."""
        return self._send(update_weights(weight_dir, weight_version))

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        self._send(update_weight_version(new_version, abort_all_requests))

    # vLLM's weight-transfer phases (``tokenwire.client.weights.WeightSender`` drives them).

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Answers once the trainer and every server joined the group."""
        self._send(init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        self._send(start_weight_update())

    def receive_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's ``/update_weights {update_info}``: answers once the broadcast is in."""
        self._send(receive_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._send(finish_weight_update(weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        self._send(shutdown_weight_transfer_engine())

    def weight_version(self) -> str:
        return self._send(weight_version())

    def reset_prefix_cache(self) -> bool:
        return self._send(reset_prefix_cache())

    def load(self) -> int:
        """Requests running or waiting (what vllm-router polls)."""
        return self._send(load())


class AsyncControl:
    """``client.control`` of the asyncio client."""

    def __init__(self, send: Callable[[Call[Any]], Awaitable[Any]]) -> None:
        self._send = send

    async def pause(self, mode: PauseMode = "abort", *, clear_cache: bool = False) -> bool:
        return await self._send(pause(mode, clear_cache))

    async def resume(self) -> None:
        await self._send(resume())

    async def is_paused(self) -> bool:
        return await self._send(is_paused())

    async def sleep(self, level: int = 1) -> None:
        await self._send(sleep(level))

    async def wake_up(self) -> None:
        await self._send(wake_up())

    async def is_sleeping(self) -> bool:
        return await self._send(is_sleeping())

    async def update_weights(self, weight_dir: str, weight_version: str | None = None) -> str:
        return await self._send(update_weights(weight_dir, weight_version))

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = False
    ) -> None:
        await self._send(update_weight_version(new_version, abort_all_requests))

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self._send(init_weight_transfer_engine(init_info))

    async def start_weight_update(self) -> None:
        await self._send(start_weight_update())

    async def receive_weights(self, update_info: dict[str, Any]) -> None:
        await self._send(receive_weights(update_info))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._send(finish_weight_update(weight_version))

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._send(shutdown_weight_transfer_engine())

    async def weight_version(self) -> str:
        return await self._send(weight_version())

    async def reset_prefix_cache(self) -> bool:
        return await self._send(reset_prefix_cache())

    async def load(self) -> int:
        return await self._send(load())
