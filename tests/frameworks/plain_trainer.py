"""The most ordinary trainer (``tests.weight_trainer``'s torch mode: ``init_process_group`` and
one ``dist.broadcast`` per tensor over vLLM's HTTP bodies), waiting for the test's word before
it sends, so a request can be in flight across its update.

    python -m tests.frameworks.plain_trainer MODEL_DIR OUT_DIR VERSION URL

One AdamW step (saved to OUT_DIR), the group joined, "ready"; on a line from stdin, the update,
"sent".
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM

from tests.weight_trainer import one_step, torch_join, torch_send


def main(model_dir: str, out_dir: str, version: str, url: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    one_step(model)
    model.save_pretrained(out_dir)
    # The server holds no key (the frameworks send none); an empty one is no valid header.
    server = torch_join("unused", url)
    print("ready", flush=True)  # joined: the update alone spans the test's held request
    sys.stdin.readline()
    torch_send(server, model, version)
    print("sent", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
