"""The media parts of a request, as ``MediaRef``s: chat messages and generate's content parts.

The media layer sits below ``tokenwire.protocol``, so it reads the request models by their
shapes (the structural types below), never by importing them. Only the shapes of the OpenAI and
vLLM content parts matter here: ``{"type": "image_url", "image_url": {"url": ...}}`` and the flat
``{"type": "image", "image": url}``, each with an optional ``uuid``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tokenwire.media.errors import MediaInputError

Modality = Literal["image", "audio", "video"]
MODALITIES: tuple[Modality, ...] = ("image", "audio", "video")


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One media part of a request, wherever it came from; ``where`` names it in errors."""

    modality: Modality
    url: str | None
    uuid: str | None
    where: str


class ChatMessageLike(Protocol):
    """A chat message: its content is text or a list of typed parts."""

    @property
    def content(self) -> str | Sequence[Any] | None: ...


class ContentPartLike(Protocol):
    """One of generate's ``content_parts``: ``image_url``, ``audio_url`` or ``video_url``."""

    @property
    def type(self) -> str: ...
    @property
    def url(self) -> str | None: ...
    @property
    def uuid(self) -> str | None: ...


class PlaceholderRangeLike(Protocol):
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


class FeaturesLike(Protocol):
    """Render's ``features`` sent back to generate, keyed by modality."""

    @property
    def mm_hashes(self) -> Mapping[str, Sequence[str]]: ...
    @property
    def mm_placeholders(self) -> Mapping[str, Sequence[PlaceholderRangeLike]]: ...
    @property
    def kwargs_data(self) -> Mapping[str, Sequence[str | None]] | None: ...


def chat_media_refs(messages: Iterable[ChatMessageLike]) -> list[MediaRef]:
    """The media parts of chat messages, in the order the template writes their placeholders."""
    refs: list[MediaRef] = []
    for m, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for p, part in enumerate(message.content):
            where = f"messages[{m}].content[{p}]"
            kind = part.type
            if kind in ("image_url", "audio_url", "video_url"):
                # {"type": "image_url", "image_url": {"url": ...}} and its audio/video twins.
                refs.append(MediaRef(_modality(kind), getattr(part, kind).url, part.uuid, where))
            elif kind in MODALITIES:
                # vLLM's flat form: {"type": "image", "image": url}.
                url = getattr(part, kind)
                if url is None and part.uuid is None:
                    raise MediaInputError(f"{where}: a {kind} part needs a url or a uuid", where)
                refs.append(MediaRef(kind, url, part.uuid, where))
    return refs


def content_part_refs(parts: Sequence[ContentPartLike]) -> list[MediaRef]:
    """Generate's ``content_parts``, in order."""
    return [
        MediaRef(_modality(part.type), part.url, part.uuid, f"content_parts[{index}]")
        for index, part in enumerate(parts)
    ]


def _modality(part_type: str) -> Modality:
    modality = part_type.removesuffix("_url")
    if modality not in MODALITIES:
        raise MediaInputError(f"unknown content part type {part_type!r}", "content_parts")
    return modality  # type: ignore[return-value]
