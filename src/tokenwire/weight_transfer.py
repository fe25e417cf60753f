"""The wire side of in-memory weight transfer, shared by the server's receiver (``engine``) and
the trainer's sender (``client``), so both ends build the same group and cut the same chunks.

The group is a ``torch.distributed`` process group that the trainer (rank 0) and the servers
join over ``tcp://master_address:master_port``: the trainer hosts the rendezvous store and each
server sits at its ``rank_offset``. Both ends must key the store as the trainer formed the
group, in one of two ways (``join_group``'s ``group_name``):
- named: as SGLang's ``init_custom_process_group`` builds a second group beside a trainer's own
  (OpenRLHF, verl, skyrl-train, AReaL and tokenwire's ``WeightSender`` do): the store's keys
  under ``<group_name>/``, the group called ``group_name``;
- unnamed: a plain trainer's ``torch.distributed.init_process_group``, the trainer's default
  group: keys under ``default_pg/``, the group called ``"0"`` (torch names a process's first
  group so).
For each tensor of an update, in order, rank 0 broadcasts once; ``packed`` updates broadcast
vLLM's packed chunks instead (``packed_chunks``). A receiver takes one update call into one
buffer (``receive``), checking each broadcast came whole; ``tokenwire.group_process`` runs that
in a child process, so a broadcast gloo aborts on (or NCCL's watchdog tears down) ends the
child only.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the calls that need it: the API layer imports this
    import torch

# vLLM's defaults (``vllm.distributed.weight_transfer.packed_tensor``).
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2
# SGLang's default ``group_name``; vLLM's routes name none (a plain trainer's default group).
DEFAULT_GROUP_NAME = "weight_update_group"
# How torch's ``init_process_group`` keys and names a process's default group.
_DEFAULT_PG_PREFIX = "default_pg"
_DEFAULT_PG_NAME = "0"


DEFAULT_TIMEOUT_S = 300.0
DEFAULT_BACKEND = "nccl"  # vLLM's


@dataclass(frozen=True, slots=True)
class WeightTransferConfig:
    """``--weight-transfer-config``: vLLM's ``{"backend": ...}``, plus tokenwire's
    ``timeout_s``: how long joining the group, and each broadcast, may wait for the trainer."""

    backend: str = DEFAULT_BACKEND
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def parse(cls, text: str) -> WeightTransferConfig:
        """The flag's JSON; ``ValueError`` naming what is wrong."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        unknown = sorted(set(value) - {"backend", "timeout_s"})
        if unknown:
            raise ValueError(f"unknown keys {unknown}")
        backend = value.get("backend", DEFAULT_BACKEND)
        timeout_s = value.get("timeout_s", DEFAULT_TIMEOUT_S)
        if not isinstance(backend, str) or not backend:
            raise ValueError("backend must be a name")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ValueError("timeout_s must be a positive number")
        return cls(backend, float(timeout_s))

    def as_json(self) -> dict[str, Any]:
        """What ``/server_info`` reports (vLLM's field, then tokenwire's)."""
        return {"backend": self.backend, "timeout_s": self.timeout_s}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One tensor of an update as the trainer announces it: vLLM's ``names``, ``dtype_names``
    and ``shapes`` entries, zipped."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def dtype_named(name: str) -> torch.dtype | None:
    """``"bfloat16"`` (vLLM's ``dtype_names``) or ``"torch.bfloat16"`` (SGLang's ``dtypes``)
    as a torch dtype; None for a name torch has no dtype of."""
    import torch

    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's spelling: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def packed_chunks(metas: Sequence[TensorMeta], buffer_size_bytes: int) -> list[list[TensorMeta]]:
    """vLLM's packing: tensors join a chunk until its size passes ``buffer_size_bytes`` (the
    tensor that passes it is the chunk's last); each chunk is one uint8 broadcast of the
    tensors' bytes, back to back."""
    chunks: list[list[TensorMeta]] = []
    chunk: list[TensorMeta] = []
    size = 0
    for meta in metas:
        chunk.append(meta)
        size += meta.nbytes
        if size > buffer_size_bytes:
            chunks.append(chunk)
            chunk, size = [], 0
    if chunk:
        chunks.append(chunk)
    return chunks


