"""A trainer process for the weight-transfer tests: SmolLM2, one optimizer step, then its new
weights broadcast to tokenwire servers through ``tokenwire.client``.

    python -m tests.weight_trainer step MODEL_DIR OUT_DIR VERSION API_KEY URL...
        one AdamW step, the new weights saved to OUT_DIR (the test's reference), "ready" on
        stdout; on a line from stdin, ``WeightSender.send`` to every URL, then "sent".
    python -m tests.weight_trainer die MODEL_DIR - - API_KEY URL
        joins, starts an update, broadcasts half of the tensors and dies (``os._exit``).
"""

from __future__ import annotations

import os
import sys
import threading

import torch
from transformers import AutoModelForCausalLM

from tokenwire.client import Client
from tokenwire.client.weights import WeightSender
from tokenwire.weight_transfer import broadcast, dtype_name


def one_step(model: torch.nn.Module) -> None:
    """A real training step: next-token loss on a fixed sequence, one AdamW update."""
    torch.manual_seed(0)
    ids = torch.tensor([[504, 3575, 282, 4649, 314, 5248, 30, 378, 3575, 282, 4649, 314]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()


def main(mode: str, model_dir: str, out_dir: str, version: str, api_key: str, *urls: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
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


if __name__ == "__main__":
    main(*sys.argv[1:])
