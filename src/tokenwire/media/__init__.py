"""tokenwire.media layer: the one guarded media connector, loaders, processors, the media cache
and the media service every entry point shares (``tokenwire.media.service``)."""

from tokenwire.media.connector import MediaConnector
from tokenwire.media.errors import (
    MediaError,
    MediaFetchFailed,
    MediaInputError,
    MediaRefused,
    Rule,
)
from tokenwire.media.policy import MediaPolicy

__all__ = [
    "MediaConnector",
    "MediaError",
    "MediaFetchFailed",
    "MediaInputError",
    "MediaPolicy",
    "MediaRefused",
    "Rule",
]

# Processing and the cache pull in torch; they load on first use so the connector stays light.
_LAZY_EXPORTS = {
    "CacheStats": "tokenwire.media.cache",
    "MediaCache": "tokenwire.media.cache",
    "MediaProcessor": "tokenwire.media.processing",
    "ProcessedMedia": "tokenwire.media.processing",
    "ProcessingRule": "tokenwire.media.processing",
    "expand_image_placeholders": "tokenwire.media.processing",
    "validate_placeholder_ranges": "tokenwire.media.processing",
    "hash_media_bytes": "tokenwire.media.hashing",
}
__all__ += list(_LAZY_EXPORTS)


def __getattr__(name: str) -> object:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
