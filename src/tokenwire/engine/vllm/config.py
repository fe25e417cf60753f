"""tokenwire's options and requests in vLLM's terms: ``AsyncEngineArgs`` and ``SamplingParams``.

Engine arguments tokenwire does not know (``--tensor-parallel-size``, ``--enforce-eager``, ...)
are parsed by vLLM's own CLI parser, so every vLLM engine flag works as it does under
``vllm serve``. tokenwire's own flags (model, context length, batch size, dtype, max logprobs,
logprobs mode) win.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenwire.engine.base import EngineError, SamplingParams
from tokenwire.engine.vllm.worker import WORKER_EXTENSION

# vLLM imports it in its worker (tokenwire.engine.vllm.grammar needs vLLM to import).
GRAMMAR_PROCESSOR = "tokenwire.engine.vllm.grammar:GrammarLogitsProcessor"


def engine_args(
    model_dir: Path,
    *,
    max_model_len: int | None,
    max_num_seqs: int,
    dtype: str | None,
    extra: Sequence[str] = (),
    max_logprobs: int = 20,
    max_loras: int = 0,
    max_lora_rank: int = 16,
    max_num_batched_tokens: int | None = None,
    logprobs_mode: str = "raw_logprobs",
) -> Any:
    """``AsyncEngineArgs`` for ``model_dir``; ``extra`` are vLLM CLI flags passed through."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="tokenwire serve"))
    try:
        namespace = parser.parse_args(["--model", str(model_dir), *extra])
    except SystemExit as exc:  # argparse has printed why
        raise ValueError(f"bad vLLM engine arguments: {' '.join(extra)}") from exc
    args = AsyncEngineArgs.from_cli_args(namespace)
    args.max_num_seqs = max_num_seqs
    args.max_logprobs = max_logprobs
    args.logprobs_mode = logprobs_mode
    if max_model_len is not None:
        args.max_model_len = max_model_len
    if max_num_batched_tokens is not None:  # tokenwire's flag, vLLM's name and meaning
        args.max_num_batched_tokens = max_num_batched_tokens
    if dtype not in (None, "", "auto"):
        args.dtype = dtype
    if max_loras:
        args.enable_lora = True
        args.max_loras = max_loras
        args.max_lora_rank = max_lora_rank
        # The adapter registry keeps at most max_loras versions in use, and loads a replacement
        # before it drops the version replaced: one spare, so vLLM's CPU cache never evicts an
        # adapter (it would read it again from a path the trainer may have rewritten since).
        args.max_cpu_loras = max_loras + 1
    # tokenwire renders and decodes: vLLM sees token ids only.
    args.skip_tokenizer_init = True
    args.worker_extension_cls = WORKER_EXTENSION
    # Structured outputs: tokenwire's grammars, masked in the worker (vLLM's own need the
    # tokenizer turned off above).
    args.logits_processors = [GRAMMAR_PROCESSOR]
    args.disable_log_stats = True
    return args


def sampling_params(sampling: SamplingParams, logprobs_mode: str, final_only: bool = False) -> Any:
    """vLLM's ``SamplingParams`` for one sequence: ids only, streamed as deltas, or with
    ``final_only`` as one output at the end (as vLLM's own server answers a non-streamed
    request), which carries every id, logprob and weight-version span the deltas would have."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    from tokenwire.engine.vllm.grammar import grammar_args

    wants_logprobs = sampling.logprobs is not None or sampling.prompt_logprobs is not None
    if wants_logprobs and sampling.logprobs_mode != logprobs_mode:
        raise EngineError(
            f"this server's vLLM engine returns {logprobs_mode} (vLLM sets it per engine with "
            f"--logprobs-mode); {sampling.logprobs_mode} was asked for"
        )
    return VLLMSamplingParams(
        n=1,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(sampling.top_k, 0),
        min_p=sampling.min_p,
        seed=sampling.seed,
        min_tokens=sampling.min_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        logprobs=sampling.logprobs,
        logprob_token_ids=list(sampling.logprob_token_ids) if sampling.logprob_token_ids else None,
        prompt_logprobs=sampling.prompt_logprobs,
        output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA,
        detokenize=False,
        skip_special_tokens=False,
        extra_args=grammar_args(sampling.grammar) if sampling.grammar is not None else None,
    )
