"""/tokenize and /detokenize on the test servers' apps, compared with transformers."""

from __future__ import annotations

import itertools
import unicodedata
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.chat_fixtures import CONVERSATIONS, TOOLS, with_string_arguments
from tests.conftest import Server, assert_error
from tests.fast_app import fast_client
from tokenwire.assets.qwen_tokenizer import load_reference_cases

TEMPLATES = [
    "Qwen-Qwen3-0.6B.jinja",
    "Qwen-Qwen2.5-7B-Instruct.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
]
# (add_generation_prompt, continue_final_message); both true is a 400, tested below.
FLAG_PAIRS = [(True, False), (False, False), (False, True)]


# Nothing here runs the model (see ``tests.fast_app.fast_client``).
qwen3 = fast_client("fast_qwen3_app", "qwen3")
smollm2 = fast_client("fast_smollm2_app", "smollm2")


def hf_chat_ids(
    hf_tokenizer,
    messages,
    template: str,
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    add_special_tokens: bool,
    tools=None,
    **kwargs,
) -> list[int]:
    text = hf_tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **kwargs,
    )
    return hf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


@pytest.mark.parametrize("template_name", TEMPLATES)
def test_chat_tokenize_matches_transformers(
    qwen3: httpx.Client, qwen3_hf_tokenizer, llama_cpp_models: Path, template_name: str
) -> None:
    template = (llama_cpp_models / "templates" / template_name).read_text()
    checked = 0
    for (name, messages), (gen, cont), special, tools, thinking in itertools.product(
        CONVERSATIONS.items(), FLAG_PAIRS, [False, True], [None, TOOLS], [None, False, True]
    ):
        if cont and messages[-1]["role"] != "assistant":
            continue
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        try:
            expected = hf_chat_ids(
                qwen3_hf_tokenizer,
                messages,
                template,
                add_generation_prompt=gen,
                continue_final_message=cont,
                add_special_tokens=special,
                tools=tools,
                **kwargs,
            )
        except Exception:
            continue
        body = {
            "messages": with_string_arguments(messages),
            "chat_template": template,
            "add_generation_prompt": gen,
            "continue_final_message": cont,
            "add_special_tokens": special,
        }
        if tools:
            body["tools"] = tools
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        response = qwen3.post("/tokenize", json=body)
        assert response.status_code == 200, (name, response.text)
        data = response.json()
        assert data["tokens"] == expected, (template_name, name, gen, cont, special, tools, kwargs)
        assert data["count"] == len(expected)
        checked += 1
    assert checked >= 24


def test_chat_tokenize_default_template_and_token_strs(
    qwen3: httpx.Client, qwen3_hf_tokenizer
) -> None:
    messages = CONVERSATIONS["multi_turn"]
    expected = qwen3_hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    response = qwen3.post("/tokenize", json={"messages": messages, "return_token_strs": True})
    data = response.json()
    assert data["tokens"] == list(expected)
    assert data["max_model_len"] == 4096
    assert data["token_strs"] == qwen3_hf_tokenizer.convert_ids_to_tokens(list(expected))


def test_completion_tokenize(qwen3: httpx.Client, qwen3_hf_tokenizer) -> None:
    prompt = "Hello world, 你好 🫠 龘"
    data = qwen3.post("/tokenize", json={"prompt": prompt}).json()
    assert data["tokens"] == qwen3_hf_tokenizer(prompt)["input_ids"]
    assert data["count"] == len(data["tokens"])
    assert data["token_strs"] is None
    # Completion form and alias model name.
    data = qwen3.post("/tokenize", json={"model": "qwen3-alias", "prompt": "龘"}).json()
    assert data["tokens"] == [82912, 246]


def test_reference_tokenisations(qwen3: httpx.Client, llama_cpp_models: Path) -> None:
    """llama.cpp's 46 reference cases for the Qwen2 vocabulary."""
    cases = load_reference_cases(llama_cpp_models)
    assert len(cases) == 46
    for text, ids in cases:
        body = {"prompt": text, "add_special_tokens": False}
        assert qwen3.post("/tokenize", json=body).json()["tokens"] == ids, repr(text)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=200))
