"""Weight transfer without a model: vLLM's packed layout, the flag, and the bodies refused
before any engine work (over the fake engine). The transfer itself is in test_weight_transfer."""

from __future__ import annotations

import base64
import contextlib
from typing import Any

import pytest
import safetensors.torch
import torch

from tests.conftest import assert_error
from tests.fast_app import FastApp
from tokenwire.weight_transfer import (
    TensorMeta,
    WeightTransferConfig,
    dtype_named,
    pack,
    packed_chunks,
    unpack,
)


def test_packed_chunks_follow_vllms_layout() -> None:
    """A tensor joins the chunk whose size it takes past the buffer (it is that chunk's last),
    as vLLM's ``packed_nccl_broadcast_consumer`` cuts them; pack and unpack round-trip."""
    tensors = [torch.arange(n, dtype=torch.float32) for n in (4, 4, 4, 1, 8)]
    metas = [TensorMeta(f"t{i}", t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]
    chunks = packed_chunks(metas, buffer_size_bytes=20)  # 16, 16, 16, 4, 32 bytes
    assert [[m.name for m in chunk] for chunk in chunks] == [["t0", "t1"], ["t2", "t3", "t4"]]
    by_name = dict(zip((m.name for m in metas), tensors, strict=True))
    for chunk in chunks:
        buffer = pack([by_name[m.name] for m in chunk])
        for name, tensor in unpack(buffer, chunk):
            assert torch.equal(tensor, by_name[name])


def test_dtype_names_of_both_dialects() -> None:
    assert dtype_named("bfloat16") is torch.bfloat16  # vLLM's dtype_names
    assert dtype_named("torch.float32") is torch.float32  # SGLang's dtypes
    assert dtype_named("Tensor") is None and dtype_named("float128") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gloo", "not JSON"),
        ("[]", "JSON object"),
        ('{"backend": "gloo", "buffer": 1}', "unknown keys"),
        ('{"backend": ""}', "backend"),
        ('{"timeout_s": 0}', "timeout_s"),
        ('{"timeout_s": true}', "timeout_s"),
    ],
)
def test_weight_transfer_config_refusals(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WeightTransferConfig.parse(text)


def test_server_info_reports_the_config(fast_rl: FastApp) -> None:
    info = fast_rl.client.get("/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "gloo", "timeout_s": 20.0}


# The base64 of a safetensors file holding no tensors.
_EMPTY = base64.b64encode(safetensors.torch.save({})).decode()


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "/init_weight_transfer_engine",
            {"init_info": {"master_address": "h", "master_port": 1, "world_size": 2}},
            "rank_offset",
        ),
        (
            "/init_weight_transfer_engine",
            {"init_info": {"master_port": 1, "rank_offset": 2, "world_size": 2}},
            "outside a group",
        ),
        (
            "/init_weight_transfer_engine",
            {"init_info": {"master_port": 70000, "rank_offset": 1, "world_size": 2}},
            "master_port",
        ),
        (
            "/update_weights",
            {"update_info": {"names": ["a"], "dtype_names": [], "shapes": [[1]]}},
            "`dtype_names` should be of the same size",
        ),
        (
            "/update_weights",
            {"update_info": {"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]]}},
            "shapes",
        ),
        ("/update_weights", {"update_info": []}, "names no receiving rank"),
        ("/finish_weight_update", {}, "without a matching start_weight_update"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="]}, "pickles"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": ["%%"], "load_format": "safetensors"},
            "not base64 of a safetensors file",
        ),
        ("/update_weights_from_distributed", {"group_name": "g"}, "names, dtypes and shapes"),
        (
            "/update_weights_from_distributed",
            {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"},
            "no weight-transfer group named 'g'",
        ),
        (
            "/update_weights_from_distributed",
            {"name": "a", "dtype": "complex", "shape": [1]},
            "is not a torch dtype",
        ),
        ("/destroy_weights_update_group", {"group_name": "g"}, "no weight-transfer group"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [_EMPTY], "load_format": "safetensors", "lora_name": "x"},
            "LoRA is off",
        ),
        (
            "/update_weights",
            {"update_info": {"names": [], "dtype_names": [], "shapes": [], "lora_name": ""}},
            "lora_name",
        ),
        (
            "/update_weights",
            {"update_info": {"names": [], "dtype_names": [], "shapes": [], "lora_name": "x"}},
            "not initialised",
        ),
    ],
)
def test_bad_bodies_are_400s_before_any_transfer(
    fast_rl: FastApp, path: str, body: dict, message: str
) -> None:
    assert_error(fast_rl.client.post(path, json=body), 400, message)


def test_the_group_process_takes_only_what_was_announced() -> None:
    """Over gloo on loopback, this test as the trainer: a call comes whole; one that comes
    short or holds NaN is refused with the group still in step; a broadcast larger than
    announced ends the child (gloo's abort) and not this process."""
    import threading

    from tests.conftest import free_port
    from tokenwire.group_process import GroupLost, GroupProcess
    from tokenwire.weight_transfer import (
        ReceivedTensorError,
        broadcast,
        join_group,
        leave_group,
    )

    port = free_port()
    join = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
    # The window covers the child's start (a fresh interpreter importing torch): on CI's loaded
    # 2 cores that once took most of 30 s. No case below waits for it.
    join |= {"backend": "gloo", "group_name": "safety", "timeout_s": 120}
    opened: dict[str, GroupProcess] = {}
    thread = threading.Thread(
        target=lambda: opened.setdefault("g", GroupProcess(torch.device("cpu"), rank=1, **join))
    )
    thread.start()
    trainer = join_group(rank=0, **join)
    thread.join()
    group = opened["g"]
    a, b = torch.arange(4.0), torch.ones(2, 3)
    metas = [TensorMeta("a", torch.float32, (4,)), TensorMeta("b", torch.float32, (2, 3))]

    def call(sent: list[torch.Tensor], packed: bool = False, allow: bool = False) -> Any:
        answer: dict[str, Any] = {}

        def run() -> None:
            try:
                answer["r"] = group.receive(
                    metas, packed=packed, buffer_size_bytes=64, allow_nonfinite=allow
                )
            except (ReceivedTensorError, GroupLost) as exc:
                answer["r"] = exc

        receiving = threading.Thread(target=run)
        receiving.start()
        with contextlib.suppress(RuntimeError):  # the receiving end is gone
            for tensor in sent:
                broadcast(tensor, trainer)
        receiving.join()
        return answer["r"]

    try:
        got = call([a, b])
        assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
        short = call([a, b[:1]])
        assert isinstance(short, ReceivedTensorError) and "b (announced float32" in str(short)
        nan = call([a, torch.full((2, 3), float("nan"))])
        assert isinstance(nan, ReceivedTensorError) and "b holds NaN" in str(nan)
        # --allow-nonfinite-weights: taken (a tensor ending in +NaN or +inf would read as short)
        assert torch.isneginf(call([a, -b / 0], allow=True)["b"]).all()
        packed = call([pack([a, b])], packed=True)  # one chunk: 40 bytes stay under 64
        assert torch.equal(packed["b"], b)
        larger = call([b, a])
        assert isinstance(larger, GroupLost) and "more bytes than announced" in str(larger)
    finally:
        group.close()
        leave_group(trainer)
