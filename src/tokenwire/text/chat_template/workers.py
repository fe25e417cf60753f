"""Request templates render in worker processes: a hostile one cannot stall or exhaust the server.

A thread would not do: MiniJinja holds the GIL for a whole render (a 100 MB ``replace`` blocks
the event loop as long in a thread as inline), and nothing in-process can stop a render or
bound its memory. So the server keeps ``workers`` small processes (``worker``), each rendering
one template at a time; a request waits for a free one (bounded concurrency). A render that is
not back within ``timeout_s`` gets its worker killed (and replaced on next use); each worker's
address space may grow by ``memory_bytes`` at most (a worker that dies of it is replaced too);
rendered text and each amplifying filter's result are capped at ``max_chars`` (``caps``). The
server's own template is trusted and fast and renders in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tokenwire.abandonable import run_abandonable

from .errors import MEMORY_CAP, ChatTemplateError, TemplateLimitExceeded

logger = logging.getLogger("tokenwire.chat_template")

_START_TIMEOUT_S = 120.0  # a worker's imports, on a busy machine
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # holds the ``tokenwire`` package


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    """The ``--request-template-*`` flags, resolved once at start-up."""

    workers: int = 2
    timeout_s: float = 5.0
    max_chars: int = 4 * 2**20
    memory_bytes: int = 2**30

    def __post_init__(self) -> None:
        for name in ("workers", "timeout_s", "max_chars", "memory_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"request template {name} must be positive")


class TemplateCompileError(ChatTemplateError):
    """The request's template did not compile (the client's ``chat_template`` is at fault)."""


class RequestTemplateWorkers:
    """The worker processes of one server; ``start`` at start-up, ``aclose`` at shutdown."""

    def __init__(self, limits: TemplateLimits, special_tokens: Mapping[str, str]) -> None:
        self.limits = limits
        self._setup = {
            "special_tokens": dict(special_tokens),
            "max_chars": limits.max_chars,
            "memory_bytes": limits.memory_bytes,
            "timeout_s": limits.timeout_s,
        }
        # JSON escapes a character in at most 12 ASCII bytes (a surrogate pair).
        self._max_reply_bytes = 12 * limits.max_chars + 2**16
        self._idle: asyncio.Queue[asyncio.subprocess.Process | None] = asyncio.Queue()
        for _ in range(limits.workers):
            self._idle.put_nowait(None)  # None: start one when it is first needed

    async def start(self) -> None:
        """Start every worker now, so start-up failures show at once and requests find them."""
        slots = [self._idle.get_nowait() for _ in range(self.limits.workers)]
        try:
            slots = list(await asyncio.gather(*(self._spawn() for _ in slots)))
        finally:
            for slot in slots:
                self._idle.put_nowait(slot)

    async def aclose(self) -> None:
        while not self._idle.empty():
            process = self._idle.get_nowait()
            if process is not None:
                await _kill(process)

    async def render(
        self,
        source: str,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: dict[str, Any],
    ) -> str:
        """The rendered text; ``TemplateCompileError`` / ``ChatTemplateError`` (both 400s)."""
        request = {
            "source": source,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "template_kwargs": template_kwargs,
        }
        try:
            frame = await run_abandonable(lambda: encode_frame(request))
        except (TypeError, ValueError) as exc:
            raise ChatTemplateError(f"Chat template inputs are not JSON: {exc}") from None
        process = await self._idle.get()
        try:
            if process is None or process.returncode is not None:
                process = await self._spawn()
            reply = await self._call(process, frame)
        except BaseException:
            # Timed out, died, or the request was cancelled mid-render: the worker's state is
            # unknown (its answer would reach the next request), so it goes.
            if process is not None:
                await _kill(process)
            process = None
            raise
        finally:
            self._idle.put_nowait(process)
        if "text" in reply:
            return str(reply["text"])
        stage = reply.get("stage")
        error = {"compile": TemplateCompileError, "limit": TemplateLimitExceeded}.get(
            stage, ChatTemplateError
        )
        raise error(str(reply.get("error")))

    async def _call(self, process: asyncio.subprocess.Process, frame: bytes) -> dict[str, Any]:
        assert process.stdin is not None and process.stdout is not None
        timeout_s = self.limits.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                process.stdin.write(frame)
                await process.stdin.drain()
                header = await process.stdout.readexactly(8)
                size = int.from_bytes(header, "big")
                if size > self._max_reply_bytes:
                    raise TemplateLimitExceeded(
                        f"request template over the output cap of {self.limits.max_chars} "
                        "characters (--request-template-max-chars)"
                    )
                payload = await process.stdout.readexactly(size)
        except TimeoutError:
            raise TemplateLimitExceeded(
                f"request template over the time cap of {timeout_s:g} s "
                "(--request-template-timeout-s)"
            ) from None
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await process.wait()
            logger.warning("a request template worker ended while rendering (exit %s)", code)
            raise TemplateLimitExceeded(MEMORY_CAP) from None
        return await run_abandonable(lambda: json.loads(payload))

    async def _spawn(self) -> asyncio.subprocess.Process:
        path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tokenwire.text.chat_template.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )
        assert process.stdin is not None and process.stdout is not None
        try:
            async with asyncio.timeout(_START_TIMEOUT_S):
                process.stdin.write(encode_frame(self._setup))
                await process.stdin.drain()
                size = int.from_bytes(await process.stdout.readexactly(8), "big")
                ready = json.loads(await process.stdout.readexactly(size))
            if ready != {"ready": True}:
                raise RuntimeError(f"unexpected answer {ready!r}")
        except BaseException as exc:
            await _kill(process)
            if isinstance(exc, Exception):
                raise RuntimeError(f"request template worker did not start: {exc!r}") from exc
            raise
        return process


def encode_frame(value: Any) -> bytes:
    """One frame of the worker protocol: 8 bytes of big-endian length, then ASCII JSON."""
    data = json.dumps(value, ensure_ascii=True).encode("ascii")
    return len(data).to_bytes(8, "big") + data


def read_frame(stream: BinaryIO) -> Any:
    """The next frame's value from a blocking stream (the worker's side); None at its end."""
    header = stream.read(8)
    if len(header) < 8:
        return None
    return json.loads(stream.read(int.from_bytes(header, "big")))


async def _kill(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    await process.wait()
