"""Weights from the trainer's memory, no checkpoint on disk: vLLM's four-phase weight transfer
and SGLang's one-call forms, as protocols that drive the weight lifecycle (``weights``).

``init`` joins the trainer's process group (``--weight-transfer-config``'s backend; the trainer
is rank 0, this server ``rank_offset``); ``start`` opens an update; each ``update`` checks its
tensors against the model, then receives them (one broadcast each, or vLLM's packed chunks);
``finish`` publishes the version once every weight came; ``shutdown`` leaves the group. A body
the server will not take is refused before a byte is received; since the trainer broadcasts
it anyway, the group cannot carry on in step and is closed. With ``lora_name`` an update
carries one LoRA adapter's factors instead, loaded through the adapter registry at the end;
so does every update of the next round after ``arm_lora_target`` (SkyRL's receive target, which
names the adapter out of band, and the factors that share a sent one). SGLang's one-call
update receives and loads at once; AReaL's vLLM server splits it in two, the tensors announced
(``announce``) and then received (``receive_announced``), and so for a LoRA adapter's factors
(``announce_adapter``, ``receive_announced_adapter``: the adapter registry replaces the adapter
vLLM numbers ``lora_int_id`` and serves it under the new name).

The group is this object's; it changes only under the weight lifecycle's lock.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from tokenwire.engine.base import (
    Engine,
    EngineError,
    WeightGroup,
    WeightsError,
    WeightTransferError,
    WeightUpdate,
)
from tokenwire.pipeline.control.adapters import AdapterRegistry
from tokenwire.pipeline.control.trainer_address import TrainerAddressPolicy
from tokenwire.pipeline.control.weights import WeightLifecycle
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.protocol.control import (
    InitWeightsUpdateGroupBody,
    TransferInitInfo,
    TransferUpdateInfo,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
)
from tokenwire.protocol.frameworks import ArealLoraWeightMetaBody
from tokenwire.weight_transfer import (
    TensorMeta,
    WeightTransferConfig,
    dtype_named,
)


@dataclass(frozen=True, slots=True)
class TransferGroup:
    """The open weight-transfer group, as ``init_info`` set it up."""

    group_name: str | None  # None: the trainer's default group (``weight_transfer``)
    packed: bool
    buffer_size_bytes: int


@dataclass(slots=True)
class StagedAdapter:
    """A LoRA adapter's factors received so far in an update (``update_info.lora_name``)."""

    name: str
    config: dict[str, Any]
    tensors: dict[str, Any] = field(default_factory=dict)
    # Factors not sent that share a sent one's values: {name: sent name} (SkyRL's aliases).
    aliases: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AnnouncedUpdate:
    """Tensors named for the next ``receive_announced`` (AReaL's weight meta)."""

    tensors: tuple[TensorMeta, ...]
    group_name: str


@dataclass(frozen=True, slots=True)
class AnnouncedAdapter:
    """A LoRA adapter's factors named for the next ``receive_announced_adapter`` (AReaL's
    LoRA weight meta): which adapter they replace (vLLM's ``lora_int_id``) and its config."""

    tensors: tuple[TensorMeta, ...]
    group_name: str
    int_id: int
    config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LoraTarget:
    """The adapter the next update round carries when its ``update_info`` names none."""

    name: str
    config: dict[str, Any]
    aliases: dict[str, str]


