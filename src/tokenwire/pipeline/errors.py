"""Domain errors of the pipeline; ``api.errors`` is the one place that maps them to HTTP."""

from __future__ import annotations


class PipelineError(Exception):
    """A request the pipeline will not serve; ``param`` names the offending field, ``details``
    what a client's code acts on (the error body's ``error.details``)."""

    def __init__(
        self, message: str, param: str | None = None, details: dict[str, object] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.details = details


class InvalidRequest(PipelineError):
    """The client sent something wrong (HTTP 400)."""


class UnknownModel(PipelineError):
    """The request names a model this server does not serve (HTTP 404)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.", "model")
        self.name = name

    def __reduce__(self) -> tuple[type, tuple[str]]:  # crosses the job channel as it was
        return UnknownModel, (self.name,)


class NotFound(PipelineError):
    """The request names something (not a model) this server does not have (HTTP 404)."""


class UnknownSession(PipelineError):
    """No session has this id, or it expired (HTTP 404)."""


class SessionClosed(PipelineError):
    """The session is closed to appends (it reached its byte bound; HTTP 409)."""


class NotReady(PipelineError):
    """The model is loading or the server is shutting down (HTTP 503)."""


class ClientGone(PipelineError):
    """The client went away before its answer was ready (HTTP 499)."""
