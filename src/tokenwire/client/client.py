"""``Client`` (sync) and ``AsyncClient``: every tokenwire endpoint, typed, over httpx.

Both send the ``Call`` that ``calls`` builds for an endpoint, so their methods are one line each;
errors come back as the typed exceptions of ``errors`` (from the server's JSON error body).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import httpx

from tokenwire.client import calls
from tokenwire.client.calls import Call, Messages
from tokenwire.client.control import AsyncControl, Control
from tokenwire.client.errors import APIConnectionError, response_error
from tokenwire.client.types import (
    ChatCompletion,
    Completion,
    Extension,
    GenerateChunk,
    GenerateResult,
    ModelCard,
    Prompt,
    Tokens,
)

T = TypeVar("T")
H = TypeVar("H", httpx.Client, httpx.AsyncClient)
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 600.0  # long generations are normal in RL


def _read(call: Call[T], response: httpx.Response) -> T:
    if response.is_error:
        raise response_error(response)
    return call.read(response.json() if response.content else None)


class _Connection(Generic[H]):
    """The httpx client both flavours wrap: one given, or one made from url, key and timeout."""

    _http_class: type[H]

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        http_client: H | None = None,
    ) -> None:
        merged = dict(headers or {})
        if api_key:
            merged["Authorization"] = f"Bearer {api_key}"
        self.http: H = http_client or self._http_class(
            base_url=base_url, headers=merged, timeout=timeout
        )


class Client(_Connection[httpx.Client]):
    """Blocking client; ``with Client(url) as client: client.render_chat(...)``.

    ``client.control`` holds the RL-loop routes (a server started with ``--enable-rl-control``).
    """

    _http_class = httpx.Client

    @property
    def control(self) -> Control:
        return Control(self.send)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def send(self, call: Call[T]) -> T:
        try:
            response = self.http.request(call.method, call.path, json=call.body, params=call.params)
        except httpx.TransportError as exc:
            raise APIConnectionError(str(exc)) from exc
        return _read(call, response)

    def health(self) -> bool:
        """True once the model is loaded (200), False while loading or shutting down (503)."""
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError as exc:
            raise APIConnectionError(str(exc)) from exc

    def models(self) -> list[ModelCard]:
        return self.send(calls.models())

    def version(self) -> str:
        return self.send(calls.version())

    def tokenize(self, prompt: str, **fields: Any) -> Tokens:
        return self.send(calls.tokenize(prompt, **fields))

    def tokenize_chat(self, messages: Messages, **fields: Any) -> Tokens:
        return self.send(calls.tokenize_chat(messages, **fields))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.send(calls.detokenize(tokens))

    def render_chat(self, messages: Messages, **fields: Any) -> Prompt:
        return self.send(calls.render_chat(messages, **fields))

    def render_completion(self, prompt: Any, **fields: Any) -> list[Prompt]:
        return self.send(calls.render_completion(prompt, **fields))

    def extend(
        self,
        previous_token_ids: Sequence[int],
        previous_messages: Messages,
        messages: Messages,
        **fields: Any,
    ) -> Extension:
        return self.send(calls.extend(previous_token_ids, previous_messages, messages, **fields))

    def extend_by_reference(
        self,
        previous_prompt: str,
        completion_token_ids: Sequence[int],
        reply: Mapping[str, Any],
        messages: Messages,
        **fields: Any,
    ) -> Extension:
        """Extend the prompt the server remembers as ``previous_prompt`` (a ``prompt_handle``)
        by its ``completion_token_ids``, the derendered ``reply`` and the new ``messages``."""
        call = calls.extend_by_reference(
            previous_prompt, completion_token_ids, reply, messages, **fields
        )
        return self.send(call)

    def generate(
        self,
        prompt: Prompt | Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> GenerateResult:
        return self.send(calls.generate(prompt, sampling_params, **fields))

    def generate_stream(
        self,
        prompt: Prompt | Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> Iterator[GenerateChunk]:
        call = calls.generate_stream(prompt, sampling_params, **fields)
        try:
            with self.http.stream(call.method, call.path, json=call.body) as response:
                if response.is_error:
                    response.read()
                    raise response_error(response)
                for line in response.iter_lines():
                    chunk = call.read(line)
                    if chunk is not None:
                        yield chunk
        except httpx.TransportError as exc:
            raise APIConnectionError(str(exc)) from exc

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """Abort requests by id (None: all); returns how many were running."""
        return self.send(calls.abort(request_ids))

    def derender_chat(
        self, generate_result: GenerateResult | Mapping[str, Any], **fields: Any
    ) -> ChatCompletion:
        return self.send(calls.derender_chat(generate_result, **fields))

    def derender_completion(
        self, generate_results: Sequence[GenerateResult | Mapping[str, Any]], **fields: Any
    ) -> Completion:
        return self.send(calls.derender_completion(generate_results, **fields))

    def chat_completion(self, messages: Messages, **fields: Any) -> ChatCompletion:
        return self.send(calls.chat_completion(messages, **fields))

    def completion(self, prompt: Any, **fields: Any) -> Completion:
        return self.send(calls.completion(prompt, **fields))


class AsyncClient(_Connection[httpx.AsyncClient]):
    """The same endpoints for asyncio; many rollouts share one (the server batches them)."""

    _http_class = httpx.AsyncClient

    @property
    def control(self) -> AsyncControl:
        return AsyncControl(self.send)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def send(self, call: Call[T]) -> T:
        try:
            response = await self.http.request(
                call.method, call.path, json=call.body, params=call.params
            )
        except httpx.TransportError as exc:
            raise APIConnectionError(str(exc)) from exc
        return _read(call, response)

    async def health(self) -> bool:
        """True once the model is loaded (200), False while loading or shutting down (503)."""
        try:
            return (await self.http.get("/health")).status_code == 200
        except httpx.TransportError as exc:
            raise APIConnectionError(str(exc)) from exc

    async def models(self) -> list[ModelCard]:
        return await self.send(calls.models())

    async def version(self) -> str:
        return await self.send(calls.version())

    async def tokenize(self, prompt: str, **fields: Any) -> Tokens:
        return await self.send(calls.tokenize(prompt, **fields))

    async def tokenize_chat(self, messages: Messages, **fields: Any) -> Tokens:
        return await self.send(calls.tokenize_chat(messages, **fields))

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return await self.send(calls.detokenize(tokens))

    async def render_chat(self, messages: Messages, **fields: Any) -> Prompt:
        return await self.send(calls.render_chat(messages, **fields))

    async def render_completion(self, prompt: Any, **fields: Any) -> list[Prompt]:
        return await self.send(calls.render_completion(prompt, **fields))

    async def extend(
        self,
        previous_token_ids: Sequence[int],
        previous_messages: Messages,
        messages: Messages,
        **fields: Any,
    ) -> Extension:
        call = calls.extend(previous_token_ids, previous_messages, messages, **fields)
        return await self.send(call)

    async def extend_by_reference(
        self,
        previous_prompt: str,
        completion_token_ids: Sequence[int],
        reply: Mapping[str, Any],
        messages: Messages,
        **fields: Any,
    ) -> Extension:
        call = calls.extend_by_reference(
            previous_prompt, completion_token_ids, reply, messages, **fields
        )
        return await self.send(call)

    async def generate(
        self,
        prompt: Prompt | Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> GenerateResult:
        return await self.send(calls.generate(prompt, sampling_params, **fields))

    async def generate_stream(
        self,
        prompt: Prompt | Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> AsyncIterator[GenerateChunk]:
        call = calls.generate_stream(prompt, sampling_params, **fields)
        try:
            async with self.http.stream(call.method, call.path, json=call.body) as response:
                if response.is_error:
                    await response.aread()
                    raise response_error(response)
                async for line in response.aiter_lines():
                    chunk = call.read(line)
                    if chunk is not None:
                        yield chunk
        except httpx.TransportError as exc:
            raise APIConnectionError(str(exc)) from exc

    async def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """Abort requests by id (None: all); returns how many were running."""
        return await self.send(calls.abort(request_ids))

    async def derender_chat(
        self, generate_result: GenerateResult | Mapping[str, Any], **fields: Any
    ) -> ChatCompletion:
        return await self.send(calls.derender_chat(generate_result, **fields))

    async def derender_completion(
        self, generate_results: Sequence[GenerateResult | Mapping[str, Any]], **fields: Any
    ) -> Completion:
        return await self.send(calls.derender_completion(generate_results, **fields))

    async def chat_completion(self, messages: Messages, **fields: Any) -> ChatCompletion:
        return await self.send(calls.chat_completion(messages, **fields))

    async def completion(self, prompt: Any, **fields: Any) -> Completion:
        return await self.send(calls.completion(prompt, **fields))