class WeightTransfer:
    """The trainer's group and the transfer protocols over it (see the module docstring)."""

    def __init__(
        self,
        config: WeightTransferConfig | None,
        addresses: TrainerAddressPolicy,
        engine: Callable[[], Engine],
        weights: WeightLifecycle,
        adapters: AdapterRegistry,
        abort_all: Callable[[], Awaitable[int]],
    ) -> None:
        self.config = config  # None: vLLM's weight-transfer routes are refused
        self._addresses = addresses
        self._engine = engine
        self._weights = weights
        self._adapters = adapters
        self._abort_all = abort_all
        self._group: TransferGroup | None = None
        self._previous: tuple[TensorMeta, ...] = ()  # what empty update_info lists repeat
        # Armed for the next round; disarmed at finish, or when the group closes.
        self._target: LoraTarget | None = None
        # Announced, not yet received; dropped with the group. AReaL's worker keeps base
        # weights' and an adapter's announcements apart, so here too.
        self._announced: AnnouncedUpdate | None = None
        self._announced_adapter: AnnouncedAdapter | None = None

    @property
    def timeout_s(self) -> float:
        """How long joining, and each broadcast, may wait for the trainer."""
        return (self.config or WeightTransferConfig()).timeout_s

    def config_json(self) -> dict[str, Any] | None:
        """``/server_info``'s ``weight_transfer_config``."""
        return None if self.config is None else self.config.as_json()

    # -- joining and leaving ------------------------------------------------------------------

    async def init(self, info: TransferInitInfo) -> None:
        """vLLM's ``/init_weight_transfer_engine``."""
        config = self._require_config()
        if info.nccl_unique_id_b64 is not None:
            raise InvalidRequest(
                "init_info.nccl_unique_id_b64: an NCCL unique id is not taken here; send "
                "master_address and master_port",
                "init_info.nccl_unique_id_b64",
            )
        if info.master_address is None or info.master_port is None:
            raise InvalidRequest(
                "init_info: need both master_address and master_port", "init_info.master_address"
            )
        await self._join(
            WeightGroup(
                master_address=info.master_address,
                master_port=info.master_port,
                rank=info.rank_offset,
                world_size=info.world_size,
                backend=config.backend,
                group_name=info.group_name,
                timeout_s=config.timeout_s,
            ),
            TransferGroup(info.group_name, info.packed, info.packed_buffer_size_bytes),
            "init_info",
        )

    async def init_group(self, body: InitWeightsUpdateGroupBody, *, replace: bool = True) -> None:
        """SGLang's ``/init_weights_update_group``: the backend comes with the body. Without
        ``replace`` an open group is kept and nothing is dialled (skyrl-train's
        ``override_existing_receiver: false``)."""
        await self._join(
            WeightGroup(
                master_address=body.master_address,
                master_port=body.master_port,
                rank=body.rank_offset,
                world_size=body.world_size,
                backend=body.backend,
                group_name=body.group_name,
                timeout_s=self.timeout_s,
            ),
            TransferGroup(body.group_name, packed=False, buffer_size_bytes=0),
            "backend",
            replace=replace,
        )

    async def _join(
        self, spec: WeightGroup, group: TransferGroup, param: str, *, replace: bool = True
    ) -> None:
        engine = self._engine()
        backends = engine.weight_transfer_backends()
        if spec.backend not in backends:
            working = ", ".join(backends) or "none (load checkpoints with /update_weights)"
            raise InvalidRequest(
                f"backend {spec.backend!r} cannot move this server's weights; backends that "
                f"work here: {working}",
                param,
            )
        # Checked before anything is dialled; the checked address is the one dialled.
        address = await asyncio.to_thread(
            self._addresses.resolve, spec.master_address, spec.master_port
        )
        spec = dataclasses.replace(spec, master_address=address)
        async with self._weights.locked():
            if self._weights.update is not None:
                raise InvalidRequest(
                    "a weight update is open over the current group; finish it first", param
                )
            if not replace and self._group is not None:
                return
            # As vLLM: a new init replaces the group (its trainer restarted, say).
            await self._leave()
            try:
                await engine.join_weight_group(spec)
            except (EngineError, WeightTransferError) as exc:
                raise InvalidRequest(f"weight transfer not initialised: {exc}", param) from exc
            self._group = group

    async def shutdown(self, group_name: str | None = None) -> None:
        """vLLM's ``/shutdown_weight_transfer_engine`` (refused during an update, as vLLM does)
        and SGLang's ``/destroy_weights_update_group``."""
        async with self._weights.locked():
            if self._weights.update is not None:
                raise InvalidRequest("Cannot release a trainer connection during a weight update")
            if group_name is not None and not self._is_open(group_name):
                raise InvalidRequest(f"no weight-transfer group named {group_name!r}", "group_name")
            await self._leave()  # nothing to leave is fine (vLLM's shutdown is a no-op then)

    def _is_open(self, group_name: str | None) -> bool:
        """Whether ``group_name`` names the open group (None: any open group does)."""
        group = self._group
        return group is not None and group_name in (None, group.group_name)

    async def _leave(self) -> None:
        """Close the group (the caller holds the lock); an armed round and announced tensors
        end with it."""
        self._target = None
        self._announced = None
        self._announced_adapter = None
        if self._group is not None:
            self._group = None
            await self._engine().leave_weight_group()

    # -- vLLM's phases ------------------------------------------------------------------------

    async def start(self) -> None:
        """vLLM's ``/start_weight_update``: open an update (generation paused meanwhile)."""
        self._engine()
        self._require_config()
        async with self._weights.locked():
            await self._weights.begin(on_abandon=self._leave)

    async def update(self, update_info: TransferUpdateInfo | list[TransferUpdateInfo]) -> None:
        """vLLM's ``/update_weights {update_info}``: receive while the trainer broadcasts (into
        the model, or, with ``lora_name``, into the adapter that finish loads)."""
        self._engine()
        if isinstance(update_info, list):
            if not update_info:
                raise InvalidRequest("update_info: an empty list names no receiving rank")
            update_info = update_info[0]  # vLLM's list is indexed by receiving rank: this is 0
        metas = _metas(update_info.names, update_info.dtype_names, update_info.shapes)
        async with self._weights.locked():
            group = self._group
            if group is None:
                raise InvalidRequest(
                    "update_info: the weight-transfer engine is not initialised: POST "
                    "/init_weight_transfer_engine first (or, to load a checkpoint directory, "
                    'send prime-rl\'s {"weight_dir": ..., "weight_version": ...})',
                    "update_info",
                )
            current = self._weights.open_update()
            if not metas:
                if not self._previous:
                    raise InvalidRequest(
                        "update_info: empty lists repeat the previous update, and there is none",
                        "update_info",
                    )
                metas = self._previous
            packed = group.packed if update_info.packed is None else update_info.packed
            size = update_info.packed_buffer_size_bytes or group.buffer_size_bytes
            update = WeightUpdate(metas, packed, size)
            target = self._target
            if update_info.lora_name is None and target is not None:
                await self._stage_factors(update, target.name, target.config, target.aliases)
            elif update_info.lora_name is None and current.staged is None:
                await self._receive_into_model(update, "update_info")
            else:
                await self._stage_factors(update, update_info.lora_name, update_info.lora_config)
            self._previous = metas

    async def arm_lora_target(
        self, name: str, config: dict[str, Any], aliases: dict[str, str]
    ) -> None:
        """SkyRL's ``skyrl_set_lora_receive_target``: the next round's updates carry adapter
        ``name``'s factors (its ``update_info`` has only names, dtypes and shapes); finish
        loads the adapter and disarms. Arming again replaces the target."""
        self._adapters.check_name(name)
        async with self._weights.locked():
            if self._weights.update is not None:
                raise InvalidRequest(
                    "receive_target: arm it before the round (a weight update is open; finish "
                    "it first)",
                    "kwargs.receive_target",
                )
            self._target = LoraTarget(name, config, aliases)

    async def finish(self, version: str | None) -> None:
        """vLLM's ``/finish_weight_update {weight_version?}``: every weight must have come."""
        async with self._weights.locked():
            if self._weights.update is None:
                raise InvalidRequest(
                    "finish_weight_update called without a matching start_weight_update."
                )
            staged = self._weights.update.staged
            self._target = None  # one round only, as SkyRL's receive engine disarms
            if staged is None:
                await self._weights.finish(version)
                return
            try:
                await self._load_adapter(staged, version, "update_info.lora_name")
            finally:
                await self._weights.end()

    async def _receive_into_model(self, update: WeightUpdate, param: str) -> None:
        """Check, then receive into the model (lock held, an update open). ``WeightsError``
        from the receipt: nothing of it reached the model (the hf engine receives a call whole,
        checked, before copying any of it), so it ends as a refusal does."""
        try:
            self._engine().check_weight_update(update.tensors)
            await self._weights.receive(update, param)
        except WeightsError as exc:
            await self._refuse(exc, param)
        except InvalidRequest:  # the broadcast broke off: the engine left the group
            self._group = None
            raise

    async def _stage_factors(
        self,
        update: WeightUpdate,
        name: str | None,
        config: dict[str, Any] | None,
        aliases: dict[str, str] | None = None,
    ) -> None:
        """Receive a LoRA adapter's factors into the open update (the model is untouched: a
        broadcast that breaks off leaves every adapter as it was)."""
        current = self._weights.open_update()
        staged = current.staged
        param = "update_info.lora_name"
        try:
            if name is None or current.received or (staged is not None and staged.name != name):
                raise WeightsError(
                    "one update carries the model's weights or one LoRA adapter's factors (the "
                    "same lora_name in every update_info), not both"
                )
            if staged is None:
                config = self._adapters.config_for(name, config, param)
                staged = StagedAdapter(name, config, aliases=dict(aliases or {}))
        except (WeightsError, InvalidRequest) as exc:
            await self._refuse(exc, param)
        current.staged = staged
        staged.tensors.update(await self._receive_factors(update, staged, param))
        self._weights.extend_deadline()

    async def _receive_factors(
        self, update: WeightUpdate, staged: StagedAdapter, param: str
    ) -> dict[str, Any]:
        """Check, then receive an adapter's factors into new tensors (lock held). A refusal or
        a broadcast that breaks off closes the group and ends an open update."""
        try:
            self._engine().check_adapter_update(staged.config, update.tensors)
            return await self._engine().receive_tensors(update)
        except WeightsError as exc:  # refused before or while receiving
            await self._refuse(exc, param)
        except WeightTransferError as exc:
            self._group = None  # the engine left it
            if self._weights.update is not None:
                await self._weights.abandon(f"an update broke off: {exc}")
            raise InvalidRequest(f"LoRA adapter {staged.name!r} not updated: {exc}", param) from exc

    async def _load_adapter(self, staged: StagedAdapter, version: str | None, param: str) -> None:
        tensors = dict(staged.tensors)
        for name, sent in staged.aliases.items():
            if sent not in staged.tensors:
                raise InvalidRequest(
                    f"LoRA adapter {staged.name!r} not loaded: alias {name!r} names {sent!r}, "
                    "which was not sent",
                    param,
                )
            tensors[name] = staged.tensors[sent]  # shares the sent tensor, as SkyRL's receiver
        await self._adapters.load_tensors(
            staged.name, tensors, config=staged.config, version=version, param=param
        )

    async def _refuse(self, exc: Exception, param: str) -> NoReturn:
        """The trainer is broadcasting (or broadcast) what this server will not take: the group
        cannot carry on in step, so it is closed, and an open update ends (whole, unless
        earlier tensors of it are in already)."""
        if self._weights.update is not None:
            await self._weights.abandon("an update was refused after some of its tensors came")
        await self._leave()
        message = exc.message if isinstance(exc, InvalidRequest) else str(exc)
        raise InvalidRequest(
            f"weights not updated (none of these tensors loaded; the group is closed, init "
            f"again): {message}",
            param,
        ) from exc

    # -- SGLang's one-call forms --------------------------------------------------------------

    async def update_from_distributed(self, body: UpdateWeightsFromDistributedBody) -> None:
        """SGLang's ``/update_weights_from_distributed``: receive and load at once (SGLang loads
        the tensors it names; others keep their values), generation paused meanwhile; with
        ``lora_name``, an adapter's factors, loaded in place while generation goes on."""
        if body.names is not None:
            metas = _named_metas(body.names, body.dtypes, body.shapes)
        elif body.name is not None and body.dtype is not None and body.shape is not None:
            metas = _metas([body.name], [body.dtype], [body.shape])
        else:
            raise InvalidRequest(
                "send names, dtypes and shapes (or one name, dtype and shape)", "names"
            )
        if body.abort_all_requests:
            await self._abort_all()
        async with self._weights.locked():
            self._require_group(body.group_name)
            if body.lora_name is not None:
                # No pause: the factors come into new tensors, and the adapter loads between
                # steps.
                param = "lora_name"
                self._adapters.check_name(body.lora_name)
                config = self._adapters.config_for(body.lora_name, body.lora_config, param)
                staged = StagedAdapter(body.lora_name, config)
                staged.tensors.update(
                    await self._receive_factors(WeightUpdate(metas), staged, param)
                )
                await self._load_adapter(staged, body.weight_version, param)
                return
            await self._receive_at_once(metas, body.weight_version)

    async def announce(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> None:
        """AReaL's ``/areal_set_update_weight_meta``: name the tensors the next
        ``receive_announced`` takes, in broadcast order (a second announcement replaces the
        first, as AReaL's worker keeps the last). Checked against the model now: a misfit is
        refused before the trainer's broadcast, and closes the group, since that broadcast
        comes anyway."""
        metas = _named_metas(names, dtypes, shapes)
        async with self._weights.locked():
            self._require_group(group_name)
            try:
                self._engine().check_weight_update(metas)
            except WeightsError as exc:
                await self._refuse(exc, "names")
            self._announced = AnnouncedUpdate(metas, group_name)

    async def receive_announced(self) -> None:
        """AReaL's ``/areal_update_weights_xccl`` (body ``{}``): requests in flight end, as
        AReaL's server pauses without waiting for them, then the announced tensors are received
        and loaded at once, as ``update_from_distributed``. Each announcement is received
        once."""
        if self._announced is None:
            raise InvalidRequest(
                "no tensors announced: POST /areal_set_update_weight_meta {names, dtypes, "
                "shapes, group_name} first",
                "names",
            )
        await self._abort_all()
        async with self._weights.locked():
            announced, self._announced = self._announced, None
            if announced is None:  # the group closed meanwhile
                raise InvalidRequest(
                    "the announced tensors were dropped with their group: init it and announce "
                    "them again",
                    "group_name",
                )
            self._require_group(announced.group_name)
            await self._receive_at_once(announced.tensors, None)

    async def announce_adapter(self, body: ArealLoraWeightMetaBody) -> None:
        """AReaL's ``/areal_set_update_weight_meta_lora``: name the LoRA factors the next
        ``receive_announced_adapter`` takes, for the adapter vLLM numbers ``lora_int_id``
        (loaded already: AReaL starts its server with the first version as a LoRA module), with
        AReaL's config fields. Checked now (the adapter exists, ``lora_name`` may name it, each
        factor fits the model under that config); a misfit is refused and closes the group, as
        ``announce``."""
        metas = _named_metas(body.names, body.dtypes, body.shapes)
        config = body.lora_config()
        async with self._weights.locked():
            self._require_group(body.group_name)
            try:
                self._adapters.check_replacement(body.lora_int_id, body.lora_name)
                self._engine().check_adapter_update(config, metas)
            except (WeightsError, InvalidRequest) as exc:
                await self._refuse(exc, _param_of(exc, "names"))
            self._announced_adapter = AnnouncedAdapter(
                metas, body.group_name, body.lora_int_id, config
            )

    async def receive_announced_adapter(self, lora_name: str) -> None:
        """AReaL's ``/areal_update_weights_lora_xccl``: requests in flight end (AReaL's server
        pauses without waiting for them), the announced factors come into new tensors (the
        adapter serves on meanwhile: a broadcast that breaks off leaves it as it was), then the
        registry replaces the announced adapter with them, served as ``lora_name`` (this
        call's, as AReaL's server registers it). Factor names lose PEFT's adapter name
        (``.default``), as AReaL's worker strips it. Each announcement is received once."""
        if self._announced_adapter is None:
            raise InvalidRequest(
                "no LoRA factors announced: POST /areal_set_update_weight_meta_lora {names, "
                "dtypes, shapes, group_name, lora_name, lora_int_id, ...} first",
                "names",
            )
        await self._abort_all()
        async with self._weights.locked():
            announced, self._announced_adapter = self._announced_adapter, None
            if announced is None:  # the group closed meanwhile
                raise InvalidRequest(
                    "the announced LoRA factors were dropped with their group: init it and "
                    "announce them again",
                    "group_name",
                )
            self._require_group(announced.group_name)
            staged = StagedAdapter(lora_name, announced.config)
            received = await self._receive_factors(WeightUpdate(announced.tensors), staged, "names")
            tensors = {name.replace("default.", ""): t for name, t in received.items()}
            await self._adapters.replace_by_id(
                announced.int_id, lora_name, tensors, config=announced.config
            )

    def _require_group(self, group_name: str | None) -> None:
        """A 400 unless ``group_name`` names the open group (None: any), and no vLLM-style
        update is open (the lock held)."""
        if not self._is_open(group_name):
            named = "" if group_name is None else f" named {group_name!r}"
            raise InvalidRequest(
                f"no weight-transfer group{named} is open: POST /init_weights_update_group "
                "first (skyrl-train's vLLM form: /init_weight_update_communicator; AReaL's: "
                "/areal_init_weights_update_group)",
                "group_name",
            )
        if self._weights.update is not None:
            raise InvalidRequest("a vLLM-style weight update is open; finish it first")

    async def _receive_at_once(self, metas: tuple[TensorMeta, ...], version: str | None) -> None:
        """One update of its own (generation paused meanwhile): receive ``metas`` into the
        model through the engine's one receive path, then end it as sent (lock held)."""
        await self._weights.begin(on_abandon=self._leave)
        await self._receive_into_model(WeightUpdate(metas), "names")
        await self._weights.end(version)

    async def update_from_tensor(self, body: UpdateWeightsFromTensorBody) -> None:
        """SGLang's ``/update_weights_from_tensor`` with safetensors entries (never pickles);
        with ``lora_name``, an adapter's factors (loaded in place, or new with
        ``lora_config``)."""
        tensors = decode_tensors(body.load_format, body.serialized_named_tensors[0])
        self._engine()
        if body.abort_all_requests:
            await self._abort_all()
        if body.lora_name is not None:
            await self._adapters.load_tensors(
                body.lora_name, tensors, config=body.lora_config, version=body.weight_version
            )
            return
        async with self._weights.locked():
            if self._weights.update is not None:
                raise InvalidRequest("a vLLM-style weight update is open; finish it first")
            await self._weights.begin()
            try:
                await self._weights.copy(tensors, "serialized_named_tensors")
            except InvalidRequest:
                await self._weights.end()
                raise
            await self._weights.end(body.weight_version)

    def _require_config(self) -> WeightTransferConfig:
        if self.config is None:
            raise InvalidRequest(
                "Weight transfer not configured: start the server with --weight-transfer-config "
                '\'{"backend": "gloo"}\' (vLLM\'s flag)',
                "init_info",
            )
        return self.config


def _param_of(exc: Exception, default: str) -> str:
    """The field an error names, else ``default``."""
    return getattr(exc, "param", None) or default


def _named_metas(
    names: list[str], dtypes: list[str] | None, shapes: list[list[int]] | None
) -> tuple[TensorMeta, ...]:
    """SGLang's (and AReaL's, skyrl-train's) parallel lists: equal lengths, at least one."""
    if dtypes is None or shapes is None:
        raise InvalidRequest("names needs dtypes and shapes of the same length", "names")
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidRequest("names, dtypes and shapes must have the same length", "names")
    if not names:
        raise InvalidRequest("names: no tensors to update", "names")
    return _metas(names, dtypes, shapes)


def _metas(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> tuple[TensorMeta, ...]:
    metas = []
    for i, (name, dtype_text, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        dtype = dtype_named(dtype_text)
        if dtype is None:
            raise InvalidRequest(f"dtype {dtype_text!r} (tensor {i}, {name}) is not a torch dtype")
        metas.append(TensorMeta(name, dtype, tuple(shape)))
    return tuple(metas)


def decode_tensors(load_format: str | None, entry: str) -> dict[str, Any]:
    """One of SGLang's ``serialized_named_tensors`` entries: the base64 of a safetensors file
    (SGLang's own entries are pickles, which this server never loads: they can run code)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if load_format != "safetensors":
        raise InvalidRequest(
            f"load_format {load_format!r}: SGLang's serialized tensors are pickles, which "
            'this server never loads (they can run code); send load_format "safetensors" with '
            "each entry the base64 of a safetensors file",
            "load_format",
        )
    try:
        raw = base64.b64decode(entry, validate=True)
        return load(raw)
    except (binascii.Error, ValueError, SafetensorError) as exc:
        raise InvalidRequest(
            f"serialized_named_tensors[0] is not base64 of a safetensors file: {exc}",
            "serialized_named_tensors",
        ) from exc
