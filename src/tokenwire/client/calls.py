"""Each endpoint once: its method, path, JSON body and how to read the answer.

``Client`` and ``AsyncClient`` only send these, so the two cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from tokenwire.client.errors import status_error
from tokenwire.client.types import (
    ChatCompletion,
    Completion,
    Extension,
    GenerateChunk,
    GenerateResult,
    ModelCard,
    Prompt,
    Tokens,
)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

Message = Mapping[str, Any] | BaseModel
Messages = Sequence[Message]


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    method: str
    path: str
    read: Callable[[Any], T]  # gets the decoded JSON answer (None for an empty body)
    body: Any = None
    params: dict[str, Any] | None = None  # query parameters (the control routes take some)


def jsonable(value: Any) -> Any:
    """Pydantic models (the server's own request models, or answers of this client) as JSON."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, Mapping):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    return value


def _post(path: str, read: Callable[[Any], T], **body: Any) -> Call[T]:
    return Call("POST", path, read, jsonable({k: v for k, v in body.items() if v is not None}))


def _list_of(kind: type[M]) -> Callable[[Any], list[M]]:
    return lambda data: [kind.model_validate(item) for item in data]


def models() -> Call[list[ModelCard]]:
    return Call("GET", "/v1/models", lambda data: _list_of(ModelCard)(data["data"]))


def version() -> Call[str]:
    return Call("GET", "/version", lambda data: str(data["version"]))


def tokenize(prompt: str, **fields: Any) -> Call[Tokens]:
    return _post("/tokenize", Tokens.model_validate, prompt=prompt, **fields)


def tokenize_chat(messages: Messages, **fields: Any) -> Call[Tokens]:
    return _post("/tokenize", Tokens.model_validate, messages=messages, **fields)


def detokenize(tokens: Sequence[int]) -> Call[str]:
    return _post("/detokenize", lambda data: str(data["prompt"]), tokens=list(tokens))


def render_chat(messages: Messages, **fields: Any) -> Call[Prompt]:
    return _post("/v1/chat/completions/render", Prompt.model_validate, messages=messages, **fields)


def render_completion(prompt: Any, **fields: Any) -> Call[list[Prompt]]:
    return _post("/v1/completions/render", _list_of(Prompt), prompt=prompt, **fields)


def extend(
    previous_token_ids: Sequence[int],
    previous_messages: Messages,
    messages: Messages,
    **fields: Any,
) -> Call[Extension]:
    return _post(
        "/v1/chat/completions/extend",
        Extension.model_validate,
        previous_token_ids=list(previous_token_ids),
        previous_messages=previous_messages,
        messages=messages,
        **fields,
    )


def extend_by_reference(
    previous_prompt: str,
    completion_token_ids: Sequence[int],
    reply: Mapping[str, Any],
    messages: Messages,
    **fields: Any,
) -> Call[Extension]:
    return _post(
        "/v1/chat/completions/extend",
        Extension.model_validate,
        previous_prompt=previous_prompt,
        completion_token_ids=list(completion_token_ids),
        reply=dict(reply),
        messages=messages,
        **fields,
    )


def generate_body(
    prompt: Prompt | Sequence[int], sampling_params: Mapping[str, Any] | None, fields: Any
) -> dict[str, Any]:
    """A render/extend answer (its sampling params updated by ``sampling_params``) or raw ids."""
    if isinstance(prompt, Prompt):
        body = prompt.model_dump(
            include={"request_id", "token_ids", "features", "model", "cache_salt", "priority"},
            exclude_none=True,
        )
        body["sampling_params"] = {**prompt.sampling_params, **(sampling_params or {})}
    else:
        body = {"token_ids": list(prompt), "sampling_params": dict(sampling_params or {})}
    return {**body, **jsonable(fields)}


def generate(
    prompt: Prompt | Sequence[int], sampling_params: Mapping[str, Any] | None, **fields: Any
) -> Call[GenerateResult]:
    body = generate_body(prompt, sampling_params, fields)
    return Call("POST", "/inference/v1/generate", GenerateResult.model_validate, body)


def abort(request_ids: Sequence[str] | None) -> Call[int]:
    """How many requests were aborted; ``None`` aborts every request in flight."""
    ids = list(request_ids) if request_ids is not None else None
    return _post("/abort_requests", lambda data: int(data["aborted"]), request_ids=ids)


def derender_chat(
    generate_result: GenerateResult | Mapping[str, Any], **fields: Any
) -> Call[ChatCompletion]:
    return _post(
        "/v1/chat/completions/derender",
        ChatCompletion.model_validate,
        generate_response=generate_result,
        **fields,
    )


def derender_completion(
    generate_results: Sequence[GenerateResult | Mapping[str, Any]], **fields: Any
) -> Call[Completion]:
    return _post(
        "/v1/completions/derender",
        Completion.model_validate,
        generate_responses=list(generate_results),
        **fields,
    )


def chat_completion(messages: Messages, **fields: Any) -> Call[ChatCompletion]:
    return _post("/v1/chat/completions", ChatCompletion.model_validate, messages=messages, **fields)


def completion(prompt: Any, **fields: Any) -> Call[Completion]:
    return _post("/v1/completions", Completion.model_validate, prompt=prompt, **fields)


def generate_stream(
    prompt: Prompt | Sequence[int], sampling_params: Mapping[str, Any] | None, **fields: Any
) -> Call[GenerateChunk | None]:
    """The streaming form: ``read`` takes one SSE line; None for lines that carry no chunk."""
    body = {**generate_body(prompt, sampling_params, fields), "stream": True}
    return Call("POST", "/inference/v1/generate", read_event, body)


def read_event(line: str) -> GenerateChunk | None:
    """One line of the event stream; an in-band error is raised as the status it names."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return None
    data = json.loads(payload)
    if "error" in data:
        raise status_error(int(data["error"].get("code") or 500), data)
    return GenerateChunk.model_validate(data)