def test_detokenize_inverts_tokenize(qwen3: httpx.Client, text: str) -> None:
    """Exact up to NFC: Qwen's tokenizer normalises first (U+F900 becomes U+8C48)."""
    tokens = qwen3.post("/tokenize", json={"prompt": text}).json()["tokens"]
    expected = unicodedata.normalize("NFC", text)
    assert qwen3.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": expected}


# Bytes SmolLM2's byte-level vocabulary has no token for (never seen in its training data).
SMOLLM2_MISSING_BYTES = frozenset(
    {
        4,
        6,
        19,
        20,
        22,
        29,
        192,
        193,
        241,
        242,
        245,
        246,
        247,
        248,
        249,
        250,
        251,
        252,
        253,
        254,
        255,
    }
)
SMOLLM2_ENCODABLE = st.characters(codec="utf-8").filter(
    lambda char: SMOLLM2_MISSING_BYTES.isdisjoint(char.encode("utf-8"))
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(SMOLLM2_ENCODABLE, max_size=120))
def test_detokenize_inverts_tokenize_exactly_without_normaliser(
    smollm2: httpx.Client, text: str
) -> None:
    """SmolLM2's byte-level BPE has no normaliser: the round trip is exact.

    Its vocabulary lacks a few byte tokens (some control characters and the UTF-8 lead bytes of
    planes 4-16), so characters made of those bytes cannot be encoded at all; they are left out.
    """
    tokens = smollm2.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert smollm2.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": text}


def test_detokenize_keeps_special_tokens(qwen3: httpx.Client) -> None:
    tokens = qwen3.post("/tokenize", json={"prompt": "<|im_start|>user\nhi<|im_end|>"}).json()
    assert tokens["tokens"][0] == 151644
    text = qwen3.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>user\nhi<|im_end|>"


def test_smollm2_default_server_tokenizes(smollm2: httpx.Client) -> None:
    """`tokenwire serve` with no model argument serves the embedded default."""
    data = smollm2.post("/tokenize", json={"prompt": "What is the capital of France?"}).json()
    assert data["count"] == len(data["tokens"]) > 3
    chat = smollm2.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    text = smollm2.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")


# --- errors -------------------------------------------------------------------------------


def test_both_generation_flags_is_400(qwen3: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": True,
        "continue_final_message": True,
    }
    assert_error(
        qwen3.post("/tokenize", json=body),
        400,
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": []}, "messages"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "add_special_tokens": "maybe"}, "add_special_tokens"),
        ({"messages": [{"content": "no role"}]}, "role"),
        ({"messages": "not a list"}, "messages"),
        ({}, "prompt"),
        ([1, 2], ""),
    ],
)
def test_tokenize_validation_is_400(qwen3: httpx.Client, body: object, field: str) -> None:
    error = assert_error(qwen3.post("/tokenize", json=body), 400)
    assert error["type"] == "BadRequestError"
    assert field in error["message"]


def test_malformed_json_is_400(qwen3: httpx.Client) -> None:
    response = qwen3.post(
        "/tokenize", content=b'{"prompt": "x"', headers={"Content-Type": "application/json"}
    )
    assert_error(response, 400)


def test_body_without_json_content_type_is_a_clear_400(qwen3: httpx.Client) -> None:
    response = qwen3.post(
        "/tokenize",
        content=b'{"prompt": "x"}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert_error(response, 400, "Content-Type: application/json")


def test_unknown_model_is_404(qwen3: httpx.Client) -> None:
    for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]:
        error = assert_error(
            qwen3.post(path, json={**body, "model": "gpt-9"}),
            404,
            "The model `gpt-9` does not exist.",
        )
        assert error["param"] == "model"


@pytest.mark.parametrize("tokens", [[-1], [151669], [10**12], [1, 2, 99999999]])
def test_detokenize_out_of_vocabulary_is_400(qwen3: httpx.Client, tokens: list[int]) -> None:
    assert_error(qwen3.post("/detokenize", json={"tokens": tokens}), 400, "outside the vocabulary")