def unpack(buffer: torch.Tensor, chunk: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one received packed chunk (views of ``buffer``)."""
    parts = buffer.split([meta.nbytes for meta in chunk])
    return [
        (meta.name, part.view(meta.dtype).view(meta.shape))
        for meta, part in zip(chunk, parts, strict=True)
    ]


def safetensors_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Tensors as one safetensors file in memory: how they cross a process boundary that is
    not the group (vLLM's RPCs turn tensors into lists) or land in a file."""
    from safetensors.torch import save

    return save({name: tensor.cpu().contiguous() for name, tensor in tensors.items()})


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One chunk's bytes, as the trainer broadcasts them."""
    import torch

    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def join_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str | None,
    timeout_s: float,
) -> Any:
    """Join (rank 0: host) the weight-transfer group, named (SGLang's form) or the trainer's
    default group (``group_name`` None); blocks until every rank has joined or ``timeout_s``
    passed. Each collective of the group fails after ``timeout_s`` too, so a trainer that
    stalls mid-broadcast cannot hold a receiver forever.

    A gloo group is gloo's own backend over the store keyed as torch keys a process group's
    (``<prefix>/<name>/cpu/``), not a registered process group: a process that has a default
    group of its own (vLLM's workers do, named "0") could not register a second "0". nccl
    groups are torch's process groups, named ones only."""
    # There is no public call that makes a second, independent group with its own store.
    from torch.distributed import PrefixStore, ProcessGroupGloo
    from torch.distributed.distributed_c10d import (
        Backend,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    url = f"tcp://{master_address}:{master_port}"
    prefix, name = (
        (_DEFAULT_PG_PREFIX, _DEFAULT_PG_NAME) if group_name is None else (group_name, group_name)
    )
    if backend != "gloo" and group_name is None:
        raise GroupJoinError(f"a trainer's default group is joined over gloo only, not {backend}")
    try:
        store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
        # The whole join within timeout_s; the group's collectives get timeout_s each.
        store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        keyed = PrefixStore(prefix, store)
        if backend == "gloo":
            # As _new_process_group_helper keys a group's gloo backend: name, then device.
            gloo_store = PrefixStore("cpu/", PrefixStore(f"{name}/", keyed))
            return ProcessGroupGloo(gloo_store, rank, world_size, timeout)
        group, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), keyed, group_name=name, timeout=timeout
        )
    except Exception as exc:
        # Never the far end's words: its bytes (or this process's id) must not reach a client.
        raise GroupJoinError(
            f"no group formed with tcp://{master_address}:{master_port} within "
            f"{timeout_s:g} s ({_join_failure(exc)})"
        ) from None
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class GroupJoinError(RuntimeError):
    """The group did not form; the message holds nothing the far end sent."""


def _join_failure(exc: Exception) -> str:
    """What went wrong, in this module's words."""
    text = str(exc).lower()
    if isinstance(exc, ConnectionRefusedError) or "refused" in text:
        return "connection refused"
    if isinstance(exc, TimeoutError) or "timeout" in text or "timed out" in text:
        return "timed out waiting for every rank"
    return "the far end is not a torch.distributed rendezvous of this group"


def leave_group(group: Any) -> None:
    """Destroy a group made by ``join_group`` (a process group's name can then be used again;
    a gloo backend closes its connections when dropped)."""
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        dist.destroy_process_group(group)


