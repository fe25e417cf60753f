"""What today's RL frameworks send, as their released clients send it: TRL's VLLMClient, AReaL's
SGLang engine, skyrl-train's HTTP engines and an RL trace gateway (rllm-model-gateway).

Each test posts the exact body the client builds (its source is named) and checks what the
client then reads from the answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Server, assert_error

MODEL = "smollm2-135m-instruct"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def rl(rl_server: Server) -> Iterator[httpx.Client]:
    """The RL server (``--max-logprobs -1``) as a fresh one is: running, not asleep."""
    with rl_server.client() as client:
        assert client.post("/resume").status_code == 200
        yield client


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


# -- logprob counts: --max-logprobs and vLLM's lax `logprobs` ----------------------------------


def test_gateway_logprobs_true_is_one_on_completions(smollm2: httpx.Client) -> None:
    """rllm-model-gateway injects ``logprobs: true`` into every completion it forwards; vLLM's
    pydantic reads it as 1 (and ``false`` as 0)."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}
    body |= {"temperature": 0, "return_token_ids": True}
    as_true = ok(smollm2.post("/v1/completions", json={**body, "logprobs": True}))
    as_one = ok(smollm2.post("/v1/completions", json={**body, "logprobs": 1}))
    assert as_true["choices"][0]["logprobs"] == as_one["choices"][0]["logprobs"]
    assert all(len(top) == 1 for top in as_true["choices"][0]["logprobs"]["top_logprobs"])
    as_false = ok(smollm2.post("/v1/completions", json={**body, "logprobs": False}))
    as_zero = ok(smollm2.post("/v1/completions", json={**body, "logprobs": 0}))
    assert as_false["choices"][0]["logprobs"] == as_zero["choices"][0]["logprobs"]


# TRL's VLLMClient.get_sequence_logprobs: teacher scoring asks for 100 prompt logprobs.
TRL_SEQUENCE_LOGPROBS = {
    "model": MODEL,
    "prompt": [[504, 3575, 282, 4649, 314, 7042, 30]],
    "max_tokens": 1,
    "temperature": 1.0,
    "prompt_logprobs": 100,
}
# TRL's VLLMClient.chat with logprobs=100.
TRL_CHAT = {
    "model": MODEL,
    "n": 1,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "max_tokens": 2,
    "logprobs": True,
    "top_logprobs": 100,
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "messages": PARIS,
}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", TRL_CHAT, "top_logprobs"),
        ("/v1/chat/completions", {"messages": PARIS, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": 21}, "logprobs"),
        ("/v1/completions", TRL_SEQUENCE_LOGPROBS, "prompt_logprobs"),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2], "sampling_params": {"logprobs": 21}},
            "sampling_params.logprobs",
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2], "sampling_params": {"prompt_logprobs": 100}},
            "sampling_params.prompt_logprobs",
        ),
        (
            "/generate",
            {"text": "Hi", "return_logprob": True, "top_logprobs_num": 21},
            "top_logprobs_num",
        ),
    ],
)
def test_max_logprobs_error_names_the_field_and_the_limit(
    smollm2: httpx.Client, path: str, body: dict, param: str
) -> None:
    error = assert_error(smollm2.post(path, json=body), 400, "max allowed: 20")
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ") and "--max-logprobs" in error["message"]


def test_minus_one_asks_for_the_limit(smollm2: httpx.Client, rl: httpx.Client) -> None:
    """vLLM's ``-1`` (the whole vocabulary) is --max-logprobs' count; with -1 there, all ids."""
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1, "logprobs": -1}}
    capped = ok(smollm2.post("/inference/v1/generate", json=body))["choices"][0]["logprobs"]
    assert len(capped["content"][0]["top_logprobs"]) == 20
    whole = ok(rl.post("/inference/v1/generate", json=body))["choices"][0]["logprobs"]
    assert len(whole["content"][0]["top_logprobs"]) == 49152  # SmolLM2's vocabulary


