"""tokenwire.media layer: the one guarded media connector, loaders, processors, the media cache."""

from tokenwire.media.connector import MediaConnector
from tokenwire.media.errors import MediaError, MediaFetchFailed, MediaRefused, Rule
from tokenwire.media.policy import MediaPolicy

__all__ = [
    "MediaConnector",
    "MediaError",
    "MediaFetchFailed",
    "MediaPolicy",
    "MediaRefused",
    "Rule",
]
