"""Every check of a request against the served model, in one place.

Schema checks (types, ranges) are pydantic's, in ``protocol``; what needs the model (its
vocabulary, context length, the server's limits) is checked here, once, with one vocabulary
size for every path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenwire.engine.base import GREEDY_TEMPERATURE, EngineFeature, MultiModalInput
from tokenwire.pipeline.context import ModelRuntime, ServingConfig
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.protocol.generate import SamplingParamsModel
from tokenwire.protocol.logprobs_in import logprob_input
from tokenwire.protocol.openai import SamplingFields
from tokenwire.text.token_text import LogprobInput

# Teacher scoring answers rows x ids float32 values: bounded so that one request cannot ask for
# gigabytes (at the default --max-logprobs, 8191 rows x 20 ids is 163,820).
MAX_PROMPT_TOKEN_ID_LOGPROBS = 1 << 20
# A sampled step's support holds at most top_k ids (vLLM caps its mask buffer at 2048 too).
MAX_SAMPLING_MASK_IDS = 2048


def check_token_ids(runtime: ModelRuntime, token_ids: Sequence[int], param: str) -> None:
    """Every id inside the vocabulary (schemas already refused negatives)."""
    vocab_size = runtime.vocab_size
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"{param}.{index}: token id {token_id} is out of vocabulary "
                f"(ids outside the vocabulary 0..{vocab_size - 1} have no token)",
                param,
            )


def check_prompt(
    runtime: ModelRuntime,
    token_ids: Sequence[int],
    max_tokens: int | None,
    *,
    param: str,
    checked: int = 0,
) -> int:
    """Validate a prompt against the model; return the max_tokens to use (default: what fits).
    ``checked``: how many leading ids were checked already (extend's previous ids)."""
    if not token_ids:
        raise InvalidRequest("The prompt is empty", param)
    # The length first: it costs nothing, and walking the ids of a prompt far over it (a
    # rendered tool list of millions of tokens) held the event loop for tens of milliseconds.
    limit = runtime.max_model_len
    if len(token_ids) >= limit:
        raise InvalidRequest(
            f"The prompt has {len(token_ids)} tokens, but this model's maximum context length is "
            f"{limit} tokens, which leaves no room for output.",
            param,
        )
    check_token_ids(runtime, token_ids[checked:] if checked else token_ids, param)
    room = limit - len(token_ids)
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, "
            f"{max_tokens} for the completion).",
            "max_tokens",
        )
    return max_tokens


def check_n(config: ServingConfig, n: int) -> None:
    if n < 1:  # the schemas' non-negative integer type lets 0 through
        raise InvalidRequest(f"n must be at least 1, got {n}", "n")
    if n > config.max_n:
        raise InvalidRequest(f"n must be at most {config.max_n}, got {n}", "n")


@dataclass(frozen=True, slots=True)
class ValidPrompt:
    """A prompt checked against the model with its sampling params (``max_tokens`` resolved,
    ``n`` within the limit): what a generation job starts from, and only from this."""

    token_ids: list[int]
    sampling: SamplingParamsModel
    media: MultiModalInput | None = None
    # Score the prompt only: the engine runs one step for its prompt logprobs and the choice
    # keeps no output (SGLang's ``max_new_tokens: 0``).
    prompt_only: bool = False
    # Report each output token's sampling support (``return_sampling_mask``).
    sampling_mask: bool = False
    cache_salt: str | None = None


def valid_prompt(
    config: ServingConfig,
    runtime: ModelRuntime,
    token_ids: list[int],
    sampling: SamplingParamsModel,
    *,
    param: str,
    media: MultiModalInput | None = None,
    prompt_only: bool = False,
    sampling_mask: bool = False,
    cache_salt: str | None = None,
) -> ValidPrompt:
    """A generate request's prompt and ``sampling_params``, checked."""
    max_tokens = check_prompt(runtime, token_ids, sampling.max_tokens, param=param)
    check_n(config, sampling.n)
    check_scoring(runtime, token_ids, sampling, sampling_mask=sampling_mask)
    if sampling.max_tokens != max_tokens:
        sampling = sampling.model_copy(update={"max_tokens": max_tokens})
    return ValidPrompt(token_ids, sampling, media, prompt_only, sampling_mask, cache_salt)


def check_scoring(
    runtime: ModelRuntime,
    token_ids: Sequence[int],
    sampling: SamplingParamsModel,
    *,
    sampling_mask: bool,
) -> None:
    """Teacher scoring, ``logprob_token_ids`` and sampling masks: served by the engine, and
    within the prompt, the vocabulary and the bounds above."""
    rows = sampling.prompt_logprob_token_ids
    wanted: list[tuple[EngineFeature, str]] = []
    if rows is not None:
        wanted.append(("prompt_token_id_logprobs", "sampling_params.prompt_logprob_token_ids"))
    if sampling.logprob_token_ids:
        wanted.append(("logprob_token_ids", "sampling_params.logprob_token_ids"))
    if sampling_mask:
        wanted.append(("sampling_mask", "return_sampling_mask"))
    for feature, field in wanted:
        if feature not in runtime.engine.features:
            raise InvalidRequest(f"{field} is not supported by this server's engine", field)
    if sampling.logprob_token_ids:
        check_token_ids(runtime, sampling.logprob_token_ids, "sampling_params.logprob_token_ids")
    if rows is not None:
        _check_prompt_targets(runtime, len(token_ids), rows, sampling.prompt_logprob_start or 0)
    # Greedy draws from its argmax alone; a sampled step's mask is bounded by its top_k.
    sampled = sampling.temperature >= GREEDY_TEMPERATURE
    if sampling_mask and sampled and not 0 < sampling.top_k <= MAX_SAMPLING_MASK_IDS:
        raise InvalidRequest(
            f"return_sampling_mask with sampling (temperature > 0) needs 0 < top_k <= "
            f"{MAX_SAMPLING_MASK_IDS}, which bounds each step's mask; got top_k "
            f"{sampling.top_k}",
            "sampling_params.top_k",
        )


