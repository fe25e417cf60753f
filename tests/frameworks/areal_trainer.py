"""AReaL 1.0.4's trainer side of an "xccl" weight update against one tokenwire server, through
its remote engine (``RemoteSGLangEngine`` or ``RemotevLLMEngine``), on the CPU platform's gloo.

    python -m tests.frameworks.areal_trainer BACKEND[,BACKEND...] MODEL_DIR OUT_DIR HOST:PORT
        VERSION[,VERSION...]
    python -m tests.frameworks.areal_trainer lora MODEL_DIR ADAPTER_DIR OUT_DIR HOST:PORT
        WRONG_RANK

One AdamW step (saved to OUT_DIR); then per backend (sglang, vllm) the group, "ready"; on a
line from stdin, the update (named VERSION), the trainer's end of the group closed, "sent".

``lora``: AReaL's LoRA training (``use_lora``) with ``RemotevLLMEngine``: the PEFT adapter at
ADAPTER_DIR (the one the server started with as ``default_lora-v0``, AReaL's initial LoRA), one
AdamW step of its factors (the adapter saved to OUT_DIR), the group, "ready"; on a line from
stdin, version 1 of the adapter (``/areal_set_update_weight_meta_lora`` then
``/areal_update_weights_lora_xccl``, per bucket), "sent"; on another, version 2 with
``lora_rank`` WRONG_RANK in the trainer's config (its factors mis-sized for it), "refused" and
the error on the next line.
The glue between AReaL's calls is ``FSDPEngine``'s rank 0 written out
(``_init_weight_update_from_distributed``, ``_update_weights_from_distributed`` with its
buckets), since an ``FSDPEngine`` needs its whole training setup; the HTTP bodies, the group
and the pause are AReaL's code. The new version is named on the server with tokenwire's
``/update_weight_version`` before ``continue_generation``: AReaL keeps versions in the client
(``set_version``) and sends none.
"""

from __future__ import annotations

import sys

import httpx
import torch
import torch.distributed as dist
from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import ParamSpec, WeightUpdateMeta
from areal.engine.core.distributed import init_custom_process_group
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.engine.vllm_remote import RemotevLLMEngine
from areal.infra.platforms import current_platform
from areal.utils.constants import DIST_GROUP_DEFAULT_TIMEOUT
from areal.utils.network import find_free_ports
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.weight_trainer import one_step

# Small buckets, so the update takes several update_weights_from_distributed calls (AReaL's
# default, 1024 MiB, would carry SmolLM2 in one).
BUCKET_MB = 128