def test_max_logprobs_minus_one_allows_trl_counts(rl: httpx.Client) -> None:
    chat = ok(rl.post("/v1/chat/completions", json=TRL_CHAT))
    assert all(len(e["top_logprobs"]) == 100 for e in chat["choices"][0]["logprobs"]["content"])
    assert ok(rl.post("/v1/completions", json=TRL_SEQUENCE_LOGPROBS))["choices"]


# -- vLLM 0.33's generate fields ---------------------------------------------------------------


def test_trl_generate_from_features_body(smollm2: httpx.Client) -> None:
    """TRL's VLLMClient._generate_from_features: ``output_kind: 2`` (FINAL_ONLY) so that a
    non-streamed n > 1 answer holds every choice; ``features`` is null for a text prompt."""
    sampling = {"n": 2, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0}
    sampling |= {"top_k": 0, "min_p": 0.0, "max_tokens": 4, "logprobs": 0, "seed": 11}
    body = {
        "request_id": "trl-0123456789abcdef",
        "model": MODEL,
        "token_ids": [504, 3575, 282, 4649],
        "features": None,
        "sampling_params": {**sampling, "output_kind": 2},
    }
    choices = ok(smollm2.post("/inference/v1/generate", json=body))["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    plain = {**body, "sampling_params": sampling}
    expected = ok(smollm2.post("/inference/v1/generate", json=plain))["choices"]
    assert [c["token_ids"] for c in choices] == [c["token_ids"] for c in expected]


# -- /update_weights: prime-rl's checkpoint directory or vLLM's weight-transfer step -----------


def test_vllm_update_weights_body_says_what_is_missing(rl: httpx.Client) -> None:
    """TRL's VLLMClient.update_named_params posts vLLM's form; the weight-transfer engine it
    needs is not set up here, and the answer says so (not "weight_dir: Field required")."""
    update_info = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[8, 4]]}
    response = rl.post("/update_weights", json={"update_info": {**update_info, "packed": True}})
    error = assert_error(response, 400, "weight-transfer engine is not initialised")
    assert error["param"] == "update_info" and '"weight_dir"' in error["message"]
    # skyrl-train's remote vLLM engine (RemoteWeightLoader.load_weights): one named tensor per
    # call, received at once over the group /init_weight_update_communicator opened; none is
    # open here, and the answer names what to call first.
    skyrl = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[8, 4]]}
    error = assert_error(rl.post("/update_weights", json=skyrl), 400, "no weight-transfer group")
    assert error["param"] == "group_name"
    both = {"weight_dir": "/tmp", "update_info": update_info}
    assert assert_error(rl.post("/update_weights", json=both), 400)["param"] == "update_info"
    error = assert_error(rl.post("/update_weights", json={}), 400, "skyrl-train's")
    assert error["param"] == "weight_dir"


# -- sleep and wake-up: vLLM's query, skyrl-train's bodies, SGLang's memory routes -------------


def generate_status(client: httpx.Client) -> int:
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    return client.post("/inference/v1/generate", json=body).status_code


def test_skyrl_sleep_and_wake_up_bodies(rl: httpx.Client) -> None:
    """skyrl-train's RemoteInferenceEngine sends ``level`` / ``tags`` in the JSON body (``tags:
    1`` when its caller names none) and parses the JSON answer. A wake-up that names some tags
    leaves the server asleep until the rest are woken, as vLLM's engine."""
    assert ok(rl.post("/sleep", json={"level": 2})) == {"status": "ok"}
    assert ok(rl.get("/is_sleeping")) == {"is_sleeping": True}
    assert generate_status(rl) == 503
    assert ok(rl.post("/wake_up", json={"tags": ["weights"]})) == {"status": "ok"}
    assert ok(rl.get("/is_sleeping")) == {"is_sleeping": True}
    ok(rl.post("/wake_up", json={"tags": ["kv_cache"]}))
    assert ok(rl.get("/is_sleeping")) == {"is_sleeping": False}
    assert generate_status(rl) == 200
    ok(rl.post("/sleep", json={"level": 1}))
    assert ok(rl.post("/wake_up", json={"tags": 1})) == {"status": "ok"}
    assert ok(rl.get("/is_sleeping")) == {"is_sleeping": False}
    # vLLM's query form; the body's value wins over the query's.
    ok(rl.post("/sleep", params={"level": 1, "mode": "wait"}))
    ok(rl.post("/wake_up", params={"tags": ["weights", "kv_cache"]}))
    assert ok(rl.get("/is_sleeping")) == {"is_sleeping": False}
    refused = rl.post("/sleep", params={"level": 1}, json={"level": 3})
    assert assert_error(refused, 400, "level")["param"] == "level"
    assert assert_error(rl.post("/wake_up", json={"tags": ["wieghts"]}), 400)["param"] == "tags"
    assert ok(rl.get("/is_sleeping")) == {"is_sleeping": False}


