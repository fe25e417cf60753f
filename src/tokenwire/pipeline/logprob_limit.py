"""``--max-logprobs``: the one bound on how many logprobs a request may ask, in every dialect.

vLLM checks ``logprobs``, ``prompt_logprobs`` and the row width of ``prompt_logprob_token_ids``
against its ``--max-logprobs`` (default 20, -1: the vocabulary size). tokenwire checks the same
before a request is admitted, under the name of the field the client sent (``top_logprobs``,
``sampling_params.prompt_logprobs``, ``top_logprobs_num``, ...), so the 400 says which field and
which limit. A ``-1`` request (vLLM's "the whole vocabulary") asks for the limit.
"""

from __future__ import annotations

from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.protocol.generate import GenerateRequest
from tokenwire.protocol.openai import ChatCompletionRequest, CompletionRequest
from tokenwire.protocol.sglang import SGLangGenerateRequest

LogprobRequest = GenerateRequest | ChatCompletionRequest | CompletionRequest | SGLangGenerateRequest


def max_logprobs(pipeline: Pipeline) -> int:
    """The resolved limit: ``--max-logprobs``, or the vocabulary size for -1."""
    limit = pipeline.config.max_logprobs
    return pipeline.ready().vocab_size if limit < 0 else limit


def apply_logprob_limit(pipeline: Pipeline, body: LogprobRequest) -> None:
    """Refuse a count over the limit (400 naming the field); turn -1 into the limit."""
    limit = max_logprobs(pipeline)
    if isinstance(body, GenerateRequest):
        params = body.sampling_params
        params.logprobs = _checked(limit, params.logprobs, "sampling_params.logprobs")
        params.prompt_logprobs = _checked(
            limit, params.prompt_logprobs, "sampling_params.prompt_logprobs"
        )
        rows = params.prompt_logprob_token_ids
        width = max(map(len, rows)) if rows else 0
        if width > limit:
            raise InvalidRequest(
                f"sampling_params.prompt_logprob_token_ids: requested {width} token ids per "
                f"row, which is greater than max allowed: {limit} (the server's "
                "--max-logprobs)",
                "sampling_params.prompt_logprob_token_ids",
            )
        return
    if isinstance(body, SGLangGenerateRequest):
        _checked(limit, body.top_logprobs_num, "top_logprobs_num")
        return
    if isinstance(body, ChatCompletionRequest):
        _checked(limit, body.top_logprobs, "top_logprobs")
    else:
        _checked(limit, body.logprobs, "logprobs")
    body.prompt_logprobs = _checked(limit, body.prompt_logprobs, "prompt_logprobs")


def _checked(limit: int, value: int | None, param: str) -> int | None:
    if value is None:
        return None
    if value > limit:
        raise InvalidRequest(
            f"{param}: requested {value} logprobs, which is greater than max allowed: {limit} "
            "(the server's --max-logprobs; -1 there allows the whole vocabulary)",
            param,
        )
    return limit if value < 0 else value
