"""What the routers share: built once at start-up, then read-only while serving."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from tokenwire.api.errors import APIError
from tokenwire.api.metrics import Metrics
from tokenwire.engine.base import Engine
from tokenwire.media.service import MediaService
from tokenwire.settings import Settings
from tokenwire.text.chat_template import ChatTemplate
from tokenwire.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenwire.api.generation import GenerationJob


@dataclass(slots=True)
class ModelRuntime:
    """The loaded model: available once loading finished."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    engine: Engine
    max_model_len: int
    # Ids that end a choice on their own (eos); never part of the text a client reads.
    eos_token_ids: frozenset[int]
    # Fetches and processes media for every entry point; refuses it for text-only models.
    media: MediaService


@dataclass(slots=True)
class ServerState:
    settings: Settings
    metrics: Metrics
    runtime: ModelRuntime | None = None
    shutting_down: bool = False
    load_error: str | None = None
    # Request-supplied templates (trusted servers only), compiled once, least recently used out.
    # Running jobs by client request id, for /abort_requests.
    jobs: dict[str, GenerationJob] = field(default_factory=dict)
    request_templates: OrderedDict[str, ChatTemplate] = field(default_factory=OrderedDict)

    @property
    def served_name(self) -> str:
        return self.settings.model_names[0]

    def check_model(self, name: str | None) -> None:
        """Missing or empty means the served model; anything else must be one of its names."""
        if name and name not in self.settings.model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")


def serving(request: Request) -> tuple[ServerState, ModelRuntime]:
    """The server state and the loaded model, or a 503 while loading or shutting down.

    Routes call this directly: FastAPI's dependency solving cost more per request than the
    whole tokenizer call of a short prompt.
    """
    state: ServerState = request.app.state.tokenwire
    if state.runtime is None or state.shutting_down:
        message = "The server is shutting down" if state.shutting_down else "The model is loading"
        raise APIError(503, message)
    return state, state.runtime