def broadcast(tensor: torch.Tensor, group: Any) -> None:
    """One broadcast from the trainer (rank 0) over ``group`` (either kind ``join_group``
    makes; a failure raises, a timeout after the group's)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


# Written as the last byte of each broadcast's buffer: gloo fills a buffer from its start and
# takes a shorter message silently, so this byte still there afterwards means the trainer sent
# less than it announced. As the last byte of a little-endian float it is the sign and exponent
# of a positive NaN or infinity (float16, float8) or of one above 2**127 (float32, bfloat16):
# a full message ends with it only when its last value is such, which is refused too.
_SHORT_SENTINEL = 0x7F
# Each broadcast's buffer starts at a multiple of this, so every tensor view is aligned.
_ALIGN = 64


class ReceivedTensorError(ValueError):
    """A broadcast that came short of what the trainer announced, or a tensor holding NaN or
    infinity: the group stayed in step, but the update must not load."""


def receive_nbytes(metas: Sequence[TensorMeta], *, packed: bool, buffer_size_bytes: int) -> int:
    """The size of the buffer ``receive`` takes for one update call."""
    layout = _broadcasts(metas, packed, buffer_size_bytes)
    return 0 if not layout else layout[-1][0] + sum(m.nbytes for m in layout[-1][1])


def received_tensors(
    buffer: torch.Tensor, metas: Sequence[TensorMeta], *, packed: bool, buffer_size_bytes: int
) -> dict[str, torch.Tensor]:
    """The tensors of one update call, as views of the ``buffer`` ``receive`` filled."""
    tensors: dict[str, torch.Tensor] = {}
    for offset, chunk in _broadcasts(metas, packed, buffer_size_bytes):
        size = sum(m.nbytes for m in chunk)
        tensors.update(unpack(buffer[offset : offset + size], chunk))
    return tensors


def receive(
    metas: Sequence[TensorMeta],
    group: Any,
    buffer: torch.Tensor,
    *,
    packed: bool = False,
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    allow_nonfinite: bool = False,
) -> dict[str, torch.Tensor]:
    """A receiver's side of one update call: each broadcast in the order the trainer sends
    them (``packed``: vLLM's packed chunks) into ``buffer`` (uint8, ``receive_nbytes`` long,
    zeroed);
    returns the tensors, views of it. ``ReceivedTensorError`` when a broadcast came short or a
    tensor holds NaN or infinity (unless ``allow_nonfinite``); raises what the group raises
    when a broadcast breaks off. A broadcast longer than announced is gloo's to catch: it
    aborts the process (``tokenwire.group_process`` receives in a child for that)."""
    from tokenwire.engine.weight_rules import all_finite

    tensors: dict[str, torch.Tensor] = {}
    for offset, chunk in _broadcasts(metas, packed, buffer_size_bytes):
        size = sum(m.nbytes for m in chunk)
        region = buffer[offset : offset + size]
        if size:
            region[-1] = _SHORT_SENTINEL
        broadcast(region, group)
        views = unpack(region, chunk)
        # A tensor with NaN before its end is named as such below, not as one that came short.
        if (
            size
            and int(region[-1]) == _SHORT_SENTINEL
            and (allow_nonfinite or all_finite(views[-1][1].reshape(-1)[:-1]))
        ):
            raise ReceivedTensorError(
                f"{_announced(chunk)}: fewer bytes came than announced, so the trainer sent "
                "other tensors than it named (another dtype, shape or order), or it ends in "
                "a NaN or infinity"
            )
        for name, tensor in views:
            if not allow_nonfinite and not all_finite(tensor):
                raise ReceivedTensorError(
                    f"{name} holds NaN or infinite values (--allow-nonfinite-weights loads them)"
                )
            tensors[name] = tensor
    return tensors


def _announced(chunk: Sequence[TensorMeta]) -> str:
    """A broadcast's tensors as the trainer announced them, for an error."""
    size = sum(m.nbytes for m in chunk)
    if len(chunk) > 1:
        return f"the packed chunk {chunk[0].name} .. {chunk[-1].name} ({size} bytes)"
    meta = chunk[0]
    return f"{meta.name} (announced {dtype_name(meta.dtype)} {list(meta.shape)}, {size} bytes)"


def _broadcasts(
    metas: Sequence[TensorMeta], packed: bool, buffer_size_bytes: int
) -> list[tuple[int, list[TensorMeta]]]:
    """Each broadcast of one update call: where its bytes start in the receive buffer, and
    the tensors it carries (one, or a packed chunk's, back to back)."""
    chunks = packed_chunks(metas, buffer_size_bytes) if packed else [[m] for m in metas]
    layout = []
    offset = 0
    for chunk in chunks:
        layout.append((offset, chunk))
        offset += -(-sum(m.nbytes for m in chunk) // _ALIGN) * _ALIGN
    return layout
