"""The OpenAPI document as the server really behaves.

Routes declare their success bodies (``response_model``, ``response_class``, ``streamed``);
this module adds what holds across routes: every error is the one ``ErrorResponse`` body (400,
never 422, for validation), which statuses each operation can answer, and the SSE form of the
streaming routes. ``tests/test_schemathesis.py`` fuzzes the server against this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tokenwire.api.asgi import OPEN_PATHS
from tokenwire.api.control_key import CONTROL
from tokenwire.protocol.common import ErrorResponse

_REF = "#/components/schemas/{model}"
_ERROR_REF = {"$ref": _REF.format(model="ErrorResponse")}
_ERROR_CONTENT = {"application/json": {"schema": _ERROR_REF}}

# Why each error status is answered; which operations can answer it is decided in _error_statuses.
_ERROR_DESCRIPTIONS = {
    "400": "Invalid request: a body or query parameter that fails validation, malformed JSON, "
    "or a lone UTF-16 surrogate escape in the body",
    "401": "Missing or invalid API key (only when the server has --api-key)",
    "401-control": "Missing or invalid control key (--control-api-key, else --api-key; only when "
    "the server has either)",
    "404": "The request names a model the server does not serve",
    "408": "The request body did not arrive within --request-read-timeout-s",
    "413": "Request body larger than --max-request-bytes",
    "422": "A media URL in the request answered with a client error (4xx), or the file is missing",
    "500": "Internal server error (a bug)",
    "503": "Model still loading, the engine died (the server is exiting), server shutting "
    "down, or (RL control) paused or sleeping",
}
# Answered without the model, so never a 503.
_MODEL_FREE_PATHS = frozenset({"/version", "/metrics"})

# Chunk models of the SSE responses; their schemas join the document's components.
_EVENT_MODELS: list[type[BaseModel]] = []


def streamed(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route that answers Server-Sent Events when the body says
    ``"stream": true``: one ``chunk`` per ``data:`` event, an error event if the stream fails
    after it started (``{"error": ...}``, the ErrorResponse body), then ``data: [DONE]``."""
    if chunk not in _EVENT_MODELS:
        _EVENT_MODELS.append(chunk)
    # The item schema follows FastAPI's own SSE routes (OpenAPI 3.2's itemSchema).
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {
                    "oneOf": [{"$ref": _REF.format(model=chunk.__name__)}, _ERROR_REF]
                },
            },
        ]
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {
        200: {
            "description": f"JSON; with `stream: true` an SSE stream of `{chunk.__name__}` events",
            "content": {"text/event-stream": {"itemSchema": event}},
        }
    }


# Routes that may fetch media: a remote 4xx (or a missing file) is their 422.
MEDIA_ERRORS: dict[int | str, dict[str, Any]] = {
    422: {"description": _ERROR_DESCRIPTIONS["422"], "content": _ERROR_CONTENT}
}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, summary=app.summary, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        for model in (ErrorResponse, *_EVENT_MODELS):
            _add_component(components, model)
        for path, path_item in schema.get("paths", {}).items():
            for method, operation in path_item.items():
                _document_errors(path, method, operation, components)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_component(components: dict[str, Any], model: type[BaseModel]) -> None:
    """``model`` and the models it refers to; a name FastAPI already wrote is the same model."""
    model_schema = model.model_json_schema(ref_template=_REF)
    for name, definition in model_schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components.setdefault(model.__name__, model_schema)


def _document_errors(
    path: str, method: str, operation: dict[str, Any], components: dict[str, Any]
) -> None:
    responses = operation.setdefault("responses", {})
    if _is_fastapi_validation_error(responses.get("422")):
        del responses["422"]
    control = CONTROL in operation.get("tags", ())
    for status in _error_statuses(path, method, operation, components):
        why = _ERROR_DESCRIPTIONS["401-control" if control and status == "401" else status]
        responses.setdefault(status, {"description": why, "content": _ERROR_CONTENT})


def _error_statuses(
    path: str, method: str, operation: dict[str, Any], components: dict[str, Any]
) -> list[str]:
    statuses = ["500"]
    if path not in OPEN_PATHS:
        statuses.append("401")
    if path not in _MODEL_FREE_PATHS:
        statuses.append("503")
    body = operation.get("requestBody")
    if method == "post" or operation.get("parameters"):
        statuses.append("400")
    if method == "post":
        # The body reader reads every POST whole, even one to a route that takes no body.
        statuses += ["408", "413"]
    if body is not None:
        body_schema = body.get("content", {}).get("application/json", {}).get("schema", {})
        if _has_property(body_schema, "model", components):
            statuses.append("404")
    return statuses


def _is_fastapi_validation_error(response: dict[str, Any] | None) -> bool:
    """FastAPI's automatic 422, which this server answers as a 400 instead."""
    if response is None:
        return False
    schema = response.get("content", {}).get("application/json", {}).get("schema", {})
    return schema.get("$ref", "").endswith("/HTTPValidationError")


def _has_property(schema: dict[str, Any], name: str, components: dict[str, Any]) -> bool:
    """Whether an object schema (or any branch of a union of them) has property ``name``."""
    ref = schema.get("$ref")
    if ref is not None:
        return _has_property(components.get(ref.rsplit("/", 1)[-1], {}), name, components)
    if name in schema.get("properties", {}):
        return True
    branches = [*schema.get("oneOf", ()), *schema.get("anyOf", ()), *schema.get("allOf", ())]
    return any(_has_property(branch, name, components) for branch in branches)
