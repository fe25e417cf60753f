"""Media of a request -> processed items, expanded prompt ids and the engine's ``MultiModalInput``.

One ``MediaService`` is built at start-up and shared by every entry point (chat messages of
render, /tokenize and chat completions; ``content_parts`` and ``features`` of generate), so they
all fetch through the same guarded connector and share one cache. Where each check happens:

- the connector (``media.connector``): every SSRF and size rule, before and while fetching;
- the loaders and processor (``media.loaders``, ``media.processing``): bombs, bad images,
  client-sent tensors in ``features.kwargs_data``;
- here: which modalities this model takes, uuid/mm_hash cache look-ups, and that the prompt's
  image placeholders agree with the images (expanded here, validated for ``features``).

Fetching is async and concurrent across a request's parts; decoding and processing run in the
default thread pool, so the event loop never waits on PIL or the processor.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import orjson

from tokenwire.api.errors import APIError, bad_request
from tokenwire.api.metrics import Metrics
from tokenwire.engine.base import ImageInput, MultiModalInput
from tokenwire.media.connector import MediaConnector
from tokenwire.media.errors import MediaError
from tokenwire.media.policy import MediaPolicy
from tokenwire.protocol.chat import (
    AudioURLPart,
    ChatMessage,
    FlatMediaPart,
    ImageURLPart,
    VideoURLPart,
)
from tokenwire.protocol.generate import ContentPart, MultiModalFeatures
from tokenwire.settings import Settings

if TYPE_CHECKING:
    from tokenwire.media.cache import MediaCache
    from tokenwire.media.processing import MediaProcessor, ProcessedMedia

Modality = Literal["image", "audio", "video"]

NO_MULTIMODAL = "this model takes no multimodal input"
IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One media part of a request, wherever it came from; ``where`` names it in errors."""

    modality: Modality
    url: str | None
    uuid: str | None
    where: str


@dataclass(frozen=True, slots=True)
class PromptMedia:
    """A prompt whose image placeholders are expanded, with the items that fill them."""

    token_ids: list[int]
    items: tuple[ProcessedMedia, ...]
    placeholders: tuple[tuple[int, int], ...]

    def engine_input(self) -> MultiModalInput:
        return MultiModalInput(
            images=tuple(
                ImageInput(item.pixel_values, item.image_grid_thw, offset, length)
                for item, (offset, length) in zip(self.items, self.placeholders, strict=True)
            )
        )


