"""Media of a request -> processed items, expanded prompt ids and the engine's ``MultiModalInput``.

One ``MediaService`` is built at start-up and shared by every entry point (chat messages of
render, /tokenize and chat completions; ``content_parts`` and ``features`` of generate), so they
all fetch through the same guarded connector and share one cache. Where each check happens:

- the connector (``media.connector``): every SSRF and size rule, before and while fetching;
- the loaders and processor (``media.loaders``, ``media.processing``): bombs, bad images,
  client-sent tensors in ``features.kwargs_data``;
- here: which modalities this model takes, uuid/mm_hash cache look-ups, and that the prompt's
  image placeholders agree with the images (expanded here, validated for ``features``).

Every failure is a ``MediaError`` (``MediaInputError`` naming the request field where this
module knows it). Fetching is async and concurrent across a request's parts; decoding and
processing run in the default thread pool, so the event loop never waits on PIL or the processor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenwire.media.connector import MediaConnector
from tokenwire.media.errors import MediaError, MediaInputError
from tokenwire.media.policy import MediaPolicy
from tokenwire.media.prompt import IMAGE_PAD, EncodedKwargsCache, PromptMedia, pad_runs
from tokenwire.media.refs import ContentPartLike, FeaturesLike, MediaRef, content_part_refs

if TYPE_CHECKING:
    from tokenwire.media.cache import MediaCache
    from tokenwire.media.processing import MediaProcessor, ProcessedMedia

NO_MULTIMODAL = "this model takes no multimodal input"


class MediaService:
    """The connector, processor and cache of one served model, built once at start-up.

    ``processor`` is None for text-only models; then every request with media is a 400 before
    anything is fetched (and no connector is built). ``on_cache_hit`` / ``on_cache_miss`` count
    image cache look-ups (the caller's metrics; only images reach the cache).
    """

    def __init__(
        self,
        *,
        connector: MediaConnector | None,
        processor: MediaProcessor | None,
        cache: MediaCache | None,
        image_pad_id: int | None,
        on_cache_hit: Callable[[], object],
        on_cache_miss: Callable[[], object],
    ) -> None:
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
                raise MediaInputError(
                    f"{ref.where}: no cached {ref.modality} for uuid {ref.uuid!r}", ref.where
                )
        if ref.url is None:  # the protocol models never let this through
            raise MediaInputError(f"{ref.where}: needs a url or a uuid", ref.where)
        assert self.connector is not None  # built with the processor
        try:
            data = await self.connector.fetch(ref.url)
            item = await asyncio.to_thread(self._process, processor, cache, data)
        except MediaError as exc:
            raise MediaInputError(
                f"{exc.message} ({ref.where})", ref.where, status=exc.status
            ) from None
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
        (self._on_hit if hit else self._on_miss)()


def _first_client_error(errors: BaseExceptionGroup) -> BaseException:
    """The first error a client should see from concurrent fetches; anything else as it was."""
    for exc in errors.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = _first_client_error(exc)
        if isinstance(exc, MediaError):
            return exc
    return errors
