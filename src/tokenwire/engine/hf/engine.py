"""``HFEngine``, what clients call: it checks requests, starts the engine thread, streams outputs.

Everything here runs on the caller's event loop and never touches torch state: a request is
checked, handed to the engine thread as a command, and its outputs are read back from its own
queue (see ``handoff``), coalesced when the consumer is slower than the steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenwire.engine.base import (
    AdapterTensors,
    AdapterVersion,
    EngineDead,
    EngineError,
    EngineFeature,
    EngineOutput,
    EngineStats,
    PauseMode,
    SamplingParams,
    WeightGroup,
    WeightsError,
    WeightUpdate,
    check_new_request,
    check_running,
)
from tokenwire.engine.checkpoint import read_checkpoint
from tokenwire.engine.defaults import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_PREFIX_CACHE_BYTES,
    default_engine_threads,
)
from tokenwire.engine.hf.handoff import (
    Abort,
    Add,
    Command,
    LoadAdapter,
    NewWeights,
    Pause,
    Reply,
    Request,
    ResetPrefixCache,
    Resume,
    SetVersion,
    Sink,
    Stop,
    UnloadAdapter,
)
from tokenwire.engine.hf.lora import AdapterSlots
from tokenwire.engine.hf.multimodal import RequestMedia, VisionSpec, check_media
from tokenwire.engine.hf.prefix_cache import salt_key
from tokenwire.engine.hf.runner import ModelRunner
from tokenwire.engine.hf.scheduler import Scheduler
from tokenwire.engine.hf.weight_receiver import WeightReceiver
from tokenwire.engine.weight_rules import check_finite, check_tensors
from tokenwire.weight_transfer import TensorMeta

logger = logging.getLogger(__name__)

MAX_MODEL_LEN_CAP = 8192


def _coalesce(items: list[EngineOutput]) -> list[EngineOutput]:
    """Outputs a slow consumer has not read yet, merged per run of one weight version."""
    runs: list[list[EngineOutput]] = []
    for item in items:
        if runs and runs[-1][-1].weight_version == item.weight_version:
            runs[-1].append(item)
        else:
            runs.append([item])
    return [_merge(run) for run in runs]


def _merge(items: list[EngineOutput]) -> EngineOutput:
    """One output for consecutive outputs of the same weight version."""
    if len(items) == 1:
        return items[0]
    first = items[0]
    merged = EngineOutput(
        new_token_ids=[],
        logprobs=[] if any(o.logprobs is not None for o in items) else None,
        prompt_logprobs=first.prompt_logprobs,
        num_prompt_tokens=first.num_prompt_tokens,
        num_cached_tokens=first.num_cached_tokens,
        weight_version=first.weight_version,
        prompt_token_id_logprobs=first.prompt_token_id_logprobs,
        sampling_masks=[] if any(o.sampling_masks is not None for o in items) else None,
    )
    routes = [o.routed_experts for o in items if o.routed_experts is not None]
    if routes:
        merged.routed_experts = routes[0] if len(routes) == 1 else np.concatenate(routes)
    for o in items:
        merged.new_token_ids.extend(o.new_token_ids)
        if merged.logprobs is not None and o.logprobs:
            merged.logprobs.extend(o.logprobs)
        if merged.sampling_masks is not None and o.sampling_masks:
            merged.sampling_masks.extend(o.sampling_masks)
        if o.prompt_logprobs is not None and merged.prompt_logprobs is None:
            merged.prompt_logprobs = o.prompt_logprobs
            merged.num_prompt_tokens = o.num_prompt_tokens
        if o.prompt_token_id_logprobs is not None and merged.prompt_token_id_logprobs is None:
            merged.prompt_token_id_logprobs = o.prompt_token_id_logprobs
        if o.finish_reason is not None:
            merged.finish_reason, merged.stop_reason = o.finish_reason, o.stop_reason
    return merged


class HFEngine:
    """Continuous batching for one transformers causal LM on CPU or CUDA (see the package);
    each request says which logprobs it gets (``SamplingParams.logprobs_mode``)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        threads: int | None = None,
        allow_nonfinite_weights: bool = False,
        return_routed_experts: bool = False,
    ) -> None:
        """``max_loras`` > 0 turns LoRA on: that many adapter versions live at once.
        ``return_routed_experts`` captures an MoE model's routing (``routing``); the model
        fails to load if it has no expert routers."""
        from transformers import AutoConfig

        self.model_dir = Path(model_dir)
        self.model_name = self.model_dir.name
        self.allow_nonfinite_weights = allow_nonfinite_weights
        self.config = AutoConfig.from_pretrained(self.model_dir)
        text_config = self.config.get_text_config(decoder=True)
        limit = int(getattr(text_config, "max_position_embeddings", 0) or MAX_MODEL_LEN_CAP)
        self.max_model_len: int = max_model_len or min(limit, MAX_MODEL_LEN_CAP)
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        self.max_num_seqs = max_num_seqs
        self.vision = VisionSpec.from_config(self.config)
        self.multimodal = self.vision is not None  # takes image input
        features: set[EngineFeature] = {
            "prompt_token_id_logprobs",
            "logprob_token_ids",
            "sampling_mask",
            "structured_outputs",
        }
        if max_loras:
            features.add("lora")
        if return_routed_experts:
            features.add("routed_experts")
        self.features = frozenset(features)

        self._runner = ModelRunner(
            self.model_dir,
            vision=self.vision,
            vocab_size=int(text_config.vocab_size),
            max_num_seqs=max_num_seqs,
            device=device,
            dtype=dtype,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            threads=threads or default_engine_threads(),
            capture_routing=return_routed_experts,
        )
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._scheduler = Scheduler(
            self._runner,
            self._inbox,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            prefix_cache_bytes=prefix_cache_bytes,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self._receiver = WeightReceiver(self._runner, allow_nonfinite=allow_nonfinite_weights)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        # Set once, by the engine thread, when its step loop fails: the engine is dead.
        self._death: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # start()'s; where callers wait
        # Owned by the event loop: the streams and the control commands waiting on the thread.
        self._live: dict[str, Sink] = {}
        self._pending: set[asyncio.Future[Any]] = set()

    @property
    def vocab_size(self) -> int:
        """The config's vocabulary until the model loads, then its embedding rows."""
        return self._runner.vocab_size

    @property
    def dtype(self) -> str:
        return str(self._runner.dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """From the generation config (else the model config); empty until started."""
        return self._runner.eos_token_ids

    async def start(self) -> None:
        """Load the model on the engine thread and wait until it is ready."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenwire-hf-engine", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._ready.wait)
        if self._load_error is not None:
            raise EngineError(f"model failed to load: {self._load_error}") from self._load_error

    def is_ready(self) -> bool:
        return (
            self._ready.is_set()
            and self._load_error is None
            and self._death is None
            and not self._scheduler.stopping
        )

    def death(self) -> str | None:
        return self._death

    def stats(self) -> EngineStats:
        s = self._scheduler
        return EngineStats(
            running=s.num_running,
            waiting=s.num_waiting,
            max_num_seqs=self.max_num_seqs,
            extra={
                "steps": s.steps,
                "tokens_generated": s.tokens_generated,
                "kv_cache_bytes": s.kv_cache_bytes,
                "prefill_steps": s.prefill_steps,
                "max_prefills_between_decodes": s.max_prefills_between_decodes,
                **s.prefix_stats,
            },
        )

    def _images(self, prompt: list[int], media: Any | None) -> RequestMedia | None:
        """The request's images, checked (``EngineError`` for what the model cannot take)."""
        if media is None:
            return None
        if self.vision is None:
            raise EngineError("this model takes no image input")
        return check_media(media, prompt, self.vision)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        media: Any | None = None,
        cache_salt: str | None = None,
        *,
        adapter: AdapterVersion | None = None,
        final_only: bool = False,
    ) -> AsyncIterator[EngineOutput]:
        """Stream a request's outputs; closing the iterator early aborts it in the engine.
        ``final_only`` changes nothing here: the steps run in this process, and whatever a
        consumer falls behind by comes coalesced."""
        prompt = list(prompt_token_ids)
        check_new_request(self.is_ready(), self._death, request_id, self._live)
        checked = self._images(prompt, media)
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._live[request_id] = sink
        request = Request(
            request_id,
            prompt,
            sampling,
            sink,
            checked,
            has_images=bool(checked),
            salt=salt_key(cache_salt),
            adapter=adapter,
        )
        self._inbox.put(Add(request))
        finished = False
        try:
            while True:
                items = [await sink.queue.get()]
                while not sink.queue.empty():
                    items.append(sink.queue.get_nowait())
                errors = [i for i in items if isinstance(i, BaseException)]
                if errors:
                    finished = True
                    if isinstance(errors[0], EngineDead):
                        raise errors[0]
                    # Not an EngineError: that means "bad request" (400) to the api layer.
                    raise RuntimeError(f"hf engine step failed: {errors[0]}") from errors[0]
                for out in _coalesce([i for i in items if isinstance(i, EngineOutput)]):
                    finished = finished or out.finish_reason is not None
                    yield out
                if finished:
                    return
        finally:
            if self._live.get(request_id) is sink:
                del self._live[request_id]
            if not finished:
                self._inbox.put(Abort(request_id))

    async def abort(self, request_id: str) -> bool:
        """Abort a running or queued request; its stream ends with finish_reason "abort"."""
        if request_id not in self._live:
            return False
        self._inbox.put(Abort(request_id))
        return True

    # -- RL control ---------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._scheduler.weight_version

    async def pause(self, mode: PauseMode, *, clear_cache: bool = False) -> int:
        """Stop stepping (see ``Engine.pause``); applied between two steps."""
        return await self._command(lambda reply: Pause(mode, clear_cache, reply))

    async def resume(self) -> None:
        await self._command(Resume)

    async def load_weights(self, weight_dir: Path, version: str) -> None:
        """Read the checkpoint on a worker thread, then swap it in between two steps."""
        tensors = await asyncio.to_thread(
            read_checkpoint, Path(weight_dir), allow_nonfinite=self.allow_nonfinite_weights
        )
        runner = self._runner
        await self._command(
            lambda reply: NewWeights(lambda: runner.swap_weights(tensors), version, reply)
        )

    # -- weight transfer ----------------------------------------------------------------------

    def weight_transfer_backends(self) -> tuple[str, ...]:
        return self._receiver.backends()

    async def join_weight_group(self, group: WeightGroup) -> None:
        """Off the engine thread: requests go on while the trainer gathers its ranks."""
        await asyncio.to_thread(self._receiver.join, group)

    async def leave_weight_group(self) -> None:
        await asyncio.to_thread(self._receiver.leave)

    def check_weight_update(self, tensors: Sequence[TensorMeta]) -> None:
        check_tensors(self._runner.layout, ((t.name, t.dtype, t.shape) for t in tensors))

    async def receive_weights(self, update: WeightUpdate) -> None:
        """Received whole off the engine thread (``WeightsError``: the model as it was), then
        copied in between two steps."""
        tensors = await asyncio.to_thread(self._receiver.receive, update)
        await self._copy_in(tensors)

    def missing_weights(self, given: Collection[str]) -> list[str]:
        return self._runner.missing_weights(given)

    async def copy_weights(self, tensors: dict[str, Any]) -> None:
        check_tensors(
            self._runner.layout, ((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
        )
        check_finite(tensors, allow_nonfinite=self.allow_nonfinite_weights)
        await self._copy_in(tensors)

    async def _copy_in(self, tensors: dict[str, Any]) -> None:
        """Checked tensors into the model, between two steps."""
        runner = self._runner

        def copy() -> None:
            for name, tensor in tensors.items():
                runner.copy_weight(name, tensor)

        await self._command(lambda reply: NewWeights(copy, None, reply))

    async def set_weight_version(self, version: str) -> None:
        await self._command(lambda reply: SetVersion(version, reply))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block (always succeeds: running rows keep their own KV)."""
        return bool(await self._command(ResetPrefixCache))

    async def load_adapter(self, adapter: AdapterVersion, source: AdapterTensors) -> None:
        """Check the adapter on a worker thread, then put it in a slot between steps."""
        weights = await asyncio.to_thread(self._adapter_slots().check, source)
        await self._command(lambda reply: LoadAdapter(adapter, weights, reply))

    def check_adapter_update(
        self, config: Mapping[str, Any], tensors: Sequence[TensorMeta]
    ) -> None:
        self._adapter_slots().check_update(config, tensors)

    async def receive_tensors(self, update: WeightUpdate) -> dict[str, Any]:
        """On a worker thread: requests go on while an adapter's factors come. Copied out of
        the group's buffer, which the next call reuses (an adapter is small)."""
        tensors = await asyncio.to_thread(self._receiver.receive, update)
        return {name: tensor.clone() for name, tensor in tensors.items()}

    def _adapter_slots(self) -> AdapterSlots:
        slots = self._runner.adapters
        if slots is None:
            raise WeightsError("LoRA is off (start the server with --enable-lora)")
        return slots

    async def unload_adapter(self, adapter: AdapterVersion) -> None:
        await self._command(lambda reply: UnloadAdapter(adapter, reply))

    async def _command(self, make: Any) -> Any:
        check_running(self.is_ready(), self._death)
        reply = Reply.here()
        self._pending.add(reply.future)
        try:
            self._inbox.put(make(reply))
            return await reply.future
        finally:
            self._pending.discard(reply.future)

    async def shutdown(self) -> None:
        """Abort everything and stop the engine thread."""
        thread = self._thread
        if thread is None:
            return
        self._inbox.put(Stop())
        await asyncio.to_thread(thread.join)
        await self.leave_weight_group()
        self._thread = None

    def _run(self) -> None:
        """The engine thread: load the model, then step until shutdown."""
        try:
            self._runner.load()
        except BaseException as exc:  # reported by start()
            logger.exception("hf engine: model failed to load")
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._scheduler.run()
        except BaseException as exc:  # whatever it was, nothing steps any more
            logger.exception("hf engine: the engine thread failed; the engine is dead")
            self._death = f"the hf engine's thread failed: {type(exc).__name__}: {exc}"
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    self._loop.call_soon_threadsafe(self._fail_waiters)

    def _fail_waiters(self) -> None:
        """On the event loop, once the thread died: nothing will answer the streams and commands
        that wait on it, so each fails now with ``EngineDead``. Later ones are refused up front
        (``check_running``), so none can slip in after this."""
        assert self._death is not None
        for sink in self._live.values():
            sink.queue.put_nowait(EngineDead(self._death))
        for future in self._pending:
            if not future.done():
                future.set_exception(EngineDead(self._death))
