"""A scripted ``Engine`` for model-free tests of everything above the engine.

A test says which tokens each engine request samples (a *script*: a function of the request id,
the prompt ids and the sampling params); the fake reports them the way the real engines do:
one output per scripted step, logprobs clipped to the request's k (or the given
``logprob_token_ids``), teacher scores and sampling supports when asked, the stop rule of the hf
engine (eos -> "stop" with stop_reason None, a ``stop_token_ids`` hit -> that id, max_tokens or
the context -> "length"), the weight version current when each output is made, aborts that end
the stream with "abort" and the tokens so far, and vLLM's three pause modes.

The app runs on TestClient's event-loop thread while the test drives it from its own, so the
sync points are thread-safe: a ``Gate`` holds back one output until the test opens it, and tells
the test when the engine is waiting at it.

Script by prompt (or seed), not by request id: the generation job mints the engine's request
ids, and how it names them is its own business.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenwire.engine.base import (
    DEFAULT_WEIGHT_VERSION,
    AdapterTensors,
    AdapterVersion,
    EngineDead,
    EngineError,
    EngineFeature,
    EngineOutput,
    EngineStats,
    FinishReason,
    MultiModalInput,
    PauseMode,
    SamplingParams,
    SamplingSupport,
    TokenLogprob,
    WeightGroup,
    WeightsError,
    WeightTransferError,
    WeightUpdate,
    check_new_request,
)
from tokenwire.engine.eos import eos_token_ids, generation_eos
from tokenwire.engine.stopping import check_stop
from tokenwire.engine.weight_rules import Layout, check_tensors
from tokenwire.weight_transfer import TensorMeta

# How often a held request looks again at its gate, the pause and its abort flag. Polling keeps
# the fake free of cross-thread wake-ups (gates are opened from the test's thread).
_POLL_S = 0.002
# The hf engine's cap on the context when the config allows more.
_MAX_MODEL_LEN_CAP = 8192
# What the fake serves unless a test takes some away (as the vllm engine lacks them).
ALL_FEATURES: frozenset[EngineFeature] = frozenset(
    {"prompt_token_id_logprobs", "logprob_token_ids", "sampling_mask", "structured_outputs"}
)
# The weights a trainer may send the fake engine: every update is checked against these.
FAKE_LAYOUT: Layout = {
    "model.embed_tokens.weight": (8, 4),
    "model.layers.0.mlp.down_proj.weight": (4, 4),
}
# Ids of the made-up alternatives around a scripted token (see ``Step.top``).
_FILLER_IDS = range(1000, 1100)
_MADE_UP_TOP = 20


class Gate:
    """Holds back the output of the step that carries it until ``open()`` (from any thread)."""

    def __init__(self) -> None:
        self._opened = threading.Event()
        self._reached = threading.Event()

    def open(self) -> None:
        self._opened.set()

    def arrive(self) -> None:
        """Called by the engine when it starts waiting here."""
        self._reached.set()

    @property
    def is_open(self) -> bool:
        return self._opened.is_set()

    def wait_reached(self, timeout: float = 10.0) -> None:
        """Block until the engine waits at this gate: every earlier output has been sent."""
        assert self._reached.wait(timeout), "the engine never reached the gate"


@dataclass(frozen=True, slots=True)
class Step:
    """One sampled token. ``top``: the most likely tokens at its position, best first (None:
    made up, with the sampled token at ``rank``); the engine reports the first k of them.
    ``support``: the ids it was drawn from, reported when a request asks for sampling masks
    (None: made up, the sampled token and top_k - 1 fillers, or the token alone)."""

    token_id: int
    logprob: float = -0.5
    rank: int = 1
    top: tuple[tuple[int, float], ...] | None = None
    gate: Gate | None = None
    support: tuple[int, ...] | None = None

    def token_logprob(self, k: int) -> TokenLogprob:
        top = self.top if self.top is not None else _made_up_top(self)
        return TokenLogprob(self.token_id, self.logprob, self.rank, tuple(top[:k]))

    def given_logprobs(self, given: tuple[int, ...]) -> TokenLogprob:
        """``logprob_token_ids``: the given ids in their order, at made-up logprobs (the j-th
        is ``logprob - 1 - j``)."""
        top = tuple((token_id, self.logprob - 1.0 - j) for j, token_id in enumerate(given))
        return TokenLogprob(self.token_id, self.logprob, self.rank, top)

    def sampling_support(self, sampling: SamplingParams) -> SamplingSupport:
        ids = self.support
        if ids is None:
            fillers = (i for i in _FILLER_IDS if i != self.token_id)
            width = max(sampling.top_k, 1) if sampling.temperature > 0 else 1
            ids = (self.token_id, *itertools.islice(fillers, width - 1))
        return SamplingSupport(tuple(sorted(ids)), self.logprob)


# One engine output: a token, a step, or several of them sent together.
Output = int | Step | Sequence[int | Step]


@dataclass(slots=True)
class Reply:
    """What one engine request produces: its outputs in order, and its first output's extras.

    The script may run out only after the stop rule ended the request (else the request fails,
    as a broken engine would). ``prompt_logprobs`` (None: made up) are sent when asked for.
    """

    outputs: Iterable[Output]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Teacher scoring (None: made up when asked, see ``_prompt_token_id_logprobs``).
    prompt_token_id_logprobs: np.ndarray | None = None


Script = Callable[[str, list[int], SamplingParams], Reply | Iterable[Output]]


@dataclass(slots=True)
class EngineCall:
    """One ``generate`` call as the engine saw it, and what it has sent so far."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    media: MultiModalInput | None
    cache_salt: str | None = None
    adapter: AdapterVersion | None = None
    final_only: bool = False  # the caller asked for the end only (the script streams anyway)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    aborted: bool = False