def test_untrusted_request_template_is_400(smollm2: httpx.Client) -> None:
    message = (
        "Chat template is passed with request, but --trust-request-chat-template is not set. "
        "Refused request with untrusted chat template."
    )
    messages = [{"role": "user", "content": "hi"}]
    assert_error(
        smollm2.post("/tokenize", json={"messages": messages, "chat_template": "{{ 1 }}"}),
        400,
        message,
    )
    assert_error(
        smollm2.post(
            "/tokenize",
            json={"messages": messages, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
        ),
        400,
        message,
    )


def test_api_key_required_except_health(qwen3: httpx.Client) -> None:
    anonymous = {"Authorization": ""}
    assert qwen3.get("/health", headers=anonymous).status_code == 200
    for method, path in [
        ("POST", "/tokenize"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("GET", "/no/such/route"),
    ]:
        response = qwen3.request(method, path, json={"prompt": "x"}, headers=anonymous)
        assert_error(response, 401, "API key")
    wrong = {"Authorization": "Bearer wrong"}
    assert_error(qwen3.post("/tokenize", json={"prompt": "x"}, headers=wrong), 401)


def test_unknown_route_is_404(qwen3: httpx.Client) -> None:
    assert_error(qwen3.get("/no/such/route"), 404)


def test_oversized_body_is_413(qwen3_server: Server) -> None:
    """On the real server: only there does a chunked upload reach the app in pieces."""
    big = {"prompt": "x" * (5 * 2**20)}

    def chunks():  # no Content-Length: chunked transfer
        for _ in range(6):
            yield b" " * 2**20

    with qwen3_server.client() as client:
        assert_error(client.post("/tokenize", json=big), 413)
        response = client.post(
            "/tokenize", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert_error(response, 413)
        assert client.post("/tokenize", json={"prompt": "still serving"}).status_code == 200


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__ }}",
        "{{ ''|attr('__class__') }}",
        "{{ '{0.__class__}'.format(messages) }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ self.__init__.__globals__ }}",
        "{% for x in range(100000000) %}{{ x }}{% endfor %}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{{ raise_exception('nope') }}",
        "{% if %}",
    ],
)
def test_template_sandbox_escape_is_harmless(qwen3: httpx.Client, template: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template}
    response = qwen3.post("/tokenize", json=body)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 200:
        text = qwen3.post("/detokenize", json={"tokens": response.json()["tokens"]}).json()
        for leak in ("class", "module", "function", "mro", "globals", "object at"):
            assert leak not in text["prompt"]
    else:
        assert_error(response, 400)


# --- request ids and GET endpoints -----------------------------------------------------------


def test_request_id_echoed_or_generated(qwen3: httpx.Client) -> None:
    response = qwen3.post("/tokenize", json={"prompt": "x"}, headers={"X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    generated = qwen3.post("/tokenize", json={"prompt": "x"}).headers["x-request-id"]
    assert len(generated) >= 16


def test_models_version_metrics_docs(qwen3: httpx.Client) -> None:
    models = qwen3.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["qwen3-tiny", "qwen3-alias"]
    assert all(m["owned_by"] == "tokenwire" and m["max_model_len"] == 4096 for m in models["data"])
    assert qwen3.get("/version").json()["version"]
    qwen3.post("/tokenize", json={"prompt": "count me"})
    metrics = qwen3.get("/metrics").text
    assert 'tokenwire_requests_total{method="POST",route="/tokenize",status="200"}' in metrics
    assert "tokenwire_request_duration_seconds_bucket" in metrics
    schema = qwen3.get("/openapi.json").json()
    for path in (
        "/tokenize",
        "/detokenize",
        "/v1/models",
        "/health",
        "/inference/v1/generate",
        "/v1/chat/completions/render",
        "/v1/chat/completions/derender",
        "/v1/chat/completions",
        "/v1/completions",
        "/abort_requests",
    ):
        assert path in schema["paths"]
    responses = schema["paths"]["/tokenize"]["post"]["responses"]
    # Validation errors are 400s here: FastAPI's 422 validation body is never documented; a 422
    # is only a media host's client error, in the one error body.
    assert "HTTPValidationError" not in str(schema)
    assert responses["422"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "ErrorResponse"
    )
    assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "ErrorResponse"
    )
    assert qwen3.get("/docs").status_code == 200
