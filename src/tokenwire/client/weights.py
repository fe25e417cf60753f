"""The trainer's side of in-memory weight transfer: ``WeightSender`` pushes a model's weights
to one or many servers over one ``torch.distributed`` group, under vLLM's four-phase protocol.

A fleet shares one group: the trainer is rank 0 and server ``i`` joins at ``rank_offset`` i + 1
(vLLM's layout), so every tensor is broadcast once for all of them. Servers are started with
``--enable-rl-control --weight-transfer-config '{"backend": "gloo"}'``. Needs torch.

    sender = WeightSender([Client(url) for url in urls])
    sender.connect()
    sender.send(model, version="step-1")  # pause(keep) -> start -> update -> finish -> resume
    sender.close()
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from tokenwire.client.client import Client
from tokenwire.client.control import PauseMode
from tokenwire.weight_transfer import (
    DEFAULT_GROUP_NAME,
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    TensorMeta,
    broadcast,
    dtype_name,
    join_group,
    leave_group,
    pack,
    packed_chunks,
)

if TYPE_CHECKING:
    import torch


class WeightSenderError(RuntimeError):
    """A transfer that did not complete on every server (the first error, from a server or
    the broadcast); the servers that took part refuse generation until a complete update."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def json_config(config: dict[str, Any]) -> dict[str, Any]:
    """A PEFT config dict as JSON holds it (``LoraConfig.to_dict()`` keeps
    ``target_modules`` as a set; ``save_pretrained`` writes a list)."""
    return json.loads(json.dumps(config, default=lambda value: sorted(value)))


