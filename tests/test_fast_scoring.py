"""Teacher scoring, ``logprob_token_ids`` and sampling masks over the fake engine: what reaches
the engine, the JSON of generate and SGLang's ``/generate``, and every refusal. The values
themselves are the real engine's (``test_scoring``)."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest

from tests.conftest import assert_error
from tests.fake_engine import Reply, Step
from tests.fast_app import FastApp, sse_chunks
from tokenwire.pipeline import validation

EOS = 2  # SmolLM2's <|im_end|>
PROMPT = [504, 3458, 314, 4649, 28, 1116]


def post(fast: FastApp, sampling: dict[str, Any], **body: Any) -> Any:
    return fast.client.post(
        "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": sampling, **body}
    )


def generate(fast: FastApp, sampling: dict[str, Any], **body: Any) -> dict[str, Any]:
    response = post(fast, sampling, **body)
    assert response.status_code == 200, response.text
    return response.json()


def decode_npy(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


# -- teacher scoring ------------------------------------------------------------------------


def test_prompt_token_id_logprobs_are_a_base64_npy_matrix(fast_smollm2: FastApp) -> None:
    """Rows are padded to one width with -1 for the engine; the answer is its float32 matrix."""
    scores = np.array([[-0.5, -2.0], [-1.0, -np.inf], [-0.25, -3.0]], dtype=np.float32)
    fast_smollm2.engine.script = lambda *_: Reply([5, EOS], prompt_token_id_logprobs=scores)
    rows = [[4649, 7], [28], [1116, 0]]
    data = generate(
        fast_smollm2,
        {"max_tokens": 4, "prompt_logprob_token_ids": rows, "prompt_logprob_start": 2},
    )
    got = decode_npy(data["prompt_token_id_logprobs"])
    assert got.dtype == np.float32 and np.array_equal(got, scores)
    assert data["prompt_logprobs"] is None
    (call,) = fast_smollm2.engine.calls
    sampling = call.sampling
    assert sampling.prompt_logprob_token_ids == ((4649, 7), (28, -1), (1116, 0))
    assert sampling.prompt_logprob_start == 2 and sampling.prompt_logprobs is None


def test_teacher_scoring_with_n_choices_scores_the_prompt_once(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda *_: [5, EOS]
    rows = [[t] for t in PROMPT[1:]]
    data = generate(fast_smollm2, {"n": 2, "prompt_logprob_token_ids": rows})
    got = decode_npy(data["prompt_token_id_logprobs"])
    assert got.shape == (len(PROMPT) - 1, 1)
    assert [c["token_ids"] for c in data["choices"]] == [[5, EOS], [5, EOS]]


def test_other_requests_get_no_scoring_fields(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda *_: [5, EOS]
    data = generate(fast_smollm2, {"logprobs": 1})
    assert "prompt_token_id_logprobs" not in data
    assert "sampling_mask" not in data["choices"][0]
    (call,) = fast_smollm2.engine.calls
    sampling = call.sampling
    assert sampling.prompt_logprob_token_ids is None and sampling.logprob_token_ids is None
    assert not sampling.sampling_mask


@pytest.mark.parametrize(
    ("sampling", "param", "message"),
    [
        (
            {"prompt_logprob_token_ids": [[1]] * 4},
            "sampling_params.prompt_logprob_token_ids",
            "has 4 rows, but the prompt has 5 scored rows",
        ),
        (
            {"prompt_logprob_token_ids": [[1]], "prompt_logprob_start": 5},
            "sampling_params.prompt_logprob_start",
            "less than the prompt's length minus 1 (5)",
        ),
        (
            {"prompt_logprob_token_ids": [[1], [2, 49152], [3]], "prompt_logprob_start": 2},
            "sampling_params.prompt_logprob_token_ids",
            "prompt_logprob_token_ids.1.1: token id 49152 is out of vocabulary",
        ),
        (
            {"prompt_logprob_token_ids": [list(range(21))] * 5},
            "sampling_params.prompt_logprob_token_ids",
            "requested 21 token ids per row, which is greater than max allowed: 20",
        ),
        ({"prompt_logprob_start": 1}, "sampling_params", "requires prompt_logprob_token_ids"),
        ({"prompt_logprob_token_ids": [[], []]}, "sampling_params", "non-empty integer array"),
        (
            {"prompt_logprob_token_ids": [[-2]] * 5},
            "sampling_params.prompt_logprob_token_ids.0.0",
            "greater than or equal to -1",
        ),
    ],
)
def test_bad_teacher_scoring_is_a_400_naming_the_field(
    fast_smollm2: FastApp, sampling: dict[str, Any], param: str, message: str
) -> None:
    error = assert_error(post(fast_smollm2, sampling), 400, message)
    assert error["param"] == param
    assert not fast_smollm2.engine.calls


def test_teacher_scoring_work_is_bounded(
    fast_smollm2: FastApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validation, "MAX_PROMPT_TOKEN_ID_LOGPROBS", 9)
    response = post(fast_smollm2, {"prompt_logprob_token_ids": [[1, 2]] * 5})
    error = assert_error(response, 400, "5 rows x 2 ids, more than 9 logprobs in one request")
    assert error["param"] == "sampling_params.prompt_logprob_token_ids"


def test_teacher_scoring_is_not_streamed(fast_smollm2: FastApp) -> None:
    """As vLLM: its stream chunks have no field for the scores."""
    rows = [[t] for t in PROMPT[1:]]
    response = post(fast_smollm2, {"prompt_logprob_token_ids": rows}, stream=True)
    error = assert_error(response, 400, "not available when stream=true")
    assert error["param"] == "sampling_params.prompt_logprob_token_ids"


# -- logprob_token_ids ----------------------------------------------------------------------


def test_logprob_token_ids_list_the_sampled_token_then_every_given_id(
    fast_smollm2: FastApp,
) -> None:
    fast_smollm2.engine.script = lambda *_: [Step(5, logprob=-0.5), Step(EOS, logprob=-0.25)]
    given = [7, 5, 9]
    data = generate(fast_smollm2, {"logprob_token_ids": given})
    (call,) = fast_smollm2.engine.calls
    assert call.sampling.logprob_token_ids == (7, 5, 9) and call.sampling.logprobs == 3
    content = data["choices"][0]["logprobs"]["content"]
    first = content[0]["top_logprobs"]
    # The sampled 5 comes first; its own place among the given ids is not repeated.
    assert [(e["token_id"], e["logprob"], e["rank"]) for e in first] == [
        (5, -0.5, 1),
        (7, -1.5, 1),
        (9, -3.5, 3),
    ]
    assert [e["token_id"] for e in content[1]["top_logprobs"]] == [EOS, 7, 5, 9]


@pytest.mark.parametrize(
    ("sampling", "param", "message"),
    [
        (
            {"logprob_token_ids": [1, 2], "logprobs": 3},
            "sampling_params",
            "logprobs must equal len(logprob_token_ids)",
        ),
        (
            {"logprob_token_ids": list(range(129))},
            "sampling_params.logprob_token_ids",
            "at most 128 items",
        ),
        (
            {"logprob_token_ids": [3, 49152]},
            "sampling_params.logprob_token_ids",
            "logprob_token_ids.1: token id 49152 is out of vocabulary",
        ),
    ],
)
def test_bad_logprob_token_ids_are_a_400(
    fast_smollm2: FastApp, sampling: dict[str, Any], param: str, message: str
) -> None:
    error = assert_error(post(fast_smollm2, sampling), 400, message)
    assert error["param"] == param


# -- sampling masks -------------------------------------------------------------------------


def test_sampling_mask_per_choice_and_cut_at_a_stop_string(fast_smollm2: FastApp) -> None:
    ids = fast_smollm2.tokenize(" Paris. Big")
    steps = [Step(t, support=(t, 900 + i)) for i, t in enumerate(ids)]
    fast_smollm2.engine.script = lambda *_: [steps[:2], steps[2:], [EOS]]
    sampling = {"temperature": 1.0, "top_k": 2, "stop": ["."], "n": 2, "seed": 1}
    data = generate(fast_smollm2, sampling, return_sampling_mask=True)
    (call, _) = fast_smollm2.engine.calls
    assert call.sampling.sampling_mask
    for choice in data["choices"]:
        kept = choice["token_ids"]
        assert kept == ids[: len(kept)] and len(kept) < len(ids)
        assert choice["sampling_mask"] == [sorted((t, 900 + i)) for i, t in enumerate(kept)]


def test_sampling_mask_streams_with_each_chunks_tokens(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda *_: [[5, 6], 7, EOS]
    body = {
        "token_ids": PROMPT,
        "sampling_params": {"temperature": 0.7, "top_k": 3},
        "return_sampling_mask": True,
        "stream": True,
    }
    chunks = sse_chunks(fast_smollm2.client, "/inference/v1/generate", body)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [len(c["sampling_mask"]) for c in choices] == [len(c["token_ids"]) for c in choices]
    masks = [mask for c in choices for mask in c["sampling_mask"]]
    tokens = [t for c in choices for t in c["token_ids"]]
    assert tokens == [5, 6, 7, EOS]
    assert all(len(mask) == 3 and t in mask for t, mask in zip(tokens, masks, strict=True))


def test_greedy_needs_no_top_k_for_a_mask(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda *_: [5, EOS]
    data = generate(fast_smollm2, {"temperature": 0}, return_sampling_mask=True)
    assert data["choices"][0]["sampling_mask"] == [[5], [EOS]]


@pytest.mark.parametrize("top_k", [0, -1, 2049])
def test_an_unbounded_sampling_mask_is_a_400(fast_smollm2: FastApp, top_k: int) -> None:
    response = post(fast_smollm2, {"temperature": 1.0, "top_k": top_k}, return_sampling_mask=True)
    error = assert_error(response, 400, "needs 0 < top_k <= 2048")
    assert error["param"] == "sampling_params.top_k"


def test_sglang_reports_masks_their_logprobs_and_count(fast_rl: FastApp) -> None:
    steps = [Step(5, logprob=-0.5, support=(5, 9)), Step(EOS, logprob=-0.1, support=(EOS, 3))]
    fast_rl.engine.script = lambda *_: steps
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 1.0, "top_k": 2, "max_new_tokens": 4},
        "return_sampling_mask": True,
    }
    response = fast_rl.client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    assert meta["output_token_sampling_mask"] == [[5, 9], [EOS, 3]]
    assert meta["output_token_sampling_logprobs"] == [-0.5, -0.1]
    assert meta["output_token_sampling_mask_length"] == 2
    chunks = sse_chunks(fast_rl.client, "/generate", {**body, "stream": True})
    assert [c["meta_info"]["output_token_sampling_mask_length"] for c in chunks] == [1, 2]
    plain = fast_rl.client.post("/generate", json={**body, "return_sampling_mask": False})
    assert "output_token_sampling_mask" not in plain.json()["meta_info"]


def test_sglang_refuses_an_unbounded_mask(fast_rl: FastApp) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"top_p": 0.9}, "return_sampling_mask": True}
    error = assert_error(fast_rl.client.post("/generate", json=body), 400, "top_k")
    assert error["param"] == "sampling_params.top_k"


# -- an engine without them -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "body", "param"),
    [
        (
            {"prompt_logprob_token_ids": [[1]] * 5},
            {},
            "sampling_params.prompt_logprob_token_ids",
        ),
        ({"logprob_token_ids": [1]}, {}, "sampling_params.logprob_token_ids"),
        ({"temperature": 0}, {"return_sampling_mask": True}, "return_sampling_mask"),
    ],
)
def test_an_engine_without_the_feature_refuses_it(
    fast_smollm2: FastApp, sampling: dict[str, Any], body: dict[str, Any], param: str
) -> None:
    fast_smollm2.engine.features = frozenset()
    response = post(fast_smollm2, sampling, **body)
    error = assert_error(response, 400, f"{param} is not supported by this server's engine")
    assert error["param"] == param
    assert not fast_smollm2.engine.calls
