"""The model on its device: loading it, prefill and decode forwards, the KV cache, sampling.

The scheduler decides which rows run; this module only turns rows into tensors and back. Every
method runs on the engine thread, under the scheduler's ``torch.inference_mode``.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenwire.engine.base import EngineError, TokenLogprob, WeightsError
from tokenwire.engine.eos import eos_token_ids, generation_eos
from tokenwire.engine.hf import invariance
from tokenwire.engine.hf.expert_weights import expert_views
from tokenwire.engine.hf.handoff import PrefillProgress, Request
from tokenwire.engine.hf.host_memory import return_free_heap_to_os
from tokenwire.engine.hf.kv_cache import PaddedBatchCache
from tokenwire.engine.hf.lora import AdapterSlots
from tokenwire.engine.hf.mrope import prefill_positions
from tokenwire.engine.hf.multimodal import RequestMedia, VisionSpec, prefill_media_kwargs
from tokenwire.engine.hf.prefix_cache import LayerKV, RowKV
from tokenwire.engine.hf.routing import RoutingCapture
from tokenwire.engine.hf.sampling import RowSampler, SampleResult, sample, token_logprobs
from tokenwire.engine.stopping import suppressed_ids
from tokenwire.engine.weight_rules import Layout, check_tensors

# Prompt positions per log_softmax chunk when computing prompt logprobs.
PROMPT_LOGPROB_CHUNK = 256


def pick_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """fp32 on CPU (trainer parity, and CPU half matmuls are slow); bf16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


@dataclass(slots=True)
class PromptScores:
    """What a prefill scored of its (single) row's prompt, each part only when asked."""

    logprobs: list[TokenLogprob | None] | None = None  # top-k; None for the first position
    token_id_logprobs: np.ndarray | None = None  # [rows, ids] float32: the given ids'


@dataclass(slots=True)
class Prefilled:
    """A prefill forward's result, kept until sampling says which of its rows live on."""

    logits: torch.Tensor  # [n, V] float32: each row's next-token logits
    prompt: PromptScores | None  # the first row's, when it asked
    cache: Any  # the group's own DynamicCache
    mask: torch.Tensor  # [n, P] bool, left-padded


def _padded_past(pasts: list[LayerKV | None], cached: list[int]) -> LayerKV:
    """Rows' cached KV as one [n, H, max cached, D] past per layer, each row right-aligned."""
    first = next(p for p in pasts if p is not None)
    n, c_max = len(pasts), max(cached)
    layers: LayerKV = []
    for layer, (k0, v0) in enumerate(first):
        keys = k0.new_zeros(n, k0.shape[0], c_max, k0.shape[2])
        values = v0.new_zeros(n, v0.shape[0], c_max, v0.shape[2])
        for i, (past, c) in enumerate(zip(pasts, cached, strict=True)):
            if past is not None and c:
                keys[i, :, c_max - c :] = past[layer][0]
                values[i, :, c_max - c :] = past[layer][1]
        layers.append((keys, values))
    return layers