class WeightSender:
    """Weights from this process to ``clients``' servers (one group, the trainer at rank 0)."""

    def __init__(
        self,
        clients: Sequence[Client],
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str = "gloo",
        packed: bool = False,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not clients:
            raise ValueError("WeightSender needs at least one server")
        self.clients = list(clients)
        self.master_address = master_address
        self.master_port = master_port or free_port(master_address)
        self.backend = backend
        self.packed = packed
        self.buffer_size_bytes = packed_buffer_size_bytes
        self.timeout_s = timeout_s
        self._group: Any = None
        # One thread per server's call, and one for joining the group alongside them.
        self._pool = ThreadPoolExecutor(len(self.clients) + 1, thread_name_prefix="weight-sender")

    def connect(self) -> None:
        """Every server joins (its ``/init_weight_transfer_engine`` answers once all did)."""
        world_size = len(self.clients) + 1
        answers = [
            self._pool.submit(
                client.control.init_weight_transfer_engine,
                {
                    "master_address": self.master_address,
                    "master_port": self.master_port,
                    "rank_offset": rank,
                    "world_size": world_size,
                    "group_name": DEFAULT_GROUP_NAME,  # tokenwire's field: the form below
                    "packed": self.packed,
                    "packed_buffer_size_bytes": self.buffer_size_bytes,
                    "packed_num_buffers": DEFAULT_PACKED_NUM_BUFFERS,
                },
            )
            for rank, client in enumerate(self.clients, start=1)
        ]
        joining = self._pool.submit(
            join_group,
            master_address=self.master_address,
            master_port=self.master_port,
            rank=0,
            world_size=world_size,
            backend=self.backend,
            group_name=DEFAULT_GROUP_NAME,  # SGLang's form, beside the trainer's own group
            timeout_s=self.timeout_s,
        )
        # A server that refused never joins: give up then, not after the rendezvous timeout.
        wait([joining, *answers], return_when=FIRST_EXCEPTION)
        refused = _first_error(answers)
        if refused is not None:
            raise WeightSenderError(f"a server did not join: {refused}") from refused
        try:
            self._group = joining.result()
        except Exception as exc:
            raise WeightSenderError(f"the group did not form: {exc}") from exc
        wait(answers)
        _raise_first(answers)

    def send(
        self,
        weights: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        *,
        version: str | None = None,
        pause: PauseMode | None = "keep",
        lora_name: str | None = None,
        lora_config: dict[str, Any] | None = None,
    ) -> None:
        """Pause (``pause``: vLLM's mode; None: don't), start, broadcast every tensor while the
        servers receive it, finish with ``version``, resume. A module sends its parameters
        (tied ones once, as its checkpoint holds them).

        With ``lora_name`` the tensors are that LoRA adapter's factors under PEFT's names
        (``peft.get_peft_model_state_dict``), loaded (or replaced) as that adapter at finish;
        ``lora_config`` (``LoraConfig.to_dict()``) is needed the first time."""
        if self._group is None:
            raise WeightSenderError("connect() first")
        named = list(
            weights.named_parameters() if hasattr(weights, "named_parameters") else weights
        )
        tensors = [tensor.detach().contiguous() for _, tensor in named]
        metas = [
            TensorMeta(name, tensor.dtype, tuple(tensor.shape))
            for (name, _), tensor in zip(named, tensors, strict=True)
        ]
        update_info: dict[str, Any] = {
            "names": [meta.name for meta in metas],
            "dtype_names": [dtype_name(meta.dtype) for meta in metas],
            "shapes": [list(meta.shape) for meta in metas],
        }
        if lora_name is not None:
            update_info["lora_name"] = lora_name
            if lora_config is not None:
                update_info["lora_config"] = json_config(lora_config)
        if pause is not None:
            self._each(lambda client: client.control.pause(pause))
        try:
            self._update(metas, tensors, update_info, version)
        except BaseException:
            if pause is not None:  # servers whose weights broke refuse it, and stay paused
                wait([self._pool.submit(client.control.resume) for client in self.clients])
            raise
        if pause is not None:
            self._each(lambda client: client.control.resume())

    def _update(
        self,
        metas: list[TensorMeta],
        tensors: list[torch.Tensor],
        update_info: dict[str, Any],
        version: str | None,
    ) -> None:
        """vLLM's start, update (while broadcasting) and finish, on every server."""
        self._each(lambda client: client.control.start_weight_update())
        receiving = [
            self._pool.submit(client.control.receive_weights, update_info)
            for client in self.clients
        ]
        try:
            self._broadcast(metas, tensors, receiving)
        except Exception as exc:
            self._drop_group()
            # A server that refused the update closed its end of the group, which is what
            # broke the broadcast: its answer, on its way, says why (gloo's "Connection closed
            # by peer" does not). Leaving the group ends any server's receive that waits.
            wait(receiving, timeout=self.timeout_s)
            refused = _first_error(receiving)
            if refused is not None:
                raise WeightSenderError(f"a server refused the update: {refused}") from refused
            raise WeightSenderError(f"broadcast failed: {exc}") from exc
        _raise_first(receiving)
        self._each(lambda client: client.control.finish_weight_update(version))

    def _broadcast(
        self, metas: list[TensorMeta], tensors: list[torch.Tensor], receiving: list[Future[None]]
    ) -> None:
        """Each tensor (or vLLM's packed chunk) once; stop as soon as a server refused, rather
        than wait out the timeout in a broadcast nobody receives."""
        if self.packed:
            by_name = dict(zip((m.name for m in metas), tensors, strict=True))
            parts = [
                pack([by_name[meta.name] for meta in chunk])
                for chunk in packed_chunks(metas, self.buffer_size_bytes)
            ]
        else:
            parts = tensors
        for part in parts:
            refused = _first_error(receiving)
            if refused is not None:
                raise refused
            broadcast(part, self._group)

    def _each(self, call: Any) -> None:
        """``call(client)`` on every server at once; the first error, after all answered."""
        _raise_first([self._pool.submit(call, client) for client in self.clients])

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            leave_group(group)

    def close(self) -> None:
        """Servers leave the group (each that can), then this process."""
        if self._group is not None:
            answers = [
                self._pool.submit(client.control.shutdown_weight_transfer_engine)
                for client in self.clients
            ]
            for answer in answers:
                answer.exception()
            self._drop_group()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> WeightSender:
        self.connect()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _first_error(futures: list[Future[None]]) -> BaseException | None:
    return next((f.exception() for f in futures if f.done() and f.exception()), None)


def _raise_first(futures: list[Future[None]]) -> None:
    errors = [error for error in (f.exception() for f in futures) if error is not None]
    if errors:
        raise WeightSenderError(str(errors[0])) from errors[0]
