"""A trainer process for the weight-transfer tests: SmolLM2, one optimizer step, then its new
weights broadcast to tokenwire servers through ``tokenwire.client``.

    python -m tests.weight_trainer step MODEL_DIR OUT_DIR VERSION API_KEY URL...
        one AdamW step, the new weights saved to OUT_DIR (the test's reference), "ready" on
        stdout; on a line from stdin, ``WeightSender.send`` to every URL, then "sent".
    python -m tests.weight_trainer die MODEL_DIR - - API_KEY URL
        joins, starts an update, broadcasts half of the tensors and dies (``os._exit``).
    python -m tests.weight_trainer torch MODEL_DIR OUT_DIR VERSION API_KEY URL
        the most ordinary trainer: one AdamW step (saved to OUT_DIR), then
        ``torch.distributed.init_process_group`` with the server and vLLM 0.33's bodies over
        plain HTTP, one ``dist.broadcast`` per tensor; no tokenwire code on this side.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from datetime import timedelta

import httpx
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tokenwire.client import Client
from tokenwire.client.weights import WeightSender
from tokenwire.weight_transfer import broadcast, dtype_name


def one_step(model: torch.nn.Module) -> None:
    """A real training step: next-token loss on a fixed sequence, one AdamW update."""
    torch.manual_seed(0)
    ids = [[504, 3575, 282, 4649, 314, 5248, 30, 378, 3575, 282, 4649, 314]]
    ids = torch.tensor(ids, device=next(model.parameters()).device)  # a trainer on CUDA too
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()


def main(mode: str, model_dir: str, out_dir: str, version: str, api_key: str, *urls: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if mode == "torch":
        one_step(model)
        model.save_pretrained(out_dir)
        torch_trainer(model, version, api_key, urls[0])
        print("sent", flush=True)
        return
    clients = [Client(url, api_key=api_key) for url in urls]
    sender = WeightSender(clients, timeout_s=30)
    if mode == "step":
        one_step(model)
        model.save_pretrained(out_dir)
        sender.connect()
        print("ready", flush=True)
        sys.stdin.readline()
        sender.send(model, version=version)
        sender.close()
        print("sent", flush=True)
        return
    # "die": the protocol by hand up to half of the broadcast
    sender.connect()
    params = list(model.named_parameters())
    control = clients[0].control
    control.pause("keep")
    control.start_weight_update()
    update_info = {
        "names": [name for name, _ in params],
        "dtype_names": [dtype_name(p.dtype) for _, p in params],
        "shapes": [list(p.shape) for _, p in params],
    }
    threading.Thread(target=control.receive_weights, args=(update_info,), daemon=True).start()
    for _, param in params[: len(params) // 2]:
        broadcast(param.detach(), sender._group)
    print("dying", flush=True)
    os._exit(1)


def torch_trainer(model: torch.nn.Module, version: str, api_key: str, url: str) -> None:
    """A plain trainer's side of vLLM's four phases, as a user would write it."""
    server = torch_join(api_key, url)
    torch_send(server, model, version)


def torch_join(api_key: str, url: str) -> httpx.Client:
    """``init_process_group`` with the server (its ``/init_weight_transfer_engine`` at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=120)
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1}
    init_info["world_size"] = 2
    joining = threading.Thread(
        target=_post, args=(server, "/init_weight_transfer_engine", {"init_info": init_info})
    )
    joining.start()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    joining.join()
    return server


def torch_send(server: httpx.Client, model: torch.nn.Module, version: str) -> None:
    """start, one ``dist.broadcast`` per tensor beside ``/update_weights``, finish, leave."""
    _post(server, "/start_weight_update", {})
    params = [(name, p.detach()) for name, p in model.named_parameters()]
    update_info = {
        "names": [name for name, _ in params],
        "dtype_names": [str(p.dtype).removeprefix("torch.") for _, p in params],
        "shapes": [list(p.shape) for _, p in params],
    }
    receiving = threading.Thread(
        target=_post, args=(server, "/update_weights", {"update_info": update_info})
    )
    receiving.start()
    for _, param in params:
        dist.broadcast(param, src=0)
    receiving.join()
    _post(server, "/finish_weight_update", {"weight_version": version})
    _post(server, "/shutdown_weight_transfer_engine", {})
    dist.destroy_process_group()


def _post(server: httpx.Client, path: str, body: dict) -> None:
    server.post(path, json=body).raise_for_status()


if __name__ == "__main__":
    main(*sys.argv[1:])
