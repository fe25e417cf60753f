"""Streaming chat derender: one generate chunk + the client's state -> one chat chunk + state.

The server keeps nothing between calls. The opaque ``stream_state`` holds what the first call
decided for the whole stream (parsers and decode options: stop token ids, stop strings, special
tokens, so later calls need not repeat the chat request) and each choice's decoder state.
"""

from __future__ import annotations

import base64
import binascii
import time
from typing import Any

import orjson

from tokenwire.parsers import get_reasoning_parser, get_tool_parser
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.decoder import (
    ChoiceDecoder,
    ChoiceState,
    ChoiceStep,
    DecodeOptions,
    Parsing,
)
from tokenwire.pipeline.derender import decode_choice
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.parsing import chat_parsing
from tokenwire.pipeline.validation import check_token_ids
from tokenwire.protocol.derender import ChatDerenderStreamRequest

STATE_VERSION = 2
_MAX_STATE_CHARS = 1 << 20


class StreamState:
    """The whole stream's parsing and decode options, and one decoder state per choice."""

    def __init__(
        self, parsing: Parsing, options: DecodeOptions, choices: dict[int, ChoiceState]
    ) -> None:
        self.parsing = parsing
        self.options = options
        self.choices = choices

    def dumps(self) -> str:
        parsing = self.parsing
        data = {
            "v": STATE_VERSION,
            "p": [
                parsing.reasoning_parser.name if parsing.reasoning_parser else None,
                parsing.tool_parser.name if parsing.tool_parser else None,
                parsing.prompt_in_think,
            ],
            "o": self.options.to_json(),
            "c": {str(index): state.to_json() for index, state in self.choices.items()},
        }
        return base64.urlsafe_b64encode(orjson.dumps(data)).decode("ascii")

    @classmethod
    def loads(cls, blob: str, pipeline: Pipeline) -> StreamState:
        """Parse a client's state; 400 for anything this server did not write."""
        try:
            if len(blob) > _MAX_STATE_CHARS:
                raise ValueError("too large")
            data = orjson.loads(base64.urlsafe_b64decode(blob))
            if data["v"] != STATE_VERSION:
                raise ValueError("unknown version")
            reasoning, tool, in_think = data["p"]
            options = DecodeOptions.from_json(data["o"])
            choices = {int(k): ChoiceState.from_json(v) for k, v in data["c"].items()}
        except (binascii.Error, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidRequest(f"stream_state is not valid: {exc}", "stream_state") from exc
        # Only parsers this server runs may come back from a client.
        config = pipeline.config
        allowed_reasoning = config.reasoning_parser.name if config.reasoning_parser else None
        allowed_tool = config.tool_parser.name if config.tool_parser else None
        if reasoning not in (None, allowed_reasoning) or tool not in (None, allowed_tool):
            raise InvalidRequest(
                "stream_state names parsers this server does not run", "stream_state"
            )
        runtime = pipeline.ready()
        check_token_ids(runtime, sorted(options.stop_token_ids), "stream_state")
        for state in choices.values():
            for context in (state.logprob_context, state.text_context):
                check_token_ids(runtime, [*context.context, *context.held], "stream_state")
        parsing = Parsing(
            reasoning_parser=get_reasoning_parser(reasoning) if reasoning else None,
            tool_parser=get_tool_parser(tool) if tool else None,
            prompt_in_think=bool(in_think),
        )
        return cls(parsing, options, choices)


async def derender_chat_chunk(
    pipeline: Pipeline, body: ChatDerenderStreamRequest
) -> dict[str, Any]:
    runtime = pipeline.ready(body.model)
    if body.stream_state is None:
        chat = body.chat_request
        parsing = await chat_parsing(pipeline, runtime, chat, body.prompt_token_ids)
        stream = StreamState(parsing, DecodeOptions.of(chat), {})
    else:
        stream = StreamState.loads(body.stream_state, pipeline)
    chunk = body.generate_chunk
    choices = []
    for choice in chunk.choices:
        decoder = _choice_decoder(runtime, stream, choice.index, body.prompt_token_ids)
        step = decode_choice(
            runtime,
            choice,
            choice.index,
            stream.options,
            stream.parsing,
            body.prompt_token_ids,
            decoder=decoder,
            final=False,
        )
        stream.choices[choice.index] = decoder.state
        choices.append(chat_chunk_choice(choice.index, step))
    result: dict[str, Any] = {
        "id": chunk.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": pipeline.config.served_name,
        "choices": choices,
    }
    if chunk.usage is not None:
        result["usage"] = chunk.usage.model_dump()
    return {"chunk": result, "stream_state": stream.dumps()}


def _choice_decoder(
    runtime: ModelRuntime, stream: StreamState, index: int, prompt_token_ids: list[int] | None
) -> ChoiceDecoder:
    state = stream.choices.get(index)
    if state is None:
        try:
            return ChoiceDecoder.start(
                runtime.decoder,
                runtime.eos_token_ids,
                stream.options,
                stream.parsing,
                prompt_token_ids,
            )
        except ValueError as exc:
            raise InvalidRequest(f"prompt_token_ids: {exc}", "prompt_token_ids") from exc
    return ChoiceDecoder(
        runtime.decoder, runtime.eos_token_ids, stream.options, stream.parsing, state
    )


def chat_chunk_choice(index: int, step: ChoiceStep) -> dict[str, Any]:
    """One choice of a ``chat.completion.chunk``: the role goes on its first delta."""
    delta = step.message.to_json()
    if step.first:
        delta = {"role": "assistant", **delta}
    return {
        "index": index,
        "delta": delta,
        "logprobs": orjson.Fragment(step.logprobs) if isinstance(step.logprobs, bytes) else None,
        "finish_reason": step.finish_reason,
    }