class EncodedKwargsCache:
    """Render's ``kwargs_data`` of recently rendered items, kept as ready JSON fragments.

    Serialising an image's tensors (safetensors, base64, then orjson scanning the string) costs
    about 25 ms for a 448x448 image, more than the rest of a cached render, and RL loops render
    the same image every turn. Bounded by the bytes of the fragments; ``max_bytes=0`` disables.
    Used from worker threads, hence the lock.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._fragments: OrderedDict[str, tuple[orjson.Fragment, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, item: ProcessedMedia) -> orjson.Fragment:
        with self._lock:
            found = self._fragments.get(item.content_hash)
            if found is not None:
                self._fragments.move_to_end(item.content_hash)
                return found[0]
        from tokenwire.media.processing import MediaProcessor

        data = b'"' + MediaProcessor.encode_kwargs_data(item).encode("ascii") + b'"'
        fragment = orjson.Fragment(data)
        if len(data) <= self.max_bytes:
            with self._lock:
                if item.content_hash not in self._fragments:
                    self._fragments[item.content_hash] = (fragment, len(data))
                    self._bytes += len(data)
                while self._bytes > self.max_bytes:
                    _, (_, size) = self._fragments.popitem(last=False)
                    self._bytes -= size
        return fragment


class MediaService:
    """The connector, processor and cache of one served model, built once at start-up.

    ``processor`` is None for text-only models; then every request with media is a 400 before
    anything is fetched (and no connector is built).
    """

    def __init__(
        self,
        *,
        connector: MediaConnector | None,
        processor: MediaProcessor | None,
        cache: MediaCache | None,
        image_pad_id: int | None,
        metrics: Metrics,
    ) -> None:
        self.connector = connector
        self.processor = processor
        self.cache = cache
        self.image_pad_id = image_pad_id
        # A quarter of the media cache's budget again, for render's serialised tensors.
        self.encoded = EncodedKwargsCache(cache.max_bytes // 4 if cache is not None else 0)
        # Only images reach the cache; children cached (labels() locks and hashes per call).
        self._hits = metrics.media_cache_hits.labels("image")
        self._misses = metrics.media_cache_misses.labels("image")

    @classmethod
    async def build(
        cls, settings: Settings, model_dir: Path, image_pad_id: int | None, metrics: Metrics
    ) -> MediaService:
        """The processor loads in a thread (transformers import); the connector on the loop,
        which its async HTTP client belongs to. Text-only models get neither."""
        from tokenwire.media.processing import MediaProcessor

        processor = await asyncio.to_thread(MediaProcessor.from_model_dir, model_dir)
        if processor is None:
            return cls(
                connector=None, processor=None, cache=None, image_pad_id=None, metrics=metrics
            )
        from tokenwire.media.cache import MediaCache

        pad = processor.image_token_id if processor.image_token_id is not None else image_pad_id
        if pad is None:
            raise ValueError(f"{model_dir}: the model has an image processor but no {IMAGE_PAD}")
        allowed = settings.allowed_media_domains
        policy = MediaPolicy(
            allowed_domains=frozenset(allowed) if allowed is not None else None,
            allow_private_networks=settings.allow_private_media_networks,
            allow_redirects=settings.media_allow_redirects,
            max_bytes=settings.max_media_bytes,
            timeout_s=settings.media_timeout_s,
            allowed_local_path=settings.allowed_local_media_path,
        )
        return cls(
            connector=MediaConnector(policy),
            processor=processor,
            cache=MediaCache(settings.media_cache_bytes),
            image_pad_id=int(pad),
            metrics=metrics,
        )

    async def aclose(self) -> None:
        if self.connector is not None:
            await self.connector.aclose()

    # -- entry points -------------------------------------------------------------------------

    async def resolve(self, refs: Sequence[MediaRef]) -> list[ProcessedMedia]:
        """Every ref as a processed item, in order; fetched concurrently, cached by content."""
        for ref in refs:
            self._check_modality(ref)
        if len(refs) == 1:
            return [await self._resolve_one(refs[0])]
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._resolve_one(ref)) for ref in refs]
        except BaseExceptionGroup as errors:
            raise _first_client_error(errors) from None
        return [task.result() for task in tasks]

    async def prompt_from_content_parts(
        self, token_ids: list[int], parts: Sequence[ContentPart]
    ) -> PromptMedia:
        """Generate's raw media: fetched and processed here, then the pads expanded."""
        refs = [
            MediaRef(_modality(part.type), part.url, part.uuid, f"content_parts[{index}]")
            for index, part in enumerate(parts)
        ]
        if not refs:
            return PromptMedia(list(token_ids), (), ())
        return self.expand(token_ids, await self.resolve(refs), already_expanded_ok=True)

    async def prompt_from_features(
        self, token_ids: list[int], features: MultiModalFeatures
    ) -> PromptMedia:
        """Render's features sent back: items from ``kwargs_data`` or the cache, ranges checked."""
        hashes, ranges, kwargs = features.mm_hashes, features.mm_placeholders, features.kwargs_data
        for modality in set(hashes) | set(ranges) | set(kwargs or {}):
            if hashes.get(modality) or ranges.get(modality) or (kwargs or {}).get(modality):
                self._require_images("features")
                if modality != "image":
                    raise bad_request(f"this model takes no {modality} input", "features")
        image_hashes, image_ranges = hashes.get("image", []), ranges.get("image", [])
        image_kwargs = (kwargs or {}).get("image")
        if len(image_hashes) != len(image_ranges):
            raise bad_request(
                f"features: {len(image_hashes)} image mm_hashes but {len(image_ranges)} "
                "mm_placeholders",
                "features",
            )
        if image_kwargs is not None and len(image_kwargs) != len(image_hashes):
            raise bad_request(
                f"features: {len(image_hashes)} image mm_hashes but {len(image_kwargs)} "
                "kwargs_data entries",
                "features",
            )
        if not image_hashes:
            return PromptMedia(list(token_ids), (), ())
        processor, cache, pad = self._require_images("features")
        items: list[ProcessedMedia] = []
        for index, mm_hash in enumerate(image_hashes):
            data = image_kwargs[index] if image_kwargs is not None else None
            if data is not None:
                item = await asyncio.to_thread(processor.decode_kwargs_data, data, index=index)
            else:
                cached = cache.get(mm_hash)
                self._count(cached is not None)
                if cached is None:
                    raise bad_request(
                        f"features.mm_hashes.image[{index}]: no cached image for mm_hash "
                        f"{mm_hash!r}; send its kwargs_data",
                        "features",
                    )
                item = cached
            items.append(item)
        placeholders = tuple((r.offset, r.length) for r in image_ranges)
        from tokenwire.media.processing import validate_placeholder_ranges

        validate_placeholder_ranges(
            token_ids, placeholders, [item.num_placeholder_tokens for item in items], pad
        )
        return PromptMedia(list(token_ids), tuple(items), placeholders)

    def expand(
        self,
        token_ids: list[int],
        items: Sequence[ProcessedMedia],
        *,
        already_expanded_ok: bool = False,
    ) -> PromptMedia:
        """One ``<|image_pad|>`` per image becomes the image's token count.

        With ``already_expanded_ok`` (generate's content_parts), ids whose pad runs already have
        exactly each image's length are taken as they are, so render's ids work there too.
        """
        from tokenwire.media.processing import expand_image_placeholders

        _, _, pad = self._require_images()
        counts = [item.num_placeholder_tokens for item in items]
        if already_expanded_ok:
            runs = _pad_runs(token_ids, pad)
            if len(runs) == len(counts) and all(
                length == count for (_, length), count in zip(runs, counts, strict=True)
            ):
                return PromptMedia(list(token_ids), tuple(items), tuple(runs))
        ids, placeholders = expand_image_placeholders(token_ids, pad, counts)
        return PromptMedia(ids, tuple(items), tuple(placeholders))

    def features_json(self, prompt: PromptMedia) -> dict[str, Any]:
        """Render's ``features``: what generate needs to run the prompt without re-fetching.

        CPU work of milliseconds per image when not cached: call it from a worker thread.
        """
        return {
            "mm_hashes": {"image": [item.content_hash for item in prompt.items]},
            "mm_placeholders": {
                "image": [{"offset": o, "length": n} for o, n in prompt.placeholders]
            },
            "kwargs_data": {"image": [self.encoded.get(item) for item in prompt.items]},
        }

    # -- one item -----------------------------------------------------------------------------

    def _require_images(self, param: str | None = None) -> tuple[MediaProcessor, MediaCache, int]:
        if self.processor is None or self.cache is None or self.image_pad_id is None:
            raise bad_request(NO_MULTIMODAL, param)
        return self.processor, self.cache, self.image_pad_id

    def _check_modality(self, ref: MediaRef) -> None:
        self._require_images(ref.where.partition("[")[0])
        if ref.modality != "image":
            raise bad_request(f"{ref.where}: this model takes no {ref.modality} input")

    async def _resolve_one(self, ref: MediaRef) -> ProcessedMedia:
        processor, cache, _ = self._require_images()
        if ref.uuid is not None:
            # A uuid names the item (vLLM's contract: unique per content), so a cached one is
            # reused even when a url comes along: rollouts on one image skip the fetch.
            cached = cache.get_by_uuid(ref.uuid)
            if cached is not None:
                self._count(True)
                return cached
            if ref.url is None:
                self._count(False)
                raise bad_request(
                    f"{ref.where}: no cached {ref.modality} for uuid {ref.uuid!r}", ref.where
                )
        if ref.url is None:  # the protocol models never let this through
            raise bad_request(f"{ref.where}: needs a url or a uuid", ref.where)
        assert self.connector is not None  # built with the processor
        try:
            data = await self.connector.fetch(ref.url)
            item = await asyncio.to_thread(self._process, processor, cache, data)
        except MediaError as exc:
            raise APIError(exc.status, f"{exc.message} ({ref.where})", ref.where) from None
        if ref.uuid is not None:
            cache.put(item, uuid=ref.uuid)
        return item

    def _process(self, processor: MediaProcessor, cache: MediaCache, data: bytes) -> ProcessedMedia:
        """Worker thread: the content hash first, so a cached image skips decode and processor."""
        from tokenwire.media.hashing import hash_media_bytes
        from tokenwire.media.loaders import load_image

        content_hash = hash_media_bytes(data)
        cached = cache.get(content_hash)
        self._count(cached is not None)
        if cached is not None:
            return cached
        item = processor.process_image(load_image(data), content_hash)
        cache.put(item)
        return item

    def _count(self, hit: bool) -> None:
        (self._hits if hit else self._misses).inc()


