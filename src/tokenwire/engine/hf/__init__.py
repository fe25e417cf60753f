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
with images is prefilled alone with its pixel values and explicit 3D M-RoPE positions
(``mrope``), then decodes in the shared batch like any other row: its position is its token index
plus its own rope delta (0 for text rows), kept on the request so it follows the row through cache
moves.

Threads: every torch call runs on one engine thread; the asyncio side sends commands through a
thread-safe queue and receives outputs through ``loop.call_soon_threadsafe`` into per-request
``asyncio.Queue``s (torch work on the event loop slowed a measured loop by ~27%).

Modules: ``engine`` (``HFEngine``, the async front clients call), ``handoff`` (what crosses the
thread boundary), ``scheduler`` (the step loop), ``runner`` (the model, its forwards, KV cache and
sampling calls), and below them ``kv_cache``, ``sampling``, ``multimodal`` and ``mrope``.
"""

from tokenwire.engine.hf.engine import HFEngine

__all__ = ["HFEngine"]