def test_sglang_memory_occupation_routes(rl: httpx.Client) -> None:
    """SGLang's sleep (AReaL, verl): both routes answer JSON null, GET or POST, body optional."""
    released = rl.post("/release_memory_occupation", json={})
    assert released.status_code == 200 and released.json() is None
    assert ok(rl.get("/is_sleeping")) == {"is_sleeping": True}
    assert generate_status(rl) == 503
    # verl's colocated order: weights first (then the new weights), then the KV cache.
    assert rl.post("/resume_memory_occupation", json={"tags": ["weights"]}).json() is None
    assert ok(rl.get("/is_sleeping")) == {"is_sleeping": True}
    resumed = rl.get("/resume_memory_occupation")
    assert resumed.status_code == 200 and resumed.json() is None
    assert ok(rl.get("/is_sleeping")) == {"is_sleeping": False}
    assert generate_status(rl) == 200
    partial = rl.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert partial.status_code == 200 and generate_status(rl) == 503
    ok(rl.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}))
    assert generate_status(rl) == 200


def test_sglang_flush_cache(rl: httpx.Client) -> None:
    """skyrl-train's SGLang backend resets the prefix cache with ``POST /flush_cache`` and
    reads SGLang's text."""
    for method in ("GET", "POST"):
        response = rl.request(method, "/flush_cache")
        assert response.status_code == 200, response.text
        assert response.text.startswith("Cache flushed.\n")
    refused = rl.post("/flush_cache", params={"timeout": -1})
    assert assert_error(refused, 400, "timeout")["param"] == "timeout"


@pytest.mark.hf_only  # vLLM's blocks are 128 tokens on CPU
def test_flush_cache_empties_the_prefix_cache(rl: httpx.Client) -> None:
    prompt = [(11 * i) % 30000 + 700 for i in range(100)]
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1}}

    def cached() -> int:
        usage = ok(rl.post("/inference/v1/generate", json=body))["usage"]
        return usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)

    cached()
    assert cached() == 96
    assert rl.post("/flush_cache").status_code == 200
    assert cached() == 0


# -- SGLang's pause holds new requests (AReaL) -------------------------------------------------