def cycle_prompt(request_id: str, prompt: list[int], sampling: SamplingParams) -> Iterator[int]:
    """The default script: the prompt's ids over and over, until the stop rule ends it."""
    while True:
        yield from prompt


class FakeEngine:
    """Implements ``tokenwire.engine.base.Engine``; see the module docstring."""

    def __init__(
        self,
        *,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.dtype = "torch.float32"
        self.features: frozenset[EngineFeature] = ALL_FEATURES
        self.script: Script = cycle_prompt
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.calls: list[EngineCall] = []
        self.live: dict[str, EngineCall] = {}
        self.loaded_weights: list[tuple[Path, str]] = []
        self.cache_resets = 0
        self.group: WeightGroup | None = None  # the trainer's group, once joined
        self.received: list[str] = []  # weight names received or copied, in order
        self.receive_gate: Gate | None = None  # holds the next receive until opened
        self.break_receive = False  # the next receive breaks off
        self.adapters: dict[int, AdapterVersion] = {}  # held adapter versions by id
        self.adapter_sources: dict[int, AdapterTensors] = {}  # what each loaded from
        self._started = False
        self._death: str | None = None
        self._paused = False
        self._draining = False  # a "wait" pause waiting for the requests in flight

    @classmethod
    def for_model(cls, model_dir: Path, *, max_model_len: int | None = None) -> FakeEngine:
        """Sized like the hf engine sizes ``model_dir``: its config's vocabulary, eos ids from
        the generation config, the context capped as the hf engine caps it."""
        config = json.loads((model_dir / "config.json").read_text())
        limit = config.get("max_position_embeddings") or _MAX_MODEL_LEN_CAP
        return cls(
            model_name=model_dir.name,
            max_model_len=max_model_len or min(limit, _MAX_MODEL_LEN_CAP),
            vocab_size=config["vocab_size"],
            eos_token_ids=eos_token_ids(generation_eos(model_dir), config.get("eos_token_id")),
        )

    # -- the Engine protocol ------------------------------------------------------------------

    async def start(self) -> None:
        self._started = True

    def is_ready(self) -> bool:
        return self._started and self._death is None

    def death(self) -> str | None:
        return self._death

    async def shutdown(self) -> None:
        for call in self.live.values():
            call.aborted = True
        self._started = False

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.live), waiting=0, max_num_seqs=64)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        media: MultiModalInput | None = None,
        cache_salt: str | None = None,
        *,
        adapter: AdapterVersion | None = None,
        final_only: bool = False,
    ) -> AsyncIterator[EngineOutput]:
        """Yield the script's outputs until the stop rule ends it; closing early aborts."""
        prompt = list(prompt_token_ids)
        # No prompt checks: validation above the engine refuses what does not fit, and the
        # bad-input tests see that the engine never got it (``calls``).
        check_new_request(self.is_ready(), self._death, request_id, self.live)
        if adapter is not None and adapter.id not in self.adapters:
            raise RuntimeError(f"fake engine: {adapter} is not held")  # a registry bug
        reply = self.script(request_id, prompt, sampling)
        if not isinstance(reply, Reply):
            reply = Reply(reply)
        call = EngineCall(request_id, prompt, sampling, media, cache_salt, adapter, final_only)
        self.calls.append(call)
        self.live[request_id] = call
        try:
            first = True
            for scripted in reply.outputs:
                steps = [
                    _step(s) for s in (scripted if isinstance(scripted, Sequence) else [scripted])
                ]
                await self._hold(call, [s.gate for s in steps if s.gate is not None])
                if self._death is not None:  # as the real engines fail what is in flight
                    raise EngineDead(self._death)
                if call.aborted:
                    break
                output = self._output(call, steps)
                if adapter is not None:
                    output.weight_version = adapter.version
                if first:
                    first = False
                    output.num_prompt_tokens = len(prompt)
                    output.num_cached_tokens = reply.num_cached_tokens
                    if sampling.prompt_logprobs is not None:
                        output.prompt_logprobs = _prompt_logprobs(
                            prompt, reply.prompt_logprobs, sampling.prompt_logprobs
                        )
                    if sampling.prompt_logprob_token_ids is not None:
                        output.prompt_token_id_logprobs = (
                            reply.prompt_token_id_logprobs
                            if reply.prompt_token_id_logprobs is not None
                            else _prompt_token_id_logprobs(sampling.prompt_logprob_token_ids)
                        )
                call.finish_reason = output.finish_reason
                yield output
                if output.finish_reason is not None:
                    return
            if not call.aborted:
                raise RuntimeError(f"fake engine: the script of {request_id!r} ran out")
            call.finish_reason = "abort"
            yield EngineOutput([], finish_reason="abort", weight_version=self.weight_version)
        finally:
            if self.live.get(request_id) is call:
                del self.live[request_id]

    async def abort(self, request_id: str) -> bool:
        call = self.live.get(request_id)
        if call is None:
            return False
        call.aborted = True
        return True

    # -- RL control ---------------------------------------------------------------------------

    async def pause(self, mode: PauseMode, *, clear_cache: bool = False) -> int:
        in_flight = len(self.live)
        if mode == "abort":
            for call in self.live.values():
                call.aborted = True
        elif mode == "wait":
            self._draining = True
            while self.live and self._draining:
                await asyncio.sleep(_POLL_S)
            if not self._draining:  # a resume came first: not paused
                return in_flight
            self._draining = False
        if clear_cache:
            self.cache_resets += 1
        self._paused = True
        return in_flight

    async def resume(self) -> None:
        self._paused = False
        self._draining = False

    async def load_weights(self, weight_dir: Path, version: str) -> None:
        if not Path(weight_dir).is_dir():
            raise WeightsError(f"{weight_dir} is not a directory")
        self.loaded_weights.append((Path(weight_dir), version))
        self.weight_version = version

    async def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    async def reset_prefix_cache(self) -> bool:
        self.cache_resets += 1
        return True

    # Weights: a made-up layout (``FAKE_LAYOUT``) a trainer's updates are checked against,
    # received over a pretend group: nothing moves, but every call is recorded, and a test can
    # hold a receive at a gate or make it break off as a dead trainer's broadcast would.

    def weight_transfer_backends(self) -> tuple[str, ...]:
        return ("gloo",)

    async def join_weight_group(self, group: WeightGroup) -> None:
        if self.group is not None:
            raise EngineError("a weight-transfer group is already open")
        self.group = group

    async def leave_weight_group(self) -> None:
        self.group = None

    def check_weight_update(self, tensors: Sequence[TensorMeta]) -> None:
        check_tensors(FAKE_LAYOUT, ((t.name, t.dtype, t.shape) for t in tensors))

    async def receive_weights(self, update: WeightUpdate) -> None:
        await self._receive(update)
        self.received.extend(meta.name for meta in update.tensors)

    def missing_weights(self, given: Collection[str]) -> list[str]:
        return [name for name in FAKE_LAYOUT if name not in given]

    async def copy_weights(self, tensors: dict[str, Any]) -> None:
        check_tensors(FAKE_LAYOUT, ((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()))
        self.received.extend(tensors)

    # LoRA: adapter versions are only recorded (the hf engine serves them, in test_lora).

    async def load_adapter(self, adapter: AdapterVersion, source: AdapterTensors) -> None:
        self.adapters[adapter.id] = adapter
        self.adapter_sources[adapter.id] = source

    async def unload_adapter(self, adapter: AdapterVersion) -> None:
        del self.adapters[adapter.id]
        del self.adapter_sources[adapter.id]

    def check_adapter_update(
        self, config: Mapping[str, Any], tensors: Sequence[TensorMeta]
    ) -> None:
        for meta in tensors:
            name = meta.name.replace(".default.", ".")  # PEFT's adapter name, as in its files
            if not name.endswith((".lora_A.weight", ".lora_B.weight")):
                raise WeightsError(f"{meta.name} is not a LoRA factor")

    async def receive_tensors(self, update: WeightUpdate) -> dict[str, Any]:
        await self._receive(update)
        return {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in update.tensors}

    async def _receive(self, update: WeightUpdate) -> None:
        """Wait at ``receive_gate`` (if set), then break off if ``break_receive`` says so."""
        if self.group is None:
            raise WeightTransferError("no weight-transfer group is open")
        gate = self.receive_gate
        if gate is not None:
            gate.arrive()
            while not gate.is_open:
                await asyncio.sleep(_POLL_S)
        if self.break_receive:
            self.group = None
            raise WeightTransferError("the trainer went away mid-broadcast")

    # -- for tests ----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    def die(self, reason: str) -> None:
        """The engine dies, as the hf engine's thread or vLLM's engine core can: requests in
        flight fail with ``EngineDead`` at their next output, and so does every call after."""
        self._death = reason

    def reset(self) -> None:
        """Back to a fresh engine's state (the previous test's requests have ended)."""
        self.script = cycle_prompt
        self.features = ALL_FEATURES
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.calls.clear()
        self.loaded_weights.clear()
        self.cache_resets = 0
        self.received.clear()
        self.receive_gate = None
        self.break_receive = False
        self._paused = False
        self._draining = False

    async def _hold(self, call: EngineCall, gates: list[Gate]) -> None:
        """Wait while paused or a gate is shut; an abort ends the wait."""
        for gate in gates:
            gate.arrive()
        while (
            not call.aborted
            and self._death is None
            and (self._paused or not all(g.is_open for g in gates))
        ):
            await asyncio.sleep(_POLL_S)

    def _output(self, call: EngineCall, steps: list[Step]) -> EngineOutput:
        """The next output: ``steps`` up to the one the stop rule ends the request at."""
        sampling = call.sampling
        taken: list[Step] = []
        finish: FinishReason | None = None
        stop_reason: int | None = None
        for step in steps:
            taken.append(step)
            call.output_ids.append(step.token_id)
            finish, stop_reason = self._finish(call, step.token_id)
            if finish is not None:
                break
        logprobs = None
        given = sampling.logprob_token_ids
        if given is not None:
            logprobs = [s.given_logprobs(given) for s in taken]
        elif sampling.logprobs is not None:
            logprobs = [s.token_logprob(sampling.logprobs) for s in taken]
        return EngineOutput(
            new_token_ids=[s.token_id for s in taken],
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
            weight_version=self.weight_version,
            sampling_masks=(
                [s.sampling_support(sampling) for s in taken] if sampling.sampling_mask else None
            ),
        )

    def _finish(self, call: EngineCall, token: int) -> tuple[FinishReason | None, int | None]:
        """The engines' one stop rule (``engine.stopping``)."""
        n = len(call.output_ids)
        return check_stop(
            token,
            n,
            call.sampling,
            self.eos_token_ids,
            context_full=len(call.prompt_token_ids) + n >= self.max_model_len,
        )


def _step(scripted: int | Step) -> Step:
    return scripted if isinstance(scripted, Step) else Step(scripted)


def _made_up_top(step: Step) -> list[tuple[int, float]]:
    """A descending top list with the sampled token at its rank, other ids as filler, 0.1
    apart (so a rank > 1 needs a logprob below -0.1 * (rank - 1) to stay a logprob)."""
    fillers = (i for i in _FILLER_IDS if i != step.token_id)
    return [
        (
            step.token_id if rank == step.rank else next(fillers),
            step.logprob + 0.1 * (step.rank - rank),
        )
        for rank in range(1, max(_MADE_UP_TOP, step.rank) + 1)
    ]


def _prompt_token_id_logprobs(rows: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Made-up teacher scores: row i, column j is -(i + 1) - j / 10; padding (-1) is -inf."""
    ids = np.array(rows)
    made_up = -(np.arange(len(rows))[:, None] + 1.0) - np.arange(ids.shape[1])[None, :] / 10
    return np.where(ids < 0, -np.inf, made_up).astype(np.float32)


def _prompt_logprobs(
    prompt: list[int], scripted: list[TokenLogprob | None] | None, k: int
) -> list[TokenLogprob | None]:
    """The scripted prompt logprobs clipped to k, or made up: none for the first position."""
    if scripted is None:
        return [None] + [
            Step(token, logprob=-1.0 - i % 4, rank=1 + i % 3).token_logprob(k)
            for i, token in enumerate(prompt[1:], start=1)
        ]
    return [
        None if e is None else TokenLogprob(e.token_id, e.logprob, e.rank, e.top[:k])
        for e in scripted
    ]
