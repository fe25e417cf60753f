"""The ``hf`` engine: continuous batching over a transformers causal LM's forward.

Why not transformers' own continuous batching (``init_continuous_batching``, 5.24): it has no
per-request seed, min_p, repetition penalties or min_tokens, its logprobs come from the processed
distribution without top-k, cancelling never delivers a final output, and once sized for this
machine it ran at about 0.65x a static batch (see ``ENGINE-NOTES.md``). A small scheduler over
``model.forward`` does better and keeps vLLM's sampling semantics.

Shape: one left-padded KV cache for all running rows (``kv_cache.PaddedBatchCache``), an
attention mask [B, L] and explicit ``position_ids`` (each row's own count of real tokens). A step
is either a prefill of waiting requests (their own left-padded forward, then their cache rows are
joined into the running cache, right-aligned) or one decode step for every running row. Finished
and aborted rows are dropped from the cache right after the step that ends them, and columns that
became padding in every row are trimmed.

Qwen2-VL-family models (``multimodal.VisionSpec``) load as image-text-to-text models. A request
with images is prefilled alone with its pixel values and explicit 3D M-RoPE positions, then
decodes in the shared batch like any other row: its position is its token index plus its own
rope delta (0 for text rows), kept on the request so it follows the row through cache moves.

Threads: every torch call runs on one engine thread; the asyncio side sends commands through a
thread-safe queue and receives outputs through ``loop.call_soon_threadsafe`` into per-request
``asyncio.Queue``s (torch work on the event loop slowed a measured loop by ~27%).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenwire.engine.base import (
    EngineError,
    EngineOutput,
    EngineStats,
    FinishReason,
    SamplingParams,
    TokenLogprob,
)
from tokenwire.engine.kv_cache import PaddedBatchCache
from tokenwire.engine.multimodal import (
    RequestMedia,
    VisionSpec,
    check_media,
    prefill_media_kwargs,
    prefill_positions,
)
from tokenwire.engine.sampling import RowSampler, sample, token_logprobs

logger = logging.getLogger(__name__)

MAX_MODEL_LEN_CAP = 8192
# Padded tokens one prefill forward may hold: bounds prefill memory and decode stalls.
MAX_PREFILL_TOKENS = 4096
# Prompt positions per log_softmax chunk when computing prompt logprobs.
PROMPT_LOGPROB_CHUNK = 256


@dataclass(slots=True)
class _Sink:
    """Where a request's outputs go: its event loop and queue (touched only on that loop)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineOutput | BaseException]


@dataclass(slots=True)
class _Request:
    """A request as the engine thread tracks it."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: _Sink
    media: RequestMedia | None = None
    # M-RoPE: decode token i sits at position i + rope_delta (negative after images, else 0).
    rope_delta: int = 0
    sampler: RowSampler | None = None
    output: list[int] = field(default_factory=list)
    last_token: int = 0
    finish: FinishReason | None = None


@dataclass(slots=True)
class _Add:
    request: _Request


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Stop:
    pass


def _pick_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _pick_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """fp32 on CPU (trainer parity, and CPU half matmuls are slow); bf16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


def _merge(items: list[EngineOutput]) -> EngineOutput:
    """Coalesce outputs a slow consumer has not read yet into one."""
    if len(items) == 1:
        return items[0]
    first = items[0]
    merged = EngineOutput(
        new_token_ids=[],
        logprobs=[] if any(o.logprobs is not None for o in items) else None,
        prompt_logprobs=first.prompt_logprobs,
        num_prompt_tokens=first.num_prompt_tokens,
    )
    for o in items:
        merged.new_token_ids.extend(o.new_token_ids)
        if merged.logprobs is not None and o.logprobs:
            merged.logprobs.extend(o.logprobs)
        if o.prompt_logprobs is not None and merged.prompt_logprobs is None:
            merged.prompt_logprobs = o.prompt_logprobs
            merged.num_prompt_tokens = o.num_prompt_tokens
        merged.finish_reason = o.finish_reason or merged.finish_reason
    return merged