def areal_generate_body(input_ids: list[int]) -> dict:
    """AReaL's RemoteSGLangEngine.agenerate body (greedy)."""
    sampling = {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": 8, "temperature": 0.0}
    sampling |= {"stop_token_ids": [], "frequency_penalty": 0.0}
    return {
        "input_ids": input_ids,
        "image_data": None,
        "sampling_params": sampling,
        "return_logprob": True,
        "stream": False,
    }


class Sent:
    """One request posted on a thread: its response (or the exception) once it answered."""

    def __init__(self, server: Server, path: str, body: dict, timeout: float = 120) -> None:
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.done = threading.Event()
        args = (server, path, body, timeout)
        threading.Thread(target=self._run, args=args, daemon=True).start()

    def _run(self, server: Server, path: str, body: dict, timeout: float) -> None:
        try:
            with server.client() as client:
                self.response = client.post(path, json=body, timeout=timeout)
        except Exception as exc:
            self.error = exc
        self.done.set()

    def result(self) -> httpx.Response:
        assert self.done.wait(120), "no answer"
        assert self.response is not None, self.error
        return self.response


def test_areal_request_during_pause_generation_completes_after_continue(
    rl_server: Server, rl: httpx.Client
) -> None:
    """AReaL pauses with a bodiless POST /pause_generation while its rollout workers keep
    sending /generate; SGLang holds those until /continue_generation (a 503 three times makes
    AReaL give up). The held request then gives the ids it gives unpaused."""
    body = areal_generate_body([504, 3575, 282, 4649, 314])
    reference = ok(rl.post("/generate", json=body))
    seeded = {**body, "sampling_params": {**body["sampling_params"], "temperature": 1.0}}
    seeded["sampling_params"]["sampling_seed"] = 5
    seeded_reference = ok(rl.post("/generate", json=seeded))
    assert ok(rl.post("/pause_generation"))["status"] == "ok"
    held = [Sent(rl_server, "/generate", body), Sent(rl_server, "/generate", seeded)]
    time.sleep(0.5)
    assert not any(sent.done.is_set() for sent in held)
    assert ok(rl.get("/is_paused")) == {"is_paused": True}
    assert ok(rl.post("/continue_generation"))["status"] == "ok"
    assert ok(held[0].result())["output_ids"] == reference["output_ids"]
    assert ok(held[1].result())["output_ids"] == seeded_reference["output_ids"]
    # vLLM's pause keeps answering 503 to new requests.
    ok(rl.post("/pause", params={"mode": "abort"}))
    assert rl.post("/generate", json=body).status_code == 503
    ok(rl.post("/resume"))


def test_pause_generation_holds_a_bounded_queue_until_clients_leave(
    rl_server: Server, rl: httpx.Client
) -> None:
    """At most --max-held-requests (2 here) wait; a client that gives up frees its place."""
    body = areal_generate_body([1, 2, 3])
    ok(rl.post("/pause_generation", json={"mode": "abort"}))
    try:
        gone = Sent(rl_server, "/generate", body, timeout=0.5)
        assert gone.done.wait(10) and isinstance(gone.error, httpx.TimeoutException)
        time.sleep(0.3)  # the server frees its place once it sees the disconnect
        sent = [Sent(rl_server, "/inference/v1/generate", GENERATE) for _ in range(3)]
        deadline = time.monotonic() + 10
        while not any(s.done.is_set() for s in sent):
            assert time.monotonic() < deadline, "the third request was held too"
            time.sleep(0.05)
        refused = next(s for s in sent if s.done.is_set()).result()
        assert_error(refused, 503, "--max-held-requests")
    finally:
        ok(rl.post("/continue_generation", json={}))
    answered = [s.result() for s in sent if s.response is not refused]
    assert [r.status_code for r in answered] == [200, 200]
    # The request whose client left never started.
    assert ok(rl.get("/get_load")) == {"load": 0}


GENERATE = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}


# -- vLLM's /server_info (TRL's first call) ----------------------------------------------------


def test_trl_reads_the_resolved_config_from_server_info(rl: httpx.Client) -> None:
    """TRL's async GRPO VLLMClient: ``get_dtype`` reads ``vllm_config.model_config.dtype`` and
    ``get_server_info`` the whole ``vllm_config``."""
    info = ok(rl.get("/server_info", params={"config_format": "json"}))
    config = info["vllm_config"]
    assert config["model_config"]["dtype"] == "torch.float32"
    assert config["model_config"]["max_logprobs"] == -1  # the rl server's flag, as given
    max_model_len = ok(rl.get("/v1/models"))["data"][0]["max_model_len"]
    assert config["model_config"]["max_model_len"] == max_model_len
    assert config["scheduler_config"]["max_num_seqs"] == 64
    assert config["parallel_config"]["world_size"] == ok(rl.get("/get_world_size"))["world_size"]
    assert config["weight_transfer_config"] == {"backend": "gloo", "timeout_s": 20.0}  # as given
    assert set(info) == {"vllm_config", "vllm_env", "system_env"}
    # vLLM's default is the config as text.
    text = ok(rl.get("/server_info"))["vllm_config"]
    assert isinstance(text, str) and "dtype='torch.float32'" in text
    refused = rl.get("/server_info", params={"config_format": "yaml"})
    assert assert_error(refused, 400, "config_format")["param"] == "config_format"
