"""The OpenAPI document as the server really behaves: errors are 400 with one body, never 422."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tokenwire.protocol.common import ErrorResponse

_ERROR_STATUSES = {
    "400": "Invalid request (validation errors included)",
    "401": "Missing or invalid API key (when the server has one)",
    "404": "Unknown model",
    "413": "Request body too large",
    "503": "Model loading or server shutting down",
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
        error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(error_schema.pop("$defs", {}))
        components["ErrorResponse"] = error_schema
        error_content = {
            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
        }
        for path_item in schema.get("paths", {}).values():
            for operation in path_item.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                if "requestBody" in operation:
                    for status, description in _ERROR_STATUSES.items():
                        responses.setdefault(
                            status, {"description": description, "content": error_content}
                        )
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
