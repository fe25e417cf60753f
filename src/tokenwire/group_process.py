"""A receiver's weight-transfer group (``tokenwire.weight_transfer``) held in a child process.

gloo cannot refuse a broadcast longer than its buffer: it calls ``std::terminate`` in the
receiving process (a trainer that sends tensors in another order than it named them, or in a
wider dtype). Held here, the group lives in a child started with ``spawn`` (a fork of a server
with threads and an engine could deadlock), so that abort ends the child alone: the server and
its requests go on, and the caller learns that the group is gone. Each update call is received
into one buffer in shared memory (the same for every call: it grows to the largest call and
lives as long as the group), checked (``weight_transfer.receive``) and handed over to the
caller whole; nothing of a failed call reaches the caller.

Shared memory holds CPU tensors: ``GroupProcess`` serves gloo. ``LocalGroup`` is the same
interface in this process, for nccl (CUDA tensors), which it does not protect.
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
    """Join (``join_group``'s keywords): gloo in a child process, other backends here."""
    if join["backend"] == "gloo":
        return GroupProcess(**join)
    return LocalGroup(device, **join)


class GroupProcess:
    """The group in a child process (see the module docstring). Calls come one at a time."""

    def __init__(self, **join: Any) -> None:
        """Start the child and join; ``GroupJoinError`` (its message, sanitized by
        ``join_group``) when the group did not form."""
        self._buffer: torch.Tensor | None = None  # the child's buffer, mapped here
        context = mp.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_end, join), name="tokenwire-weight-group", daemon=True
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
        if code == -signal.SIGABRT:
            return GroupAborted(
                "a broadcast carried more bytes than announced (a tensor sent in another "
                "order than named, or in a wider dtype), and gloo ended the group's process"
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


def _serve(conn: Any, join: dict[str, Any]) -> None:
    """The child: join, then receive each update call asked for until told to leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a server's Ctrl-C is the server's to handle
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
            buffer = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))
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
        conn.send(("received", buffer))


def _next_call(conn: Any) -> Any:
    """The parent's next request; None when it asks to leave or is gone (its end closed)."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


class LocalGroup:
    """The group in this process (nccl: CUDA tensors do not go through shared memory); a
    broadcast longer than announced is not caught here."""

    def __init__(self, device: torch.device, **join: Any) -> None:
        self._device = device
        self._group = join_group(**join)

    def receive(
        self,
        metas: Sequence[TensorMeta],
        *,
        packed: bool,
        buffer_size_bytes: int,
        allow_nonfinite: bool,
    ) -> dict[str, torch.Tensor]:
        size = receive_nbytes(metas, packed=packed, buffer_size_bytes=buffer_size_bytes)
        buffer = torch.zeros(size, dtype=torch.uint8, device=self._device)
        try:
            return receive(
                metas,
                self._group,
                buffer,
                packed=packed,
                buffer_size_bytes=buffer_size_bytes,
                allow_nonfinite=allow_nonfinite,
            )
        except ReceivedTensorError:
            raise
        except Exception as exc:
            raise GroupLost(f"the weight broadcast broke off: {exc}") from exc

    def close(self) -> None:
        leave_group(self._group)
