"""Media of a request -> processed items, expanded prompt ids and the engine's ``MultiModalInput``.

One ``MediaService`` is built at start-up and shared by every entry point (chat messages of
render, /tokenize and chat completions; ``content_parts`` and ``features`` of generate), so they
all fetch through the same guarded connector and share one cache. Where each check happens:

- the connector (``media.connector``): every SSRF and size rule, before and while fetching;
- the loaders and processor (``media.loaders``, ``media.processing``): bombs, bad images,
  client-sent tensors in ``features.kwargs_data``;
- here: which modalities this model takes, the per-request limits (how many images; how many
  pixels to decode, read from the image headers before any decoding), uuid/mm_hash cache
  look-ups, and that the prompt's image placeholders agree with the images (expanded here,
  validated for ``features``).

Every failure is a ``MediaError`` (``MediaInputError`` naming the request field where this
module knows it). Fetching is async and concurrent across a request's parts; decoding and
processing run in the default thread pool, so the event loop never waits on PIL or the processor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tokenwire.media.connector import MediaConnector
from tokenwire.media.errors import MediaError, MediaInputError, Rule
from tokenwire.media.policy import MediaPolicy
from tokenwire.media.prompt import IMAGE_PAD, EncodedKwargsCache, PromptMedia, pad_runs
from tokenwire.media.refs import ContentPartLike, FeaturesLike, MediaRef, content_part_refs

if TYPE_CHECKING:
    from PIL import Image

    from tokenwire.media.cache import MediaCache
    from tokenwire.media.processing import MediaProcessor, ProcessedMedia

NO_MULTIMODAL = "this model takes no multimodal input"
T = TypeVar("T")


class MediaService:
    """The connector, processor and cache of one served model, built once at start-up.

    ``processor`` is None for text-only models; then every request with media is a 400 before
    anything is fetched (and no connector is built). ``on_cache_hit`` / ``on_cache_miss`` count
    image cache look-ups (the caller's metrics; only images reach the cache).
    """

    def __init__(
        self,
        *,
        policy: MediaPolicy,
        connector: MediaConnector | None,
        processor: MediaProcessor | None,
        cache: MediaCache | None,
        image_pad_id: int | None,
        on_cache_hit: Callable[[], object],
        on_cache_miss: Callable[[], object],
    ) -> None:
        self.policy = policy
        self.connector = connector
        self.processor = processor
        self.cache = cache
        self.image_pad_id = image_pad_id
        # A quarter of the media cache's budget again, for render's serialised tensors.
        self.encoded = EncodedKwargsCache(cache.max_bytes // 4 if cache is not None else 0)
        self._on_hit = on_cache_hit
        self._on_miss = on_cache_miss

    @classmethod
    async def build(
        cls,
        model_dir: Path,
        *,
        policy: MediaPolicy,
        cache_bytes: int,
        image_pad_id: int | None,
        on_cache_hit: Callable[[], object],
        on_cache_miss: Callable[[], object],
    ) -> MediaService:
        """The processor loads in a thread (transformers import); the connector on the loop,
        which its async HTTP client belongs to. Text-only models get neither.

        ``image_pad_id`` is the tokenizer's ``<|image_pad|>`` id, used when the processor names
        none; ``policy`` and ``cache_bytes`` are resolved from the settings by the caller.
        """
        from tokenwire.media.processing import MediaProcessor

        processor = await asyncio.to_thread(MediaProcessor.from_model_dir, model_dir)
        if processor is None:
            return cls(
                policy=policy,
                connector=None,
                processor=None,
                cache=None,
                image_pad_id=None,
                on_cache_hit=on_cache_hit,
                on_cache_miss=on_cache_miss,
            )
        from tokenwire.media.cache import MediaCache

        pad = processor.image_token_id if processor.image_token_id is not None else image_pad_id
        if pad is None:
            raise ValueError(f"{model_dir}: the model has an image processor but no {IMAGE_PAD}")
        return cls(
            policy=policy,
            connector=MediaConnector(policy),
            processor=processor,
            cache=MediaCache(cache_bytes),
            image_pad_id=int(pad),
            on_cache_hit=on_cache_hit,
            on_cache_miss=on_cache_miss,
        )

    async def aclose(self) -> None:
        if self.connector is not None:
            await self.connector.aclose()

    # -- entry points -------------------------------------------------------------------------

    async def resolve(self, refs: Sequence[MediaRef]) -> list[ProcessedMedia]:
        """Every ref as a processed item, in order, within the request's media limits.

        Three steps, so that the limits hold before any pixel is decoded: fetch every ref
        concurrently (or take it from the cache), read each new image's size from its header and
        check the request's pixel budget, then decode and process the new images in worker
        threads (identical bytes once).
        """
        if not refs:
            return []
        for ref in refs:
            self._check_modality(ref)
        param = refs[0].where.partition("[")[0]
        self._check_count(len(refs), param)
        sources = await _all([self._source(ref) for ref in refs])
        pending = list({s.content_hash: s for s in sources if isinstance(s, _Pending)}.values())
        self._check_pixels(pending, param)
        decoded = await _all([self._decoded(p) for p in pending])
        new = {item.content_hash: item for item in decoded}
        items = [new[s.content_hash] if isinstance(s, _Pending) else s for s in sources]
        _, cache, _ = self._require_images()
        for ref, item in zip(refs, items, strict=True):
            if ref.uuid is not None:
                cache.put(item, uuid=ref.uuid)
        return items

    async def prompt_from_content_parts(
        self, token_ids: list[int], parts: Sequence[ContentPartLike]
    ) -> PromptMedia:
        """Generate's raw media: fetched and processed here, then the pads expanded."""
        refs = content_part_refs(parts)
        if not refs:
            return PromptMedia(list(token_ids), (), ())
        return self.expand(token_ids, await self.resolve(refs), already_expanded_ok=True)

    async def prompt_from_features(
        self, token_ids: list[int], features: FeaturesLike
    ) -> PromptMedia:
        """Render's features sent back: items from ``kwargs_data`` or the cache, ranges checked."""
        hashes, ranges, kwargs = features.mm_hashes, features.mm_placeholders, features.kwargs_data
        for modality in set(hashes) | set(ranges) | set(kwargs or {}):
            if hashes.get(modality) or ranges.get(modality) or (kwargs or {}).get(modality):
                self._require_images("features")
                if modality != "image":
                    raise MediaInputError(f"this model takes no {modality} input", "features")
        image_hashes, image_ranges = hashes.get("image", []), ranges.get("image", [])
        image_kwargs = (kwargs or {}).get("image")
        if len(image_hashes) != len(image_ranges):
            raise MediaInputError(
                f"features: {len(image_hashes)} image mm_hashes but {len(image_ranges)} "
                "mm_placeholders",
                "features",
            )
        if image_kwargs is not None and len(image_kwargs) != len(image_hashes):
            raise MediaInputError(
                f"features: {len(image_hashes)} image mm_hashes but {len(image_kwargs)} "
                "kwargs_data entries",
                "features",
            )
        if not image_hashes:
            return PromptMedia(list(token_ids), (), ())
        self._check_count(len(image_hashes), "features")
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
                    raise MediaInputError(
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
            runs = pad_runs(token_ids, pad)
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
            raise MediaInputError(NO_MULTIMODAL, param)
        return self.processor, self.cache, self.image_pad_id

    def _check_modality(self, ref: MediaRef) -> None:
        self._require_images(ref.where.partition("[")[0])
        if ref.modality != "image":
            raise MediaInputError(f"{ref.where}: this model takes no {ref.modality} input")

    def _check_count(self, count: int, param: str) -> None:
        limit = self.policy.max_images_per_request
        if count > limit:
            raise MediaInputError(
                f"{Rule.TOO_MANY_IMAGES}: {count} > {limit} (--max-images-per-request)", param
            )

    def _check_pixels(self, pending: Sequence[_Pending], param: str) -> None:
        budget = self.policy.max_image_pixels_per_request
        total = sum(p.pixels for p in pending)
        if total > budget:
            raise MediaInputError(
                f"{Rule.PIXEL_BUDGET}: {total} > {budget} pixels to decode "
                "(--max-image-pixels-per-request)",
                param,
            )

    async def _source(self, ref: MediaRef) -> ProcessedMedia | _Pending:
        """A cached item, or the fetched image with only its header read."""
        _, cache, _ = self._require_images()
        if ref.uuid is not None:
            # A uuid names the item (vLLM's contract: unique per content), so a cached one is
            # reused even when a url comes along: rollouts on one image skip the fetch.
            cached = cache.get_by_uuid(ref.uuid)
            if cached is not None:
                self._count(True)
                return cached
            if ref.url is None:
                self._count(False)
                raise MediaInputError(
                    f"{ref.where}: no cached {ref.modality} for uuid {ref.uuid!r}", ref.where
                )
        if ref.url is None:  # the protocol models never let this through
            raise MediaInputError(f"{ref.where}: needs a url or a uuid", ref.where)
        assert self.connector is not None  # built with the processor
        try:
            data = await self.connector.fetch(ref.url)
            return await asyncio.to_thread(self._open, cache, data, ref)
        except MediaError as exc:
            raise _for_part(exc, ref) from None

    def _open(self, cache: MediaCache, data: bytes, ref: MediaRef) -> ProcessedMedia | _Pending:
        """Worker thread: the content hash first, so a cached image is never even opened."""
        from tokenwire.media.hashing import hash_media_bytes
        from tokenwire.media.loaders import open_image

        content_hash = hash_media_bytes(data)
        cached = cache.get(content_hash)
        self._count(cached is not None)
        if cached is not None:
            return cached
        image = open_image(data)
        width, height = image.size
        return _Pending(content_hash, image, width * height, ref)

    async def _decoded(self, pending: _Pending) -> ProcessedMedia:
        try:
            return await asyncio.to_thread(self._decode, pending)
        except MediaError as exc:
            raise _for_part(exc, pending.ref) from None

    def _decode(self, pending: _Pending) -> ProcessedMedia:
        """Worker thread: decode and process one new image, and cache it."""
        from tokenwire.media.loaders import decode_image

        processor, cache, _ = self._require_images()
        item = processor.process_image(decode_image(pending.image), pending.content_hash)
        cache.put(item)
        return item

    def _count(self, hit: bool) -> None:
        (self._on_hit if hit else self._on_miss)()


@dataclass(frozen=True, slots=True)
class _Pending:
    """A fetched image that is not cached: its header read, no pixel decoded yet."""

    content_hash: str
    image: Image.Image
    pixels: int
    ref: MediaRef  # the first part that named it, for errors


async def _all(work: Sequence[Awaitable[T]]) -> list[T]:
    """Run concurrently; the first client error wins, as one request has one answer."""
    if len(work) == 1:
        return [await work[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(item) for item in work]  # type: ignore[arg-type]
    except BaseExceptionGroup as errors:
        raise _first_client_error(errors) from None
    return [task.result() for task in tasks]


def _for_part(exc: MediaError, ref: MediaRef) -> MediaInputError:
    """A connector or processing failure of one part, naming the part and keeping its status."""
    return MediaInputError(f"{exc.message} ({ref.where})", ref.where, status=exc.status)


def _first_client_error(errors: BaseExceptionGroup) -> BaseException:
    """The first error a client should see from concurrent fetches; anything else as it was."""
    for exc in errors.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = _first_client_error(exc)
        if isinstance(exc, MediaError):
            return exc
    return errors
