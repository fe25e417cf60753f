"""Shared pieces of the wire schema: base request models, bounded number types, the error body.

Request bodies are strict: ``"5"``, ``5.0`` or ``true`` where an integer belongs is a 400, not
a silently coerced token id. Every integer that can be echoed back is bounded to 64 bits, and
every sampling value to what float32 sampling can honour, so nothing a client sends can fail
the serializer or the engine's batch.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

INT64_MAX = 2**63 - 1
# Beyond these, float32 logits overflow (inf / NaN) or the value means nothing more.
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4

Int64 = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = NonNegativeInt64
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1, le=INT64_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)]


def _int64_integers(value: Any) -> Any:
    """Refuse a JSON value with an integer beyond 64 bits anywhere in it: an answer that echoes
    it could not be serialised (orjson, and most clients' parsers, stop at 64 bits)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, int) and not -(2**63) <= item <= INT64_MAX:
            raise ValueError("integers must fit in 64 bits")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


# Client JSON an answer echoes back as given (a Responses request's tools, say).
EchoedJson = Annotated[Any, AfterValidator(_int64_integers)]


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's input schema describes an object (its calls' arguments, Anthropic's ``input``,
    are one): a schema of another ``type`` is refused, as Anthropic and OpenAI refuse it; one
    without ``type`` is read as an object (vLLM's default)."""
    kind = schema.get("type", "object")
    if kind != "object":
        raise ValueError(
            f"a tool's schema must have type 'object' (its arguments are an object), not {kind!r}"
        )
    return schema


def _unique_tool_names(tools: list[Any]) -> list[Any]:
    """Tool names must be unique (Anthropic's rule): a call, a named ``tool_choice`` and the
    grammar that forces calls find a tool by its name."""
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ValueError(f"tool names must be unique: {tool.name!r} is offered twice")
        seen.add(tool.name)
    return tools


# The most tools one request may offer (OpenAI caps a request at 128 functions; agent harnesses
# offer tens, MCP-heavy ones a few hundred). Every tool is validated, converted and rendered into
# the prompt while the GIL is held: 10,000 tools (11 MB) stalled the event loop for 0.3-1.2 s
# to end in a 400 for the prompt's length. Checked before the items are validated.
MAX_TOOLS = 1024


def _at_most_max_tools(tools: Any) -> Any:
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools may be offered, not {len(tools)}")
    return tools


# A request's tool list, bounded before its tools are read.
BoundedTools = BeforeValidator(_at_most_max_tools)
# A tool's parameters / input schema, and a dialect's tool list (each tool has a ``name``).
ToolSchema = AfterValidator(_object_schema)
UniqueToolNames = AfterValidator(_unique_tool_names)
# vLLM's: prefix-cache blocks are shared only by requests with the same salt; empty is a 400.
CacheSalt = Annotated[str, Field(min_length=1)]


# Linux's NAME_MAX and PATH_MAX: longer paths fail every OS call on them.
MAX_PATH_COMPONENT_BYTES = 255
MAX_PATH_BYTES = 4096


def _server_path(value: str) -> str:
    """A path the OS can look up: NUL or an over-long component would fail deep in a handler
    (``ValueError``, ``ENAMETOOLONG``); here it is a 400."""
    if "\0" in value:
        raise ValueError("a path must not contain a NUL character")
    encoded = os.fsencode(value)  # a lone surrogate fails here: a ValueError, so a 400 too
    if len(encoded) > MAX_PATH_BYTES:
        raise ValueError(f"a path must be at most {MAX_PATH_BYTES} bytes")
    if any(len(part) > MAX_PATH_COMPONENT_BYTES for part in encoded.split(b"/")):
        raise ValueError(f"a path component must be at most {MAX_PATH_COMPONENT_BYTES} bytes")
    return value


# A path on the server's filesystem (a checkpoint or adapter directory).
ServerPath = Annotated[str, AfterValidator(_server_path)]


class RequestModel(BaseModel):
    """Base of every request body: unknown fields are ignored, as vLLM does for OpenAI bodies."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StrictRequestModel(BaseModel):
    """Base of bodies where an unknown field is a client bug worth a 400 (sampling params)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