def buckets(model: torch.nn.Module, limit_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Every parameter of ``model`` in buckets (``buckets_of``)."""
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    return buckets_of(named, limit_bytes)


def buckets_of(
    named: list[tuple[str, torch.Tensor]], limit_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """``_update_weights_from_distributed``'s cut: a bucket closes before the tensor that would
    take it past the limit."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if size > 0 and size + nbytes > limit_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def main(backends: str, model_dir: str, out_dir: str, address: str, versions: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    one_step(model)
    model.save_pretrained(out_dir)
    # One round per backend, the same weights each time: one process and one step for all.
    for backend, version in zip(backends.split(","), versions.split(","), strict=True):
        send_round(backend, model, address, version)


def send_round(backend: str, model: torch.nn.Module, address: str, version: str) -> None:
    """AReaL's remote engine of ``backend``: join, "ready"; on a line from stdin, update."""
    engine_class = RemoteSGLangEngine if backend == "sglang" else RemotevLLMEngine
    rollout = engine_class(InferenceEngineConfig(backend=f"{backend}:d1", request_timeout=120))
    rollout.initialize(addr=address)
    meta = WeightUpdateMeta.from_fsdp_xccl(
        ModelAllocation.from_str(f"{backend}:d1", name="rollout"), weight_chunked_mem_mb=BUCKET_MB
    )
    group = join(rollout, meta)
    print("ready", flush=True)
    sys.stdin.readline()
    # _update_weights_from_distributed
    rollout.pause_generation()
    for bucket in buckets(model, meta.weight_chunked_mem_mb * 1024 * 1024):
        send_bucket(rollout, meta, bucket, group)
    rollout.set_version(1)
    httpx.post(f"http://{address}/update_weight_version", json={"new_version": version})
    rollout.continue_generation()
    rollout.destroy()
    dist.destroy_process_group(group)  # the next round's group takes the same name
    print("sent", flush=True)


def send_bucket(
    rollout: RemotevLLMEngine | RemoteSGLangEngine,
    meta: WeightUpdateMeta,
    bucket: list[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup,
) -> None:
    """``_update_bucket_weights_from_distributed``: the engine's requests for one bucket while
    rank 0 broadcasts its tensors."""
    specs = [
        ParamSpec(name=name, shape=tuple(t.shape), dtype=str(t.dtype).split("torch.")[1])
        for name, t in bucket
    ]
    received = rollout.update_weights_from_distributed(meta, specs)
    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in bucket]
    try:
        for handle in handles:
            handle.wait()
    except Exception:
        # A server that refused the bucket closed the group, so the broadcast broke off
        # first; its answer says why (FSDPEngine would raise the broadcast's error).
        received.result()
        raise
    received.result()


def join(
    rollout: RemotevLLMEngine | RemoteSGLangEngine, meta: WeightUpdateMeta
) -> dist.ProcessGroup:
    """``_init_weight_update_from_distributed``: the group, rank 0 here."""
    # AReaL takes gethostip(), the server dials loopback.
    meta.nccl_master_address = "127.0.0.1"
    meta.nccl_master_port = find_free_ports(1)[0]
    meta.nccl_group_name = "update_weight_group"
    joined = rollout.init_weights_update_group(meta)
    group = init_custom_process_group(
        backend=current_platform.communication_backend,
        world_size=meta.gen_allocation.parallel.world_size + 1,
        init_method=f"tcp://127.0.0.1:{meta.nccl_master_port}",
        rank=0,
        group_name=meta.nccl_group_name,
        timeout=DIST_GROUP_DEFAULT_TIMEOUT,
    )
    joined.result()
    return group


def lora(model_dir: str, adapter_dir: str, out_dir: str, address: str, wrong_rank: str) -> None:
    """AReaL's LoRA rounds (see the module docstring): ``FSDPEngine`` with ``use_lora``,
    its ``_update_weights_from_distributed`` over the trainable parameters only, with the
    ``peft_config`` it builds from its own config (``lora_rank``, ``lora_alpha``,
    ``target_modules``, bias "none")."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    one_step(model)
    model.save_pretrained(out_dir)
    peft = model.peft_config["default"]
    rollout = RemotevLLMEngine(InferenceEngineConfig(backend="vllm:d1", request_timeout=120))
    rollout.initialize(addr=address)
    # rl_trainer.py's xccl meta with use_lora (gconfig.lora_name's default, lora_int_id 1).
    meta = WeightUpdateMeta.from_fsdp_xccl(
        ModelAllocation.from_str("vllm:d1", name="rollout"),
        weight_chunked_mem_mb=BUCKET_MB,
        use_lora=True,
        lora_name="default_lora",
        base_model_name=model_dir,
    )
    group = join(rollout, meta)
    print("ready", flush=True)
    factors = [(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad]
    for version, rank in ((1, peft.r), (2, int(wrong_rank))):
        sys.stdin.readline()
        versioned = meta.with_version(version)  # rl_trainer: global_step + 1
        versioned.peft_config = {
            "r": rank,
            "lora_alpha": peft.lora_alpha,
            "target_modules": sorted(peft.target_modules),
            "bias": "none",
        }
        rollout.pause_generation()
        try:
            for bucket in buckets_of(factors, meta.weight_chunked_mem_mb * 1024 * 1024):
                send_bucket(rollout, versioned, bucket, group)
        except Exception as exc:  # FSDPEngine raises; the trainer's loop would end here
            print("refused", flush=True)
            print(" ".join(str(exc).split()), flush=True)
            break
        rollout.set_version(version)
        rollout.continue_generation()
        print("sent", flush=True)
    rollout.destroy()
    dist.destroy_process_group(group)


if __name__ == "__main__":
    if sys.argv[1] == "lora":
        lora(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