def chat_media_refs(messages: Iterable[ChatMessage]) -> list[MediaRef]:
    """The media parts of chat messages, in the order the template writes their placeholders."""
    refs: list[MediaRef] = []
    for m, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for p, part in enumerate(message.content):
            where = f"messages[{m}].content[{p}]"
            if isinstance(part, ImageURLPart):
                refs.append(MediaRef("image", part.image_url.url, part.uuid, where))
            elif isinstance(part, AudioURLPart):
                refs.append(MediaRef("audio", part.audio_url.url, part.uuid, where))
            elif isinstance(part, VideoURLPart):
                refs.append(MediaRef("video", part.video_url.url, part.uuid, where))
            elif isinstance(part, FlatMediaPart):
                url = getattr(part, part.type)
                if url is None and part.uuid is None:
                    raise bad_request(f"{where}: a {part.type} part needs a url or a uuid", where)
                refs.append(MediaRef(part.type, url, part.uuid, where))
    return refs


def _modality(part_type: str) -> Modality:
    modality = part_type.removesuffix("_url")
    if modality not in ("image", "audio", "video"):
        raise bad_request(f"unknown content part type {part_type!r}", "content_parts")
    return modality  # type: ignore[return-value]


def _pad_runs(token_ids: Sequence[int], pad: int) -> list[tuple[int, int]]:
    """Maximal runs of ``pad`` as (offset, length)."""
    runs: list[tuple[int, int]] = []
    start = -1
    for index, token in enumerate(token_ids):
        if token == pad:
            if start < 0:
                start = index
        elif start >= 0:
            runs.append((start, index - start))
            start = -1
    if start >= 0:
        runs.append((start, len(token_ids) - start))
    return runs


def _first_client_error(errors: BaseExceptionGroup) -> BaseException:
    """The first error a client should see from concurrent fetches; anything else as it was."""
    for exc in errors.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = _first_client_error(exc)
        if isinstance(exc, APIError | MediaError):
            return exc
    return errors
