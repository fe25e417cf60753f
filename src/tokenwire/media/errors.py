"""Media failures, each carrying the HTTP status the API layer should answer with.

The api layer maps any ``MediaError`` to ``error_response(exc.status, exc.message, exc.param)``;
nothing in the media layer may surface as a 500.
"""

from __future__ import annotations

from enum import StrEnum


class Rule(StrEnum):
    """The rule a refusal names; the text is what the client sees first in the message."""

    UNSUPPORTED_SCHEME = "unsupported URL scheme"
    INVALID_URL = "invalid media URL"
    CREDENTIALS_IN_URL = "credentials in media URL are not allowed"
    DOMAIN_NOT_ALLOWED = "media domain not allowed"
    PRIVATE_ADDRESS = "private address"
    REDIRECTS_NOT_ALLOWED = "redirects are not allowed"
    TOO_MANY_REDIRECTS = "too many redirects"
    REDIRECT_WITHOUT_LOCATION = "redirect without Location"
    TOO_LARGE = "media too large"
    ENCODED_BODY = "media content encoding not accepted"
    TOO_MANY_IMAGES = "too many images in one request"
    PIXEL_BUDGET = "image pixels over the request budget"
    TIMED_OUT = "media fetch timed out"
    DATA_URL_NOT_BASE64 = "data URL must be base64"
    INVALID_BASE64 = "invalid base64 in data URL"
    LOCAL_FILES_DISABLED = "local media files are not allowed"
    OUTSIDE_LOCAL_PATH = "file outside allowed local media path"
    IMAGE_TOO_LARGE = "image too large / decompression bomb"
    INVALID_IMAGE = "invalid image"


class MediaError(Exception):
    """Base of every media failure; ``status`` is the HTTP status for our client.

    ``param`` names the request field at fault when the raiser knows it (the error body's param).
    """

    status: int = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MediaRefused(MediaError):
    """A policy or limit said no (always 400); ``rule`` names which one."""

    status = 400

    def __init__(self, rule: Rule | str, detail: str | None = None) -> None:
        self.rule = str(rule)
        super().__init__(self.rule if detail is None else f"{self.rule}: {detail}")


class MediaFetchFailed(MediaError):
    """The fetch was allowed but did not produce the media.

    ``status`` is 422 when the remote answered 4xx (or a local file is missing): the request was
    well formed but names media that cannot be had. Remote 5xx, unexpected statuses, DNS and
    connection/TLS/protocol errors are 400 with a message naming the problem; never a 5xx, because
    the fault is not ours. ``remote_status`` is the upstream status when there was one.
    """

    def __init__(self, message: str, *, status: int = 400, remote_status: int | None = None):
        super().__init__(message)
        self.status = status
        self.remote_status = remote_status


class MediaInputError(MediaError):
    """A request's media this model or prompt cannot take, or a failure tied to one media part.

    Raised by the media service, which knows the request field (``param``): modalities the model
    does not take, unknown uuids or mm_hashes, features that disagree. Connector and processing
    failures of one part are re-raised as one of these naming the part, keeping their ``status``.
    """

    def __init__(self, message: str, param: str | None = None, *, status: int = 400) -> None:
        super().__init__(message, param=param)
        self.status = status
