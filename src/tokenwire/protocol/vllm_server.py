"""vLLM's old demo server's ``/generate`` body, as atropos' ``VLLMServer`` sends it, and how
``/generate`` tells it from SGLang's body on the same path."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, field_validator

from tokenwire.protocol.common import RequestModel, TokenId
from tokenwire.protocol.generate import SamplingParamsModel
from tokenwire.protocol.sglang import SGLangGenerateRequest


class VLLMServerPrompt(RequestModel):
    prompt_token_ids: list[TokenId] = Field(min_length=1)


class VLLMServerGenerateRequest(SamplingParamsModel):
    """``{"prompt": {"prompt_token_ids": [...]}, "logprobs": 0, ...}``: the prompt's ids and
    vLLM's ``SamplingParams`` at the top level (an unknown one is a 400, as generate's
    ``sampling_params``; that server fails on it with a 500)."""

    prompt: VLLMServerPrompt
    stream: bool = False

    @field_validator("stream")
    @classmethod
    def _not_streamed(cls, value: bool) -> bool:
        # That server streams whole texts as NDJSON; atropos never asks for it.
        if value:
            raise ValueError("stream: not served for this body (send SGLang's to stream)")
        return value


def _generate_form(body: Any) -> str:
    """SGLang's body has ``text`` or ``input_ids`` and no ``prompt``; the vLLM server's has a
    ``prompt``. Anything else is SGLang's, as before (its own errors say what is missing)."""
    if isinstance(body, dict) and "prompt" in body and not {"text", "input_ids"} & body.keys():
        return "vllm_server"
    return "sglang"


GenerateBody = Annotated[
    Annotated[SGLangGenerateRequest, Tag("sglang")]
    | Annotated[VLLMServerGenerateRequest, Tag("vllm_server")],
    Discriminator(_generate_form),
]