class ModelRunner:
    """One transformers model, its running KV cache and its samplers' device work."""

    def __init__(
        self,
        model_dir: Path,
        *,
        vision: VisionSpec | None,
        vocab_size: int,
        max_num_seqs: int,
        device: str | None,
        dtype: torch.dtype | str | None,
        max_loras: int = 0,
        max_lora_rank: int = 0,
        threads: int,
        capture_routing: bool = False,
    ) -> None:
        self.model_dir = model_dir
        self.threads = threads
        self.vision = vision
        self.vocab_size = vocab_size  # the config's until load() reads the embedding size
        self.max_num_seqs = max_num_seqs
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.eos_token_ids: tuple[int, ...] = ()
        self.model: Any = None
        self.weights: dict[str, torch.Tensor] = {}
        self.layout: Layout = {}  # the weights' shapes: what new tensors are checked against
        self.cache: PaddedBatchCache | None = None
        self._num_layers = 0
        self._cache_kwarg = "cache"
        self._row_padding = invariance.RowPadding(1)  # load() probes the real block
        self._max_loras, self._max_lora_rank = max_loras, max_lora_rank
        self.adapters: AdapterSlots | None = None  # with LoRA on, once loaded
        self._capture_routing = capture_routing
        self.routing: RoutingCapture | None = None  # with capture on, once loaded
        # Fused expert weights: their per-expert views by checkpoint name.
        self._expert_parts: dict[str, dict[str, torch.Tensor]] = {}
        self._part_names: frozenset[str] = frozenset()

    def load(self) -> None:
        """Load the weights, read vocab size and eos ids, and warm up."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if self.vision is not None else AutoModelForCausalLM
        # On the engine thread, which runs every forward (OpenMP's thread count is per thread).
        torch.set_num_threads(self.threads)
        invariance.register()
        model = auto.from_pretrained(
            self.model_dir, dtype=self.dtype, attn_implementation=invariance.ATTENTION
        )
        model.to(self.device).eval()
        self._row_padding = invariance.pad_linear_rows(
            model, invariance.gemm_row_block(self.device)
        )
        text_config = model.config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise EngineError("the hf engine supports full-attention models only")
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.eos_token_ids = eos_token_ids(
            generation_eos(self.model_dir), getattr(text_config, "eos_token_id", None)
        )
        self.model = model
        # Every weight by its checkpoint name (tied ones under both; fused experts under their
        # per-expert names too), read once: new weights are checked against its shapes
        # (``layout``) and copied into it.
        self.weights: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
        self._expert_parts = expert_views(model)
        for parts in self._expert_parts.values():
            self.weights.update(parts)
        self._part_names = frozenset(n for parts in self._expert_parts.values() for n in parts)
        self.layout = {name: tuple(weight.shape) for name, weight in self.weights.items()}
        if self._max_loras:
            # One slot beyond --max-loras: a load fills it before the version it replaces
            # leaves (the adapter registry counts the versions against --max-loras).
            self.adapters = AdapterSlots(
                model, max_loras=self._max_loras + 1, max_rank=self._max_lora_rank
            )
        # transformers 5.24 renamed the forward's past_key_values to cache; .venv-vllm has 5.19.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._num_layers = int(text_config.num_hidden_layers)
        if self._capture_routing:
            self.routing = RoutingCapture(model)
        self.reset_cache()
        self._warm_up()

    def swap_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a checkpoint's tensors into the model in place, all or nothing.

        Every tensor must name a weight of the same shape, and every weight must be given
        (or share its storage with one that is: tied embeddings are saved once). Checked before
        anything is copied, so a mismatch leaves the old weights untouched.
        """
        check_tensors(self.layout, ((name, t.dtype, tuple(t.shape)) for name, t in tensors.items()))
        missing = self.missing_weights(tensors)
        if missing:
            raise WeightsError(f"tensors missing from the checkpoint: {', '.join(missing[:5])}")
        for name, tensor in tensors.items():
            self.copy_weight(name, tensor)

    def missing_weights(self, given: Collection[str]) -> list[str]:
        """The model's weights ``given`` leaves out; a tied weight is given with its twin, a
        fused expert weight with all its per-expert parts (which are never missing themselves:
        they are other names of it)."""
        params, parts, given = self.weights, self._part_names, set(given)
        storages = {params[n].data_ptr() for n in given if n in params and n not in parts}
        whole = {n for n, views in self._expert_parts.items() if all(v in given for v in views)}
        return [
            n
            for n, p in params.items()
            if n not in given and n not in parts and n not in whole and p.data_ptr() not in storages
        ]

    def copy_weight(self, name: str, tensor: torch.Tensor) -> None:
        """One checked tensor into the model (engine thread only)."""
        with torch.no_grad():
            self.weights[name].copy_(tensor)

    def reset_cache(self) -> None:
        """An empty running cache (at load, after a failed decode step, when the batch empties)."""
        if self.cache is not None:
            self.cache.release()
        self.cache = PaddedBatchCache(self._num_layers, self.device)

    def release_idle_memory(self) -> None:
        """Free the batch's KV buffers (sized for its peak) and the allocator's free pages."""
        self.reset_cache()
        return_free_heap_to_os()

    def _warm_up(self) -> None:
        """One tiny prefill + decode so the first request does not pay for lazy init."""
        with torch.inference_mode():
            ids = torch.tensor([[1, 2, 3]], device=self.device) % self.vocab_size
            mask = torch.ones_like(ids, dtype=torch.bool)
            pos = torch.arange(3, device=self.device).unsqueeze(0)
            self.model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
            if self.vision is not None:  # the vision tower too: one image of one merged token
                m = self.vision.merge_size
                media = RequestMedia(
                    placeholders=((0, 1),),
                    grids=((1, m, m),),
                    pixel_values=(torch.zeros(m * m, self.vision.patch_dim),),
                )
                prompt = [self.vision.image_token_id, 1]
                positions, _ = prefill_positions([prompt], [media], 2, m, self.device)
                self.model(
                    input_ids=torch.tensor([prompt], device=self.device),
                    attention_mask=torch.ones(1, 2, dtype=torch.bool, device=self.device),
                    position_ids=positions,
                    logits_to_keep=1,
                    **prefill_media_kwargs([media], self.device, self.dtype),
                )

    def prefill(self, group: list[Request], pasts: list[LayerKV | None]) -> Prefilled:
        """Run a group's left-padded prompts in their own cache and give each row a sampler.

        ``pasts[i]`` is row i's first ``num_cached`` context tokens' KV from the prefix cache
        (None: none): the forward then takes only the rest. Row i's columns are then [padding,
        its past (right-aligned in the widest past), padding, the rest (right-aligned)]; the mask
        and explicit positions make the padding in between invisible.
        Sets each row's rope delta and frees its pixels (they live in the KV cache now).
        """
        from transformers import DynamicCache

        cached = [req.num_cached for req in group]
        contexts = [req.context[c:] for req, c in zip(group, cached, strict=True)]
        n, c_max, p = len(group), max(cached), max(map(len, contexts))
        ids = torch.zeros(n, p, dtype=torch.long)
        mask = torch.zeros(n, c_max + p, dtype=torch.bool)
        for i, (context, c) in enumerate(zip(contexts, cached, strict=True)):
            ids[i, p - len(context) :] = torch.tensor(context)
            mask[i, c_max + p - len(context) :] = True
            mask[i, c_max - c : c_max] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, c_max:]
        if any(r.media is not None for r in group):  # alone, never cached (see the scheduler)
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
        cache = (
            DynamicCache(ddp_cache_data=_padded_past(pasts, cached)) if c_max else DynamicCache()
        )
        wants_prompt = group[0].wants_prompt_logprobs
        self._row_padding.active = group[0].seeded  # a seeded request is prefilled alone
        last_logits, hidden = self._prefill_forward(
            group, ids, mask, positions, cache, wants_prompt
        )
        if self.routing is not None:
            routes = self.routing.take().reshape(n, p, *self.routing.row_shape)
            for i, (req, context, c) in enumerate(zip(group, contexts, cached, strict=True)):
                assert req.routes is not None
                req.routes.add(c, routes[i, p - len(context) :])
        for req in group:
            req.media = None  # the pixels live in the KV cache now; free them for long decodes
        scores = None
        if hidden is not None:
            scores = PromptScores()
            self._score_prompt(hidden, group[0], len(group[0].prompt) - hidden.shape[0], scores)
        self._give_samplers(group)
        return Prefilled(last_logits, scores, cache, mask)

    def prefill_chunk(self, req: Request, past: LayerKV | None, end: int) -> Prefilled | None:
        """Prefill context tokens up to ``end`` of a request prefilled alone, chunk by chunk.

        The first chunk starts after its ``num_cached`` tokens (``past``: their KV); each chunk
        attends over the request's own cache of the earlier ones (one row, no padding, so the
        positions are plain). Until ``end`` reaches the context's end the request's progress
        holds that cache and None is returned; the last chunk gives its ``Prefilled``.
        """
        from transformers import DynamicCache

        progress = req.progress
        if progress is None:
            cache = (
                DynamicCache(ddp_cache_data=_padded_past([past], [req.num_cached]))
                if past is not None
                else DynamicCache()
            )
            progress = req.progress = PrefillProgress(cache, req.num_cached, None)
        start = progress.done
        ids = torch.tensor([req.context[start:end]], device=self.device)
        mask = torch.ones(1, end, dtype=torch.bool, device=self.device)
        positions = torch.arange(start, end, device=self.device).unsqueeze(0)
        wants_prompt = req.wants_prompt_logprobs
        self._row_padding.active = req.seeded
        last_logits, hidden = self._prefill_forward(
            [req], ids, mask, positions, progress.cache, wants_prompt
        )
        if self.routing is not None:
            assert req.routes is not None
            req.routes.add(start, self.routing.take())
        if hidden is not None:
            if progress.scores is None:
                progress.scores = PromptScores()
            self._score_prompt(hidden, req, start, progress.scores)
        progress.done = end
        if end < len(req.context):
            return None
        req.progress = None
        self._give_samplers([req])
        return Prefilled(last_logits, progress.scores, progress.cache, mask)

    def _give_samplers(self, group: list[Request]) -> None:
        for req in group:
            if req.sampler is not None:  # recomputed after a pause: same history, same generator
                continue
            stops = suppressed_ids(req.params, self.eos_token_ids)
            req.sampler = RowSampler.create(
                req.params, req.prompt, stops, self.vocab_size, self.device
            )

    def _prefill_forward(
        self,
        group: list[Request],
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        keep_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prefill forward: each row's last logits [n, V], and with ``keep_hidden`` the
        single row's last hidden states [P, H] for prompt logprobs.

        Prompt logprobs never materialise [P, V] logits (2.5 GB for a 4k prompt with a 150k
        vocabulary): the hidden states are projected a chunk of positions at a time.
        Pixel values and grids go in here and only here. A request with media is always
        prefilled alone (see the scheduler's ``_next_group``): a vision tower forward is costly,
        and a shared group would stall text prompts behind it.
        """
        self._select_adapters(group)
        inputs = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": positions,
            self._cache_kwarg: cache,
            "use_cache": True,
            **prefill_media_kwargs([r.media for r in group], self.device, self.dtype),
        }
        if not keep_hidden:
            return self.model(**inputs, logits_to_keep=1).logits[:, -1].float(), None
        hidden = self.model.base_model(**inputs).last_hidden_state
        return self._project(hidden[:, -1]).float(), hidden[0]

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states -> logits: what the causal LM head does after the decoder."""
        return self.model.get_output_embeddings()(hidden)

    @staticmethod
    def prefilled_row(prefilled: Prefilled, row: int) -> RowKV:
        """Row ``row`` of a prefill's own cache, for the prefix cache."""
        layers = [(layer.keys, layer.values) for layer in prefilled.cache.layers]
        return RowKV(layers, row, prefilled.mask[row].nonzero().squeeze(1))

    def running_row(self, row: int) -> RowKV:
        """Cache row ``row`` of the running batch, for the prefix cache."""
        assert self.cache is not None
        cols = self.cache.window_mask()[row].nonzero().squeeze(1)
        return RowKV(self.cache.window_kv(), row, cols)

    def join(self, prefilled: Prefilled, alive: list[int]) -> None:
        """Move the prefilled rows at indexes ``alive`` into the running cache, in order."""
        assert self.cache is not None
        kv = [(layer.keys, layer.values) for layer in prefilled.cache.layers]
        row_mask = prefilled.mask
        if len(alive) < row_mask.shape[0]:
            sel = torch.tensor(alive, device=self.device)
            kv = [(k.index_select(0, sel), v.index_select(0, sel)) for k, v in kv]
            row_mask = row_mask.index_select(0, sel)
        self.cache.join(kv, row_mask, rows_cap=self.max_num_seqs)

    def decode(self, rows: list[Request]) -> torch.Tensor:
        """One decode forward for every running row (row i == cache row i): [B, V] logits."""
        cache = self.cache
        assert cache is not None
        attention_mask = cache.begin_decode()
        ids = torch.tensor([r.last_token for r in rows], device=self.device).unsqueeze(1)
        # The last sampled token sits right after the prompt and the earlier outputs; M-RoPE
        # rows shift by their own delta (a [B, 1] tensor: Qwen2-VL repeats it on its 3 axes).
        positions = torch.tensor(
            [len(r.prompt) + len(r.output) - 1 + r.rope_delta for r in rows], device=self.device
        ).unsqueeze(1)
        # Seeded rows attend over exactly their own tokens (see invariance.py).
        exact = tuple((i, len(r.prompt) + len(r.output)) for i, r in enumerate(rows) if r.seeded)
        self._row_padding.active = bool(exact)
        self._select_adapters(rows)
        out = self.model(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **({"exact_rows": exact} if exact else {}),
            **{self._cache_kwarg: cache},
        )
        cache.commit(1)
        if self.routing is not None:
            routes = self.routing.take()
            for i, r in enumerate(rows):
                assert r.routes is not None
                r.routes.add(len(r.prompt) + len(r.output) - 1, routes[i : i + 1])
        return out.logits[:, -1].float()

    def _select_adapters(self, rows: list[Request]) -> None:
        """Tell the adapted linears which slot each row of the next forward uses."""
        if self.adapters is None:
            return
        slots = [r.adapter_slot for r in rows]
        self.adapters.rows = torch.tensor(slots, device=self.device) if any(slots) else None

    def sample(self, rows: list[Request], logits: torch.Tensor) -> SampleResult:
        """One token per row, recorded in the row's sampler (the history its penalties use)."""
        samplers = [r.sampler for r in rows]
        assert all(s is not None for s in samplers)
        result = sample(logits, samplers)  # type: ignore[arg-type]
        for sampler, token in zip(samplers, result.token_ids, strict=True):
            assert sampler is not None
            sampler.record(token)
        return result

    def drop(self, rows: list[int]) -> list[tuple[int, int]]:
        """Drop cache rows; returns the (src, dst) row moves the caller must mirror."""
        assert self.cache is not None
        return self.cache.drop(rows)

    def _score_prompt(
        self, hidden: torch.Tensor, req: Request, begin: int, scores: PromptScores
    ) -> None:
        """Add to ``scores`` what ``req`` asked of prompt positions ``begin ..
        begin + len(hidden)`` (``hidden``: their last hidden states), projecting a chunk of
        positions at a time.

        Hidden position t predicts prompt token t + 1. Top-k logprobs cover every token but the
        first; the given ids' (teacher scoring) cover the tokens after ``prompt_logprob_start``.
        """
        params = req.params
        prompt = req.prompt
        k = params.prompt_logprobs
        if k is not None and scores.logprobs is None:
            scores.logprobs = [None]
        given = params.prompt_logprob_token_ids
        start = params.prompt_logprob_start
        targets: torch.Tensor | None = None
        if given is not None:
            targets = torch.tensor(given, dtype=torch.long, device=hidden.device)
            if scores.token_id_logprobs is None:
                scores.token_id_logprobs = np.empty(tuple(targets.shape), dtype=np.float32)
        first = max(begin, 0 if k is not None else start)
        last = min(begin + hidden.shape[0], len(prompt) - 1)
        for lo_pos in range(first, last, PROMPT_LOGPROB_CHUNK):
            hi_pos = min(lo_pos + PROMPT_LOGPROB_CHUNK, last)
            chunk = self._project(hidden[lo_pos - begin : hi_pos - begin]).float()
            if scores.logprobs is not None:
                chosen = prompt[lo_pos + 1 : hi_pos + 1]
                scores.logprobs.extend(token_logprobs(chunk, chosen, [k or 0] * len(chosen)))
            if targets is not None and scores.token_id_logprobs is not None and hi_pos > start:
                lo = max(lo_pos, start)
                rows = targets[lo - start : hi_pos - start]
                lp = torch.log_softmax(chunk[lo - lo_pos :], dim=-1)
                picked = lp.gather(1, rows.clamp(min=0)).masked_fill(rows < 0, float("-inf"))
                scores.token_id_logprobs[lo - start : hi_pos - start] = picked.cpu().numpy()
