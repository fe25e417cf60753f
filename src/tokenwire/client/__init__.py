"""tokenwire's Python client: every endpoint (sync and async) and the multi-turn ``Rollout``.

It talks HTTP only; nothing here imports the server's api, pipeline or engine.
"""

from tokenwire.client.client import AsyncClient, Client
from tokenwire.client.errors import (
    APIConnectionError,
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    RequestTooLargeError,
    ServiceUnavailableError,
    TokenwireError,
    UnprocessableEntityError,
)
from tokenwire.client.fleet import AsyncFleet, Fleet
from tokenwire.client.rollout import Rollout, RolloutError, RolloutResult, Turn
from tokenwire.client.routing import decode_routed_experts, decode_sglang_routed_experts
from tokenwire.client.types import (
    ChatCompletion,
    ChatMessageOut,
    Completion,
    Extension,
    GenerateChunk,
    GenerateResult,
    ModelCard,
    Prompt,
    Tokens,
)

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "AsyncClient",
    "AsyncFleet",
    "AuthenticationError",
    "BadRequestError",
    "ChatCompletion",
    "ChatMessageOut",
    "Client",
    "Completion",
    "Extension",
    "Fleet",
    "GenerateChunk",
    "GenerateResult",
    "InternalServerError",
    "ModelCard",
    "NotFoundError",
    "Prompt",
    "RequestTooLargeError",
    "Rollout",
    "RolloutError",
    "RolloutResult",
    "ServiceUnavailableError",
    "Tokens",
    "TokenwireError",
    "Turn",
    "UnprocessableEntityError",
    "decode_routed_experts",
    "decode_sglang_routed_experts",
]