def _check_prompt_targets(
    runtime: ModelRuntime, prompt_len: int, rows: list[list[int]], start: int
) -> None:
    """One row per scored prompt position (vLLM's rule), ids in the vocabulary or -1."""
    field = "sampling_params.prompt_logprob_token_ids"
    num_rows = prompt_len - 1 - start
    if num_rows < 1:
        raise InvalidRequest(
            f"prompt_logprob_start must be less than the prompt's length minus 1 "
            f"({prompt_len - 1}): the last prompt token predicts no prompt token; got {start}",
            "sampling_params.prompt_logprob_start",
        )
    if len(rows) != num_rows:
        raise InvalidRequest(
            f"prompt_logprob_token_ids has {len(rows)} rows, but the prompt has {num_rows} "
            "scored rows (prompt_len - 1 - prompt_logprob_start).",
            field,
        )
    width = max(map(len, rows))
    if num_rows * width > MAX_PROMPT_TOKEN_ID_LOGPROBS:
        raise InvalidRequest(
            f"prompt_logprob_token_ids asks for {num_rows} rows x {width} ids, more than "
            f"{MAX_PROMPT_TOKEN_ID_LOGPROBS} logprobs in one request",
            field,
        )
    vocab_size = runtime.vocab_size
    for i, row in enumerate(rows):
        if row and max(row) >= vocab_size:
            j = next(j for j, token_id in enumerate(row) if token_id >= vocab_size)
            raise InvalidRequest(
                f"{field}.{i}.{j}: token id {row[j]} is out of vocabulary (ids outside the "
                f"vocabulary 0..{vocab_size - 1} have no token; -1 pads a row)",
                field,
            )


def check_output_ids(runtime: ModelRuntime, token_ids: Sequence[int] | None, where: str) -> None:
    """Output ids sent back for derendering: present, within the context and the vocabulary."""
    if not token_ids:
        raise InvalidRequest(f"{where} has empty or null token_ids", "token_ids")
    if len(token_ids) > runtime.max_model_len:
        raise InvalidRequest(
            f"{where} has {len(token_ids)} token ids, more than max_model_len "
            f"({runtime.max_model_len})",
            "token_ids",
        )
    check_token_ids(runtime, token_ids, "token_ids")


def request_prompt(
    config: ServingConfig,
    runtime: ModelRuntime,
    body: SamplingFields,
    token_ids: list[int],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    param: str,
    media: MultiModalInput | None = None,
    checked: int = 0,
) -> ValidPrompt:
    """A chat or completion request's prompt with the generate ``sampling_params`` it makes.

    ``max_tokens`` 0 (an echo of the prompt alone) runs one step whose token is dropped.
    ``checked``: how many leading ids were checked already.
    """
    sampling = request_sampling(
        config,
        runtime,
        body,
        token_ids,
        max_tokens=max_tokens,
        logprobs=logprobs,
        param=param,
        checked=checked,
    )
    prompt_only = max_tokens == 0
    return ValidPrompt(token_ids, sampling, media, prompt_only, cache_salt=body.cache_salt)


def request_sampling(
    config: ServingConfig,
    runtime: ModelRuntime,
    body: SamplingFields,
    token_ids: Sequence[int],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    param: str,
    checked: int = 0,
) -> SamplingParamsModel:
    """The generate ``sampling_params`` a request makes for its prompt ``token_ids``, the
    prompt checked: ``request_prompt`` without its ``ValidPrompt``, for an answer that sends ids
    it never runs (/extend's, which may be a remembered prompt's, chained)."""
    max_tokens = 1 if max_tokens == 0 else max_tokens
    max_tokens = check_prompt(runtime, token_ids, max_tokens, param=param, checked=checked)
    try:
        sampling = body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    check_n(config, sampling.n)
    return sampling


def logprob_columns(content: list[Any], token_ids: Sequence[int], where: str) -> LogprobInput:
    """A client's ``logprobs.content``, one entry per output id, as the decoder's columns."""
    try:
        columns = logprob_input(content)
    except ValueError as exc:
        raise InvalidRequest(f"{where}: {exc}", "logprobs") from exc
    entry_ids = columns.token_ids
    if len(entry_ids) != len(token_ids):
        raise InvalidRequest(
            f"{where} has {len(entry_ids)} logprob entries for {len(token_ids)} token ids",
            "logprobs",
        )
    if entry_ids != list(token_ids):
        position, entry_id, token_id = next(
            (position, a, b)
            for position, (a, b) in enumerate(zip(entry_ids, token_ids, strict=True))
            if a != b
        )
        raise InvalidRequest(
            f"{where}: logprob entry {position} is for token {entry_id}, "
            f"but the token there is {token_id}",
            "logprobs",
        )
    return columns
