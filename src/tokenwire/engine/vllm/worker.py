"""Methods tokenwire adds to each vLLM worker (vLLM's ``--worker-extension-cls``).

This module is imported inside vLLM's worker processes, which have tokenwire installed beside
vLLM; ``collective_rpc("tokenwire_reload_weights", ...)`` calls the method on every worker.
"""

from __future__ import annotations

from typing import Any

WORKER_EXTENSION = "tokenwire.engine.vllm.worker.TokenwireWorkerExtension"


class TokenwireWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``...)."""

    model_runner: Any

    def tokenwire_reload_weights(self, weights_path: str) -> None:
        """vLLM's in-place reload, then the CPU copy of a tied output layer made again.

        On CPU vLLM packs each linear weight for its GEMM kernels once, after loading. A tied
        ``lm_head`` shares the embedding's weight but loads nothing of its own, so the reload
        leaves its packed copy holding the OLD embedding: logprobs then drift by ~2e-2 from a
        forward with the new weights. Packing it again restores parity (~6e-6 measured).
        """
        from vllm.platforms import current_platform

        self.model_runner.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = head is not None and embed is not None and head.weight is embed.weight
        if tied and current_platform.is_cpu():
            head.quant_method.process_weights_after_loading(head)
