"""TRL 1.16's ``VLLMClient`` (``trl vllm-serve``'s client, unmodified) as a trainer against one
tokenwire server, with a gloo stand-in for the two vLLM calls it makes to move tensors.

    python -m tests.frameworks.trl_trainer MODEL_DIR OUT_DIR URL

One AdamW step (saved to OUT_DIR); ``init_communicator`` ("ready"); on a line from stdin,
``update_model_params`` (start, one packed ``/update_weights``, finish), ``close_communicator``,
"sent".

TRL's weight sync is vLLM's NCCL trainer engine: ``init_communicator`` refuses any device but
CUDA, and the group and broadcast are vLLM's (``nccl_common.trainer_init``,
``packed_tensor.packed_nccl_broadcast_producer``), imported only when vLLM is installed. Here
those two are stand-ins over gloo (the group as the trainer's default group, which is how the
server joins a vLLM-form init that names none; vLLM's packed chunks), and the device check
is passed with ``"cuda"`` (no index: TRL then sets no device). Everything TRL sends over HTTP,
and when, is TRL's own code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import trl.generation.vllm_client as vllm_client
from transformers import AutoModelForCausalLM

from tests.weight_trainer import one_step
from tokenwire.weight_transfer import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    TensorMeta,
    broadcast,
    join_group,
    pack,
    packed_chunks,
)


def trainer_init(init_info: dict[str, Any]) -> SimpleNamespace:
    """vLLM's ``trainer_init`` over gloo: rank 0 of the group the server joins. The result
    has the ``group.store`` and ``group.socket`` TRL's ``close_communicator`` clears."""
    group = join_group(
        master_address=init_info["master_address"],
        master_port=init_info["master_port"],
        rank=0,
        world_size=init_info["world_size"],
        backend="gloo",
        group_name=None,
        timeout_s=60,
    )
    return SimpleNamespace(gloo=group, group=SimpleNamespace(store=None, socket=None))


def packed_broadcast_producer(
    iterator: Iterator[Any],
    group: SimpleNamespace,
    src: int,
    post_iter_func: Callable[[Any], torch.Tensor],
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
) -> None:
    """vLLM's ``packed_nccl_broadcast_producer`` over gloo: the tensors in vLLM's packed chunks
    (its default buffer size, which the server assumes when ``init_info`` names none)."""
    assert src == 0
    tensors = [post_iter_func(item).detach() for item in iterator]
    metas = [TensorMeta(str(i), t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]
    for chunk in packed_chunks(metas, buffer_size_bytes):
        broadcast(pack([tensors[int(meta.name)] for meta in chunk]), group.gloo)


def main(model_dir: str, out_dir: str, url: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    one_step(model)
    model.save_pretrained(out_dir)
    # What importing TRL's client with vLLM >= 0.28 installed would bind.
    vllm_client.is_vllm_available = lambda *args, **kwargs: True
    vllm_client._HAS_STATEFUL_TRAINER_ENGINE = True
    vllm_client.get_ip = lambda: "127.0.0.1"
    vllm_client.open_trainer_endpoint = trainer_init
    vllm_client.packed_nccl_broadcast_producer = packed_broadcast_producer
    client = vllm_client.VLLMClient(base_url=url, group_port=find_port())
    client.init_communicator(device="cuda")
    print("ready", flush=True)
    sys.stdin.readline()
    client.update_model_params(model)
    client.close_communicator()
    print("sent", flush=True)


def find_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main(*sys.argv[1:])
