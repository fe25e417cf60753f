"""New weights into a running server: in memory over gloo (loopback) against a checkpoint
reload from disk, the same weights in the same run (seconds per update, GB/s, ratio).

Per model, a real server (``--enable-rl-control --weight-transfer-config gloo``) and this
process as the trainer, alternating the paths for ``--rounds`` rounds (median reported):
- gloo: ``WeightSender.send`` (pause keep, start, one broadcast per tensor, finish, resume);
- gloo packed: the same with vLLM's packed chunks (``packed: true``, 1 GiB buffers);
- disk: what a trainer without a group waits for: ``save_pretrained`` (safetensors) to a
  fresh directory, then ``/update_weights {weight_dir}``; the reload alone is shown too.
Models: SmolLM2-135M (float32, as served) and a ~0.5B Llama of seeded random weights built here
(bfloat16). The weights are perturbed before each round so every update carries new values.

Usage: ``python bench/bench_weight_transfer.py [--rounds 3] [--quick] [--engine vllm]`` (quick:
SmolLM2 only; ``--engine vllm`` runs the server on vLLM's engine, float32, eager: run it with
``.venv-vllm``'s python, as ``make bench-vllm`` does).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from serverbench import ServerProcess, free_port, tokenwire_command
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tokenwire.assets import prepare
from tokenwire.client import Client
from tokenwire.client.weights import WeightSender

CONFIG = json.dumps({"backend": "gloo", "timeout_s": 600})


def random_half_b(base: Path, out: Path) -> Path:
    """A ~0.5B Llama (SmolLM2's tokenizer and vocabulary), seeded random weights, bfloat16."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=1280,
        intermediate_size=3456,
        num_hidden_layers=24,
        num_attention_heads=20,
        num_key_value_heads=5,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def nbytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def perturb(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + 1e-3 * (step % 2 * 2 - 1))


# The server flags of ``--engine vllm``: as the tests run vLLM's CPU engine.
VLLM_FLAGS = ("--engine", "vllm", "--dtype", "float32", "--enforce-eager")


def bench_model(
    label: str, model_dir: Path, rounds: int, scratch: Path, engine_flags: tuple[str, ...]
) -> dict[str, object]:
    port = free_port()
    command = tokenwire_command(
        port,
        *("--model", str(model_dir), "--enable-rl-control", "--weight-transfer-config", CONFIG),
        *engine_flags,
    )
    server = ServerProcess(command, port, log=scratch / f"{label}.log")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    size = nbytes(model)
    times: dict[str, list[float]] = {"gloo": [], "gloo packed": [], "disk": [], "reload": []}
    try:
        http = httpx.Client(base_url=server.url, timeout=3600)
        senders = {
            "gloo": WeightSender([Client(server.url, timeout=3600)]),
            "gloo packed": WeightSender([Client(server.url, timeout=3600)], packed=True),
        }
        for kind, sender in senders.items():
            sender.connect()
            for step in range(rounds):
                perturb(model, step)
                start = time.perf_counter()
                sender.send(model, version=f"{kind}-{step}")
                times[kind].append(time.perf_counter() - start)
                perturb(model, step)  # the disk round sends the same values
                target = scratch / f"{label}-{step}"
                start = time.perf_counter()
                model.save_pretrained(target)
                saved = time.perf_counter()
                body = {"weight_dir": str(target), "weight_version": f"disk-{step}"}
                http.post("/update_weights", json=body).raise_for_status()
                done = time.perf_counter()
                times["disk"].append(done - start)
                times["reload"].append(done - saved)
                shutil.rmtree(target)
            sender.close()
    finally:
        server.stop()
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    return {"label": label, "bytes": size, "medians": medians}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.quick = 1, True
    engine_flags = VLLM_FLAGS if args.engine == "vllm" else ()
    base = prepare("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory(prefix="tw-bench-weights-") as tmp:
        scratch = Path(tmp)
        models = [("SmolLM2-135M fp32", base)]
        if not args.quick:
            models.append(("random 0.5B bf16", random_half_b(base, scratch / "half-b")))
        print(f"engine: {args.engine}")
        print("| model | weights | path | s / update | GB/s | disk (save + reload) / path |")
        print("| --- | ---: | --- | ---: | ---: | ---: |")
        for label, model_dir in models:
            result = bench_model(label, model_dir, args.rounds, scratch, engine_flags)
            size = int(result["bytes"])  # type: ignore[call-overload]
            medians: dict[str, float] = result["medians"]  # type: ignore[assignment]
            for kind in ("gloo", "gloo packed", "disk", "reload"):
                seconds = medians[kind]
                name = "reload alone (disk)" if kind == "reload" else kind
                ratio = medians["disk"] / seconds
                print(
                    f"| {label} | {size / 1e9:.2f} GB | {name} | {seconds:.2f} | "
                    f"{size / 1e9 / seconds:.2f} | {ratio:.2f}x |"
                )


if __name__ == "__main__":
    main()
