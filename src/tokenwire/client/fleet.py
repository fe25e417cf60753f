"""A trainer's control of many servers: each control call sent to every server directly.

Behind vllm-router the control routes answer 401 (each server's control key is one the router
never holds; README "Scale out"), and a call through it would reach one server only. The
trainer holds the servers' URLs and their control key instead: ``fleet.each(action)`` runs one
control call on every server and returns the answers in the servers' order. ``Fleet`` calls
them one after another and stops at the first failure; ``AsyncFleet`` calls them all at once
(a reload takes as long as the slowest server) and raises the first failure once all are done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from tokenwire.client.client import DEFAULT_TIMEOUT_S, AsyncClient, Client
from tokenwire.client.control import AsyncControl, Control

T = TypeVar("T")


def _checked(urls: Sequence[str]) -> Sequence[str]:
    if not urls or isinstance(urls, str):
        raise ValueError("a fleet needs a list of one or more server URLs")
    return urls


class Fleet:
    """``with Fleet(urls, api_key=CONTROL_KEY) as fleet: fleet.each(lambda c: c.pause("keep"))``"""

    def __init__(
        self, urls: Sequence[str], *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.clients = [Client(url, api_key=api_key, timeout=timeout) for url in _checked(urls)]

    def each(self, action: Callable[[Control], T]) -> list[T]:
        return [action(client.control) for client in self.clients]

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for client in self.clients:
            client.close()


class AsyncFleet:
    """``await fleet.each(lambda c: c.update_weights(path, version))`` on every server at once."""

    def __init__(
        self, urls: Sequence[str], *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.clients = [
            AsyncClient(url, api_key=api_key, timeout=timeout) for url in _checked(urls)
        ]

    async def each(self, action: Callable[[AsyncControl], Awaitable[T]]) -> list[T]:
        results = await asyncio.gather(
            *(action(client.control) for client in self.clients), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]

    async def __aenter__(self) -> AsyncFleet:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