class HFEngine:
    """Continuous batching for one transformers causal LM on CPU or CUDA (see module docstring)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> None:
        from transformers import AutoConfig

        self.model_dir = Path(model_dir)
        self.model_name = self.model_dir.name
        self.config = AutoConfig.from_pretrained(self.model_dir)
        text_config = self.config.get_text_config(decoder=True)
        self.vocab_size: int = int(text_config.vocab_size)
        limit = int(getattr(text_config, "max_position_embeddings", 0) or MAX_MODEL_LEN_CAP)
        self.max_model_len: int = max_model_len or min(limit, MAX_MODEL_LEN_CAP)
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        self.max_num_seqs = max_num_seqs
        self.device = _pick_device(device)
        self.dtype = _pick_dtype(dtype, self.device)
        self.vision = VisionSpec.from_config(self.config)
        self.multimodal = self.vision is not None  # takes image input
        self.eos_token_ids: tuple[int, ...] = ()

        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._live: dict[str, _Sink] = {}  # owned by the event loop
        # Engine-thread state.
        self._model: Any = None
        self._cache: PaddedBatchCache | None = None
        self._running: list[_Request] = []  # index == cache row
        self._waiting: deque[_Request] = deque()
        self._prefilling: list[_Request] = []  # popped from waiting, not yet running
        self._stopping = False
        # Published by the engine thread for stats() (plain ints: atomic reads).
        self._num_running = 0
        self._num_waiting = 0
        self._steps = 0
        self._tokens_generated = 0

    # -- asyncio side ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model on the engine thread and wait until it is ready."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tokenwire-hf-engine", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._ready.wait)
        if self._load_error is not None:
            raise EngineError(f"model failed to load: {self._load_error}") from self._load_error

    def is_ready(self) -> bool:
        return self._ready.is_set() and self._load_error is None and not self._stopping

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._num_running,
            waiting=self._num_waiting,
            max_num_seqs=self.max_num_seqs,
            extra={"steps": self._steps, "tokens_generated": self._tokens_generated},
        )

    def _validate(
        self, prompt: list[int], sampling: SamplingParams, media: Any | None
    ) -> RequestMedia | None:
        """Refuse what the engine cannot serve (``EngineError``); return the checked images."""
        if not self.is_ready():
            raise EngineError("the engine is not running")
        if not prompt:
            raise EngineError("the prompt must hold at least one token")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise EngineError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt) > self.max_model_len - 1:
            raise EngineError(
                f"the prompt has {len(prompt)} tokens; this model's maximum context length is "
                f"{self.max_model_len}, which leaves room for at most {self.max_model_len - 1} "
                "prompt tokens"
            )
        if sampling.max_tokens < 1:
            raise EngineError("max_tokens must be at least 1")
        if len(prompt) + sampling.max_tokens > self.max_model_len:
            raise EngineError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({sampling.max_tokens}) "
                f"exceeds this model's maximum context length of {self.max_model_len} tokens"
            )
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
    ) -> AsyncIterator[EngineOutput]:
        """Stream a request's outputs; closing the iterator early aborts it in the engine."""
        prompt = list(prompt_token_ids)
        checked = self._validate(prompt, sampling, media)
        if request_id in self._live:
            raise EngineError(f"request id {request_id!r} is already running")
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._live[request_id] = sink
        self._inbox.put(_Add(_Request(request_id, prompt, sampling, sink, checked)))
        finished = False
        try:
            while True:
                items = [await sink.queue.get()]
                while not sink.queue.empty():
                    items.append(sink.queue.get_nowait())
                errors = [i for i in items if isinstance(i, BaseException)]
                if errors:
                    finished = True
                    # Not an EngineError: that means "bad request" (400) to the api layer.
                    raise RuntimeError(f"hf engine step failed: {errors[0]}") from errors[0]
                out = _merge([i for i in items if isinstance(i, EngineOutput)])
                if out.finish_reason is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            if self._live.get(request_id) is sink:
                del self._live[request_id]
            if not finished:
                self._inbox.put(_Abort(request_id))

    async def abort(self, request_id: str) -> bool:
        """Abort a running or queued request; its stream ends with finish_reason "abort"."""
        if request_id not in self._live:
            return False
        self._inbox.put(_Abort(request_id))
        return True

    async def shutdown(self) -> None:
        """Abort everything and stop the engine thread."""
        thread = self._thread
        if thread is None:
            return
        self._inbox.put(_Stop())
        await asyncio.to_thread(thread.join)
        self._thread = None

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as exc:  # reported by start()
            logger.exception("hf engine: model failed to load")
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        with torch.inference_mode():
            while not self._stopping:
                emits: list[tuple[_Sink, EngineOutput | BaseException]] = []
                self._drain_inbox(emits, block=not (self._running or self._waiting))
                if self._stopping:
                    self._abort_all(emits)
                elif self._waiting and len(self._running) < self.max_num_seqs:
                    try:
                        self._prefill_step(emits)
                    except Exception as exc:  # only the group fails; the running cache is intact
                        logger.exception("hf engine: prefill failed; failing its requests")
                        self._fail(self._prefilling, exc, emits)
                elif self._running:
                    try:
                        self._decode_step(emits)
                    except Exception as exc:
                        logger.exception("hf engine: decode step failed; failing the batch")
                        self._fail(self._running, exc, emits)
                        self._running = []
                        self._cache = PaddedBatchCache(self._num_layers, self.device)
                self._prefilling = []
                self._publish()
                self._deliver(emits)
        self._refuse_late_requests()

    def _refuse_late_requests(self) -> None:
        """Requests that raced with shutdown still get a final output."""
        emits: list[tuple[_Sink, EngineOutput | BaseException]] = []
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                emits.append((cmd.request.sink, EngineOutput([], finish_reason="abort")))
        self._deliver(emits)

    def _load(self) -> None:
        from transformers import (
            AutoModelForCausalLM,
            AutoModelForImageTextToText,
            GenerationConfig,
        )

        auto = AutoModelForImageTextToText if self.vision is not None else AutoModelForCausalLM
        model = auto.from_pretrained(self.model_dir, dtype=self.dtype, attn_implementation="sdpa")
        model.to(self.device).eval()
        text_config = model.config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise EngineError("the hf engine supports full-attention models only")
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        eos: Any = None
        with contextlib.suppress(OSError, ValueError):
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        if eos is None:
            eos = getattr(text_config, "eos_token_id", None)
        eos_list = eos if isinstance(eos, list | tuple) else [eos]
        self.eos_token_ids = tuple(int(e) for e in eos_list if e is not None)
        self._model = model
        self._num_layers = int(text_config.num_hidden_layers)
        self._cache = PaddedBatchCache(self._num_layers, self.device)
        self._warm_up()

    def _warm_up(self) -> None:
        """One tiny prefill + decode so the first request does not pay for lazy init."""
        with torch.inference_mode():
            ids = torch.tensor([[1, 2, 3]], device=self.device) % self.vocab_size
            mask = torch.ones_like(ids, dtype=torch.bool)
            pos = torch.arange(3, device=self.device).unsqueeze(0)
            self._model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
            if self.vision is not None:  # the vision tower too: one image of one merged token
                m = self.vision.merge_size
                media = RequestMedia(
                    placeholders=((0, 1),),
                    grids=((1, m, m),),
                    pixel_values=(torch.zeros(m * m, self.vision.patch_dim),),
                )
                prompt = [self.vision.image_token_id, 1]
                positions, _ = prefill_positions([prompt], [media], 2, m, self.device)
                self._model(
                    input_ids=torch.tensor([prompt], device=self.device),
                    attention_mask=torch.ones(1, 2, dtype=torch.bool, device=self.device),
                    position_ids=positions,
                    logits_to_keep=1,
                    **prefill_media_kwargs([media], self.device, self.dtype),
                )

    def _drain_inbox(
        self, emits: list[tuple[_Sink, EngineOutput | BaseException]], block: bool
    ) -> None:
        """Apply queued commands in order (an abort never hits a later request with its id)."""
        try:
            cmd = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Stop):
                self._stopping = True
            elif isinstance(cmd, _Add):
                self._waiting.append(cmd.request)
            else:
                self._apply_aborts({cmd.request_id}, emits)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break

    def _apply_aborts(
        self, ids: set[str], emits: list[tuple[_Sink, EngineOutput | BaseException]]
    ) -> None:
        kept: deque[_Request] = deque()
        for req in self._waiting:
            if req.request_id in ids:
                emits.append((req.sink, EngineOutput([], finish_reason="abort")))
            else:
                kept.append(req)
        self._waiting = kept
        for req in self._running:
            if req.request_id in ids and req.finish is None:
                req.finish = "abort"
                emits.append((req.sink, EngineOutput([], finish_reason="abort")))
        self._drop_finished()

    def _abort_all(self, emits: list[tuple[_Sink, EngineOutput | BaseException]]) -> None:
        ids = {r.request_id for r in self._waiting} | {r.request_id for r in self._running}
        self._apply_aborts(ids, emits)

    @staticmethod
    def _fail(
        requests: list[_Request],
        exc: Exception,
        emits: list[tuple[_Sink, EngineOutput | BaseException]],
    ) -> None:
        """End the streams of ``requests`` with an error (once each)."""
        for req in requests:
            if req.finish is None:
                req.finish = "abort"
                emits.append((req.sink, exc))

    def _publish(self) -> None:
        self._num_running = len(self._running)
        self._num_waiting = len(self._waiting)

    @staticmethod
    def _deliver(emits: list[tuple[_Sink, EngineOutput | BaseException]]) -> None:
        """Hand a step's outputs to their loops, one wake-up per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, Any]]] = {}
        for sink, item in emits:
            by_loop.setdefault(sink.loop, []).append((sink, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
                loop.call_soon_threadsafe(_put_all, batch)

    # -- steps ------------------------------------------------------------------------------

    def _next_group(self) -> list[_Request]:
        """FIFO requests for one prefill forward, within free slots and the token budget."""
        free = self.max_num_seqs - len(self._running)
        group: list[_Request] = []
        longest = 0
        for req in self._waiting:
            wants_prompt_lp = req.params.prompt_logprobs is not None
            if group and (wants_prompt_lp or group[0].params.prompt_logprobs is not None):
                break  # full-logit prefills run alone: their logits are [P, V]
            if group and req.media is not None:
                break
            new_longest = max(longest, len(req.prompt))
            if group and new_longest * (len(group) + 1) > MAX_PREFILL_TOKENS:
                break
            if len(group) >= free:
                break
            group.append(req)
            longest = new_longest
            if req.media is not None:
                break
        for _ in group:
            self._waiting.popleft()
        return group

    def _prefill_step(self, emits: list[tuple[_Sink, EngineOutput | BaseException]]) -> None:
        from transformers import DynamicCache

        group = self._prefilling = self._next_group()
        n, p = len(group), max(len(r.prompt) for r in group)
        ids = torch.zeros(n, p, dtype=torch.long)
        mask = torch.zeros(n, p, dtype=torch.bool)
        for i, req in enumerate(group):
            ids[i, p - len(req.prompt) :] = torch.tensor(req.prompt)
            mask[i, p - len(req.prompt) :] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        if any(r.media is not None for r in group):
            assert self.vision is not None
            positions, deltas = prefill_positions(
                [r.prompt for r in group],
                [r.media for r in group],
                p,
                self.vision.merge_size,
                self.device,
            )
            for req, delta in zip(group, deltas, strict=True):
                req.rope_delta = delta
        full_logits = group[0].params.prompt_logprobs is not None
        cache = DynamicCache()
        logits = self._prefill_forward(group, ids, mask, positions, cache, full_logits)
        for req in group:
            req.media = None  # the pixels live in the KV cache now; free them for long decodes
        prompt_lps: list[TokenLogprob | None] | None = None
        if full_logits:
            prompt_lps = self._prompt_logprobs(logits[0], group[0])
        for req in group:
            stops = tuple(req.params.stop_token_ids)
            if not req.params.ignore_eos:
                stops += tuple(e for e in self.eos_token_ids if e not in stops)
            req.sampler = RowSampler.create(
                req.params, req.prompt, stops, self.vocab_size, self.device
            )
        self._steps += 1
        self._sample_and_emit(group, logits[:, -1].float(), emits, first=True, prompt=prompt_lps)
        alive = [i for i, r in enumerate(group) if r.finish is None]
        if alive:
            kv = [(layer.keys, layer.values) for layer in cache.layers]
            row_mask = mask
            if len(alive) < n:
                sel = torch.tensor(alive, device=self.device)
                kv = [(k.index_select(0, sel), v.index_select(0, sel)) for k, v in kv]
                row_mask = mask.index_select(0, sel)
            assert self._cache is not None
            self._cache.join(kv, row_mask, rows_cap=self.max_num_seqs)
            self._running.extend(group[i] for i in alive)

    def _prefill_forward(
        self,
        group: list[_Request],
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        full_logits: bool,
    ) -> torch.Tensor:
        """The prefill forward; pixel values and grids go in here and only here.

        A request with media is always prefilled alone (see ``_next_group``): a vision tower
        forward is costly, and a shared group would stall text prompts behind it.
        """
        media_kwargs = prefill_media_kwargs([r.media for r in group], self.device, self.dtype)
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=0 if full_logits else 1,
            **media_kwargs,
        )
        return out.logits

    def _decode_step(self, emits: list[tuple[_Sink, EngineOutput | BaseException]]) -> None:
        cache = self._cache
        assert cache is not None
        rows = self._running
        attention_mask = cache.begin_decode()
        ids = torch.tensor([r.last_token for r in rows], device=self.device).unsqueeze(1)
        # The last sampled token sits right after the prompt and the earlier outputs; M-RoPE
        # rows shift by their own delta (a [B, 1] tensor: Qwen2-VL repeats it on its 3 axes).
        positions = torch.tensor(
            [len(r.prompt) + len(r.output) - 1 + r.rope_delta for r in rows], device=self.device
        ).unsqueeze(1)
        out = self._model(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache.commit(1)
        self._steps += 1
        self._sample_and_emit(rows, out.logits[:, -1].float(), emits, first=False)
        self._drop_finished()

    def _sample_and_emit(
        self,
        rows: list[_Request],
        logits: torch.Tensor,
        emits: list[tuple[_Sink, EngineOutput | BaseException]],
        *,
        first: bool,
        prompt: list[TokenLogprob | None] | None = None,
    ) -> None:
        samplers = [r.sampler for r in rows]
        assert all(s is not None for s in samplers)
        result = sample(logits, samplers)  # type: ignore[arg-type]
        self._tokens_generated += len(rows)
        for i, (req, token) in enumerate(zip(rows, result.token_ids, strict=True)):
            assert req.sampler is not None
            req.sampler.record(token)
            req.output.append(token)
            req.last_token = token
            req.finish = self._finish_reason(req, token)
            lp = result.logprobs[i]
            out = EngineOutput(
                new_token_ids=[token],
                logprobs=[lp] if lp is not None else None,
                finish_reason=req.finish,
            )
            if first:
                out.num_prompt_tokens = len(req.prompt)
                if prompt is not None and i == 0:
                    out.prompt_logprobs = prompt
            emits.append((req.sink, out))

    def _finish_reason(self, req: _Request, token: int) -> FinishReason | None:
        p = req.params
        n = len(req.output)
        if n >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop"
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
        if n >= p.max_tokens or len(req.prompt) + n >= self.max_model_len:
            return "length"
        return None

    def _drop_finished(self) -> None:
        """Remove finished rows from the cache and mirror the cache's row moves."""
        done = [i for i, r in enumerate(self._running) if r.finish is not None]
        if not done:
            return
        assert self._cache is not None
        moves = self._cache.drop(done)
        rows = self._running
        for src, dst in moves:
            rows[dst] = rows[src]
        del rows[len(rows) - len(done) :]

    def _prompt_logprobs(self, logits: torch.Tensor, req: _Request) -> list[TokenLogprob | None]:
        """Raw logprobs of each prompt token given its prefix (the first has none)."""
        k = req.params.prompt_logprobs or 0
        p = logits.shape[0]
        offset = p - len(req.prompt)
        result: list[TokenLogprob | None] = [None]
        for start in range(1, len(req.prompt), PROMPT_LOGPROB_CHUNK):
            stop = min(start + PROMPT_LOGPROB_CHUNK, len(req.prompt))
            chunk = logits[offset + start - 1 : offset + stop - 1]
            chosen = req.prompt[start:stop]
            result.extend(token_logprobs(chunk, chosen, [k] * len(chosen)))
        return result


def _put_all(batch: list[tuple[_Sink, EngineOutput | BaseException]]) -> None:
    for sink, item in batch:
        sink.queue.put_nowait(item)
