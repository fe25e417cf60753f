"""skyrl-train 0.3.1's trainer side against one tokenwire server, as its FSDP worker runs it
with a remote engine of either backend: ``Worker.init_weight_sync_state`` (the sender's group
and the engines' init at once), then ``broadcast_to_inference_engines`` (one
``BroadcastWeightTransferSender.send_chunks`` over every weight), on gloo. The backend picks
the routes skyrl-train's ``RemoteWeightLoader`` posts: SGLang's (``/init_weights_update_group``,
``/update_weights_from_distributed {name, dtype, shape}``) or its own vLLM server's
(``/init_weight_update_communicator``, ``/update_weights {names, dtypes, shapes}``).

    python -m tests.frameworks.skyrl_trainer BACKEND[,BACKEND...] MODEL_DIR OUT_DIR HOST:PORT

One AdamW step (saved to OUT_DIR); then per backend (sglang, vllm) the group, "ready"; on a
line from stdin, the weights, the group's teardown (skyrl-train's
``/destroy_weights_update_group``), "sent". Everything past the
step is skyrl-train's code; the two worker methods' glue is written out here because
``skyrl_train.workers`` needs a Ray actor and an FSDP model around it.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient
from skyrl_train.inference_engines.remote_inference_engine import create_remote_inference_engines
from skyrl_train.weight_sync import BroadcastTransferStrategy, WeightChunk
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import free_port
from tests.weight_trainer import one_step

# skyrl-train 0.3.1 chooses _new_process_group_helper's keyword by `str(torch.__version__) >=
# "2.6"`: as strings "2.13" < "2.6", so on torch 2.10+ it passes the removed `pg_options` and
# fails. It ships with torch 2.8 (its vllm extra); tokenwire needs 2.13. This process reports a
# version that passes the check as 2.8 does; torch itself is unchanged.
torch.__version__ = "2.8.0"  # type: ignore[assignment]


def config(backend: str, model_dir: str) -> object:
    """The keys of skyrl-train's ``ppo_base_config.yaml`` that the path reads: one remote
    engine, gloo, float32 weights (the server's dtype, for parity)."""
    return OmegaConf.create(
        {
            "trainer": {"policy": {"model": {"path": model_dir}}},
            "generator": {
                "backend": backend,
                "num_inference_engines": 1,
                "inference_engine_tensor_parallel_size": 1,
                "inference_engine_pipeline_parallel_size": 1,
                "inference_engine_data_parallel_size": 1,
                "weight_sync_backend": "gloo",
                "model_dtype": "float32",
                "override_existing_update_group": "enable",
                "enable_http_endpoint": False,
                "http_endpoint_host": "127.0.0.1",
                "http_endpoint_port": 0,
            },
        }
    )


async def main(backends: str, model_dir: str, out_dir: str, address: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    one_step(model)
    model.save_pretrained(out_dir)
    # skyrl-train's workers live in a training world of their own (the sender asks its rank and
    # barriers on it): here one rank.
    url = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # One round per backend, the same weights each time: one process and one step for all.
    for backend in backends.split(","):
        await send_round(backend, model, tokenizer, model_dir, address)


async def send_round(
    backend: str, model: torch.nn.Module, tokenizer: object, model_dir: str, address: str
) -> None:
    """Join, "ready"; on a line from stdin, send every weight, leave, "sent"."""
    cfg = config(backend, model_dir)
    # The node's address as Ray reports it; the test server dials loopback only.
    init_info = replace(BroadcastTransferStrategy.create_init_info(cfg), master_addr="127.0.0.1")
    engines = create_remote_inference_engines(
        [address],
        model_name=model_dir,
        engine_backend=backend,
        tokenizer=tokenizer,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_size=1,
    )
    client = InferenceEngineClient(engines, tokenizer, cfg)
    # Worker.init_weight_sync_state: both ends join the group at once, or neither returns.
    sender, _ = await asyncio.gather(
        asyncio.to_thread(
            BroadcastTransferStrategy.create_sender, init_info=init_info, inference_client=client
        ),
        client.init_weight_update_communicator(init_info),
    )
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    # What FSDP's weight extractor yields: one parameter per chunk, in the generator's dtype.
    chunks = (
        WeightChunk(names=[name], dtypes=[str(p.dtype)], shapes=[list(p.shape)], tensors=[p])
        for name, p in model.named_parameters()
    )
    await sender.send_chunks(chunks)
    await client.teardown()
    sender.teardown()
    print("sent", flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
