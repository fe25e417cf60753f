"""Generation jobs: one client request -> its choices, each an engine request, merged back;
abortable by the client's request id."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tokenwire.engine.base import EngineError
from tokenwire.pipeline.errors import InvalidRequest

if TYPE_CHECKING:
    import numpy as np

    from tokenwire.engine.base import (
        AdapterVersion,
        EngineOutput,
        MultiModalInput,
        SamplingParams,
        TokenLogprob,
    )
    from tokenwire.pipeline.choice import Choice, ChoiceDelta

T = TypeVar("T")


class ChoiceRunner(Protocol):
    """What runs a job's choices: the engine, or in a frontend the job the core admitted
    (``pipeline.core_link.RemoteJob``)."""

    features: Collection[str]

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        media: MultiModalInput | None = None,
        cache_salt: str | None = None,
        *,
        adapter: AdapterVersion | None = None,
        final_only: bool = False,
    ) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> bool: ...


class GenerationJob:
    """A running request: its choices, streamed by the engine and merged as they come.

    ``on_end`` runs once when its deltas end, however they end (unregistering the job and
    releasing what it held)."""

    def __init__(
        self,
        engine: ChoiceRunner,
        request_id: str,
        choices: list[Choice],
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.choices = choices
        self._on_end = on_end

    def deltas(self) -> AsyncGenerator[ChoiceDelta, None]:
        """Merged deltas of all choices; leaving early aborts whatever still runs; ``on_end``
        runs when they end, however they end."""
        if len(self.choices) == 1:  # most requests: the choice's own stream, one layer less
            return self._run(self.choices[0], ends_job=True)
        return self._merged()

    async def _merged(self) -> AsyncGenerator[ChoiceDelta, None]:
        try:
            runs = [self._run(choice) for choice in self.choices]
            async with contextlib.aclosing(merge(runs)) as streams:
                async for delta in streams:
                    yield delta
        finally:
            self.end()

    def end(self) -> None:
        """Run ``on_end`` (once)."""
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()

    async def run(self) -> list[Choice]:
        """Run every choice to its end."""
        async for _ in self.deltas():
            pass
        return self.choices

    async def abort(self) -> None:
        for choice in self.choices:
            if not choice.finished:
                await self.engine.abort(choice.request.engine_id)

    @property
    def prompt_tokens(self) -> int:
        """Each prompt counts once, however many choices it has (as vLLM counts)."""
        return sum(len(c.prompt_ids) for c in self.choices if c.sample == 0)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from a prefix cache, counted once per prompt."""
        return sum(c.num_cached_tokens for c in self.choices if c.sample == 0)

    def prompt_logprobs(self, choice: Choice) -> list[TokenLogprob | None] | None:
        return self._prompt_score(choice, "prompt_logprobs")

    def prompt_token_id_logprobs(self, choice: Choice) -> np.ndarray | None:
        """Teacher scoring of ``choice``'s prompt."""
        return self._prompt_score(choice, "prompt_token_id_logprobs")

    def _prompt_score(self, choice: Choice, name: str) -> Any:
        """What the engine reported about ``choice``'s prompt, from whichever of the prompt's
        choices it came with (an engine may score a prompt shared by several choices once)."""
        for other in self.choices:
            value = getattr(other, name)
            if other.prompt_index == choice.prompt_index and value is not None:
                return value
        return None

    async def _run(
        self, choice: Choice, *, ends_job: bool = False
    ) -> AsyncGenerator[ChoiceDelta, None]:
        """One choice's deltas; closing it aborts the engine request. ``ends_job``: the job's
        only stream, which runs ``on_end`` when it ends."""
        request = choice.request
        try:
            stream = self.engine.generate(
                request.engine_id,
                request.prompt_ids,
                request.sampling,
                request.media,
                cache_salt=request.cache_salt,
                adapter=request.adapter,
                final_only=request.final_only,
            )
            async with contextlib.aclosing(stream):
                async for output in stream:
                    delta = choice.add(output)
                    yield delta
                    if delta.finish_reason is not None:
                        return
        except EngineError as exc:
            raise InvalidRequest(str(exc), "token_ids") from exc
        finally:
            if ends_job:
                self.end()


class JobRegistry:
    """Running jobs by client request id, so ``/abort_requests`` can find them."""

    def __init__(self) -> None:
        self._jobs: dict[str, GenerationJob] = {}

    def add(self, job: GenerationJob) -> None:
        if job.request_id in self._jobs:
            raise InvalidRequest(f"request id {job.request_id!r} is already running", "request_id")
        self._jobs[job.request_id] = job

    def remove(self, *jobs: GenerationJob) -> None:
        for job in jobs:
            if self._jobs.get(job.request_id) is job:
                del self._jobs[job.request_id]

    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Abort the running jobs among ``request_ids``; return the ids that were running."""
        aborted = []
        for request_id in request_ids:
            job = self._jobs.get(request_id)
            if job is not None:
                await job.abort()
                aborted.append(request_id)
        return aborted

    def ids(self) -> list[str]:
        return list(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)


async def merge(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncIterator[T]:
    """Items of several streams as they come.

    A stream makes its next item only once its previous one was taken, so whatever a stream
    updates while making an item (a choice's state) is as the consumer of that item left it.
    The first error of any stream ends the merge and is raised; leaving early (or an error)
    cancels every stream still running, which closes them (and aborts their engine requests).
    """
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()
    taken = [asyncio.Event() for _ in streams]

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
                await taken[index].wait()
                taken[index].clear()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                index, value = item
                yield value
                taken[index].set()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
