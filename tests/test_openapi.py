"""/openapi.json says what the server really answers: SSE streams, empty bodies, every error
status with the one error body (test_schemathesis.py checks real answers against it)."""

from __future__ import annotations

import httpx
import pytest

from tests.fast_app import fast_client
from tokenwire.api.asgi import OPEN_PATHS

STREAMING = ["/inference/v1/generate", "/v1/chat/completions", "/v1/completions", "/generate"]
ERROR_BODY = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}


# Nothing here runs the model (see ``tests.fast_app.fast_client``).
qwen3 = fast_client("fast_qwen3_app", "qwen3")


@pytest.fixture(scope="module")
def document(qwen3: httpx.Client) -> dict:
    response = qwen3.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def operations(document: dict):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


@pytest.mark.parametrize("path", STREAMING)
def test_streaming_routes_document_their_sse_events(document: dict, path: str) -> None:
    content = document["paths"][path]["post"]["responses"]["200"]["content"]
    assert "application/json" in content
    data = content["text/event-stream"]["itemSchema"]["properties"]["data"]["anyOf"]
    assert {"const": "[DONE]"} in data
    events = data[1]["contentSchema"]["oneOf"]
    assert {"$ref": "#/components/schemas/ErrorResponse"} in events
    chunk = events[0]["$ref"].rsplit("/", 1)[-1]
    assert chunk in document["components"]["schemas"]


def test_health_is_an_empty_200_or_a_503_error(document: dict) -> None:
    responses = document["paths"]["/health"]["get"]["responses"]
    assert "content" not in responses["200"]
    assert responses["503"]["content"] == ERROR_BODY
    assert "401" not in responses  # /health is open even with --api-key


def test_metrics_is_prometheus_text(document: dict) -> None:
    content = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]


def test_every_operation_documents_its_errors(document: dict) -> None:
    for path, method, operation in operations(document):
        responses = operation["responses"]
        assert responses["500"]["content"] == ERROR_BODY, (method, path)
        if path not in OPEN_PATHS:  # /health and the load routes a router polls
            assert responses["401"]["content"] == ERROR_BODY, (method, path)
        if method == "post":
            assert "413" in responses and "400" in responses, (method, path)
        success = responses["200"]
        # Every success has a schema beyond "anything", or is documented as empty.
        for media in success.get("content", {}).values():
            assert media.get("schema") or media.get("itemSchema"), (method, path)


def test_validation_errors_are_400_not_422(document: dict) -> None:
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    media_routes = {"/tokenize", "/v1/chat/completions/render", "/v1/chat/completions"}
    media_routes.add("/inference/v1/generate")
    # The Anthropic and Responses dialects take images as the chat route does.
    media_routes.update(
        {"/v1/messages", "/v1/messages/count_tokens", "/v1/messages/render"},
    )
    media_routes.update({"/v1/responses", "/v1/responses/render"})
    for path, method, operation in operations(document):
        # 422 only where a media URL's host may answer 4xx; never for validation.
        assert ("422" in operation["responses"]) == (path in media_routes), (method, path)


def test_unknown_model_404_where_a_body_names_a_model(document: dict) -> None:
    responses = document["paths"]["/v1/completions"]["post"]["responses"]
    assert responses["404"]["content"] == ERROR_BODY
    assert "404" not in document["paths"]["/abort_requests"]["post"]["responses"]
