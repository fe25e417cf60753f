"""A receiver's weight-transfer group (``tokenwire.weight_transfer``) held in a child process.

Neither backend can refuse a broadcast that does not match its buffer: gloo calls
``std::terminate`` in the receiving process for a longer one (a trainer that sends tensors in
another order than it named them, or in a wider dtype), and NCCL checks no counts at all, so a
mismatch stalls until its watchdog tears the process down after the group's timeout (as it
does for a trainer that stalls). Held here, the group lives in a child started with ``spawn``
(a fork of a server with threads and an engine could deadlock), so either ending is the
child's alone: the server and its requests go on, and the caller learns that the group is gone.

Each update call is received into one buffer (the same for every call: it grows to the
largest call and lives as long as the group), checked (``weight_transfer.receive``) and handed
over to the caller whole; nothing of a failed call reaches the caller. The buffer is shared
with the caller as torch shares tensors between processes: CPU shared memory for gloo, a CUDA
IPC handle for nccl (on the caller's GPU).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from tokenwire.weight_transfer import (
    GroupJoinError,
    ReceivedTensorError,
    TensorMeta,
    join_group,
    leave_group,
    receive,
    receive_nbytes,
    received_tensors,
)

# Starting the child (a Python with torch) before its join's own timeout counts.
_START_S = 120.0
# How long a child that was asked to leave may take before it is killed.
_LEAVE_S = 10.0


class GroupLost(RuntimeError):
    """The group is gone: a broadcast broke off, or its process ended; nothing of the call
    was handed over."""


class GroupAborted(GroupLost):
    """gloo ended the group's process: the call carried more bytes than announced (a refusal
    of what the trainer sent, not a trainer gone)."""


class Group(Protocol):
    """One joined group: receive update calls, then close."""

    def receive(
        self,
        metas: Sequence[TensorMeta],
        *,
        packed: bool,
        buffer_size_bytes: int,
        allow_nonfinite: bool,
    ) -> dict[str, torch.Tensor]:
        """One update call's tensors, checked, valid until the next call (they share one
        buffer); ``ReceivedTensorError`` (refused, the group in step) or ``GroupLost``."""
        ...

    def close(self) -> None: ...


def open_group(device: torch.device, **join: Any) -> Group:
    """Join (``join_group``'s keywords) in a child process; the received tensors are on the
    CPU for gloo and on ``device`` (the engine's GPU) for nccl."""
    if join["backend"] == "gloo":
        return GroupProcess(torch.device("cpu"), **join)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return GroupProcess(device, **join)


class GroupProcess:
    """The group in a child process (see the module docstring). Calls come one at a time."""

    def __init__(self, device: torch.device, **join: Any) -> None:
        """Start the child and join; ``GroupJoinError`` (its message, sanitized by
        ``join_group``) when the group did not form. ``device``: where the child receives
        (its GPU for nccl)."""
        self._buffer: torch.Tensor | None = None  # the child's buffer, mapped here
        self._backend = join["backend"]
        context = mp.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(child_end, device, join),
            name="tokenwire-weight-group",
            daemon=True,
        )
        with _children_allowed():
            self._process.start()
        child_end.close()  # the child's end lives in the child only: its exit is our EOF
        failure = "the group's process did not start"
        try:
            if self._conn.poll(join["timeout_s"] + _START_S):
                failure = self._conn.recv()
        except (EOFError, OSError):
            failure = str(self._ending())
        if failure is not None:
            self.close()
            raise GroupJoinError(failure)

    def receive(
        self,
        metas: Sequence[TensorMeta],
        *,
        packed: bool,
        buffer_size_bytes: int,
        allow_nonfinite: bool,
    ) -> dict[str, torch.Tensor]:
        """Received in the child (each broadcast waits at most the group's timeout)."""
        try:
            self._conn.send((tuple(metas), packed, buffer_size_bytes, allow_nonfinite))
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._ending() from None
        if kind == "refused":
            raise ReceivedTensorError(value)
        if kind == "lost":
            raise GroupLost(value)
        # Held, so the child's next call comes in the same mapping (torch looks it up).
        self._buffer = value
        return received_tensors(value, metas, packed=packed, buffer_size_bytes=buffer_size_bytes)

    def close(self) -> None:
        """Ask the child to leave, and end it if it does not."""
        with contextlib.suppress(OSError):  # it has ended already
            self._conn.send(None)
        self._process.join(_LEAVE_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _ending(self) -> GroupLost:
        """Why the child ended, as far as this process can tell."""
        self._process.join(_LEAVE_S)
        code = self._process.exitcode
        if code == -signal.SIGABRT and self._backend == "gloo":
            return GroupAborted(
                "a broadcast carried more bytes than announced (a tensor sent in another "
                "order than named, or in a wider dtype), and gloo ended the group's process"
            )
        if code == -signal.SIGABRT:
            return GroupLost(
                f"{self._backend} ended the group's process: a broadcast did not finish within "
                "the group's timeout (the trainer stalled, or sent other tensors than announced)"
            )
        return GroupLost(f"the group's process ended (exit code {code})")


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let this process start a child even if it is itself a daemon (vLLM's engine core is,
    and its worker holds the group there); multiprocessing refuses a daemon children only so
    that none outlives its parent, and this child ends with its pipe (``_serve``)."""
    config = mp.current_process()._config  # type: ignore[attr-defined]
    daemon = config.pop("daemon", None)
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def _serve(conn: Any, device: torch.device, join: dict[str, Any]) -> None:
    """The child: join, then receive each update call asked for until told to leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a server's Ctrl-C is the server's to handle
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds the group to the current device
    try:
        group = join_group(**join)
    except GroupJoinError as exc:
        conn.send(str(exc))
        return
    conn.send(None)
    buffer = torch.empty(0, dtype=torch.uint8)
    while (request := _next_call(conn)) is not None:
        metas, packed, buffer_size_bytes, allow_nonfinite = request
        size = receive_nbytes(metas, packed=packed, buffer_size_bytes=buffer_size_bytes)
        # One buffer for every call, grown as needed: fresh shared memory per call took 1.0 s
        # against 0.67 s for SmolLM2 (allocation and page faults, here and in the caller).
        # Zeroed: what a short broadcast leaves is told from NaN by it.
        if len(buffer) < size:
            buffer = _zeroed_buffer(size, device)
        else:
            buffer[:size].zero_()
        try:
            receive(
                metas,
                group,
                buffer[:size],
                packed=packed,
                buffer_size_bytes=buffer_size_bytes,
                allow_nonfinite=allow_nonfinite,
            )
        except ReceivedTensorError as exc:
            conn.send(("refused", str(exc)))
            continue
        except Exception as exc:  # the trainer died, or stalled past the group's timeout
            conn.send(("lost", f"the weight broadcast broke off: {exc}"))
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the caller reads it on streams of its own
        conn.send(("received", buffer))
    leave_group(group)  # asked to leave (a hung one is killed by the parent)


def _next_call(conn: Any) -> Any:
    """The parent's next request; None when it asks to leave or is gone (its end closed)."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _zeroed_buffer(size: int, device: torch.device) -> torch.Tensor:
    """A receive buffer the caller can map: CPU shared memory (zero-filled as created), or
    GPU memory, which torch hands over by CUDA IPC."""
    if device.type == "cpu":
        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))
    return torch.zeros(size, dtype=torch.uint8, device=device)
