"""Streaming chat derender: one generate chunk + the client's state -> one chat chunk + state.

The server keeps nothing: per choice the state holds the decoder and parser state, and for the
whole stream which parsers were chosen on the first call, so later calls need not repeat the
chat request.
"""

from __future__ import annotations

import base64
import binascii
import time
from typing import Any

import orjson

from tokenwire.api.derendering import ChatParsing, chat_parsing, check_output_ids, logprob_input
from tokenwire.api.errors import bad_request
from tokenwire.api.state import ModelRuntime, ServerState
from tokenwire.protocol.derender import ChatDerenderStreamRequest, GenerateChoiceIn
from tokenwire.text.incremental import StreamingDerenderState, advance, start_stream
from tokenwire.text.token_text import LogprobInput

_MAX_STATE_CHARS = 1 << 20


class StreamState:
    """The opaque ``stream_state``: parsing choices plus one decoder state per choice index."""

    def __init__(
        self, parsing: ChatParsing, choices: dict[int, str], tool_calls: dict[int, int]
    ) -> None:
        self.parsing = parsing
        self.choices = choices
        self.tool_calls = tool_calls

    def dumps(self) -> str:
        data = {
            "p": [
                self.parsing.reasoning_parser,
                self.parsing.tool_parser,
                self.parsing.tools_enabled,
                self.parsing.prompt_in_think,
            ],
            "c": {str(index): blob for index, blob in self.choices.items()},
            "t": {str(index): count for index, count in self.tool_calls.items()},
        }
        return base64.urlsafe_b64encode(orjson.dumps(data)).decode("ascii")

    @classmethod
    def loads(cls, blob: str, state: ServerState) -> StreamState:
        try:
            if len(blob) > _MAX_STATE_CHARS:
                raise ValueError("too large")
            data = orjson.loads(base64.urlsafe_b64decode(blob))
            reasoning, tool, tools_enabled, in_think = data["p"]
            choices = {int(k): str(v) for k, v in data["c"].items()}
            tool_calls = {int(k): int(v) for k, v in data["t"].items()}
        except (binascii.Error, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise bad_request(f"stream_state is not valid: {exc}", "stream_state") from exc
        # Only parsers this server runs may come back from a client.
        if reasoning not in (None, state.settings.reasoning_parser) or tool not in (
            None,
            state.settings.tool_call_parser,
        ):
            raise bad_request("stream_state names parsers this server does not run", "stream_state")
        parsing = ChatParsing(reasoning, tool, bool(tools_enabled), bool(in_think))
        return cls(parsing, choices, tool_calls)


def derender_chunk(
    state: ServerState, runtime: ModelRuntime, body: ChatDerenderStreamRequest
) -> dict[str, Any]:
    chat = body.chat_request
    if body.stream_state is None:
        parsing = chat_parsing(state, runtime, chat, body.prompt_token_ids)
        stream = StreamState(parsing, {}, {})
    else:
        stream = StreamState.loads(body.stream_state, state)
    stop_ids = set(chat.stop_token_ids or ()) if chat else set()
    chunk = body.generate_chunk
    choices = [
        _choice_delta(runtime, stream, choice, body.prompt_token_ids, stop_ids)
        for choice in chunk.choices
    ]
    result: dict[str, Any] = {
        "id": chunk.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": state.served_name,
        "choices": choices,
    }
    if chunk.usage is not None:
        result["usage"] = chunk.usage
    return {"chunk": result, "stream_state": stream.dumps()}


class ChoiceStream:
    """One choice being derendered chunk by chunk (in memory, or restored from a client)."""

    def __init__(
        self,
        runtime: ModelRuntime,
        parsing: ChatParsing,
        current: StreamingDerenderState,
        *,
        stop_ids: set[int],
        started: bool,
        tool_calls: int = 0,
    ) -> None:
        self.runtime = runtime
        self.parsing = parsing
        self.current = current
        self.stop_ids = stop_ids
        self.started = started
        self.tool_calls = tool_calls

    @classmethod
    def start(
        cls,
        runtime: ModelRuntime,
        parsing: ChatParsing,
        prompt_token_ids: list[int] | None,
        stop_ids: set[int],
    ) -> ChoiceStream:
        current = start_stream(
            runtime.tokenizer,
            prompt_token_ids=prompt_token_ids,
            prompt_in_think=parsing.prompt_in_think,
        )
        return cls(runtime, parsing, current, stop_ids=stop_ids, started=False)

    def step(
        self, index: int, ids: list[int], logprobs: LogprobInput | None, finish_reason: str | None
    ) -> dict[str, Any]:
        """The chat chunk choice for these ids; ValueError for a client's inconsistent input."""
        drop_stop = (
            finish_reason == "stop"
            and bool(ids)
            and (ids[-1] in self.runtime.eos_token_ids or ids[-1] in self.stop_ids)
        )
        delta, self.current = advance(
            self.runtime.tokenizer,
            self.current,
            ids,
            finished=finish_reason is not None,
            reasoning_parser=self.parsing.reasoning_parser,
            tool_parser=self.parsing.tool_parser,
            tools_enabled=self.parsing.tools_enabled,
            logprobs=logprobs,
            drop_stop_token=drop_stop,
        )
        self.tool_calls += len(delta.message.tool_calls)
        message = delta.message.to_json()
        if not self.started:
            message = {"role": "assistant", **message}
            self.started = True
        if finish_reason is not None and self.tool_calls and self.parsing.tools_enabled:
            finish_reason = "tool_calls"
        return {
            "index": index,
            "delta": message,
            "logprobs": orjson.Fragment(delta.logprobs_json) if delta.logprobs_json else None,
            "finish_reason": finish_reason,
        }


def _choice_delta(
    runtime: ModelRuntime,
    stream: StreamState,
    choice: GenerateChoiceIn,
    prompt_token_ids: list[int] | None,
    stop_ids: set[int],
) -> dict[str, Any]:
    ids = list(choice.token_ids or ())
    where = f"choice {choice.index}"
    check_output_ids(runtime, ids, where)
    blob = stream.choices.get(choice.index)
    try:
        if blob is None:
            choice_stream = ChoiceStream.start(runtime, stream.parsing, prompt_token_ids, stop_ids)
        else:
            choice_stream = ChoiceStream(
                runtime,
                stream.parsing,
                StreamingDerenderState.loads(blob),
                stop_ids=stop_ids,
                started=True,
                tool_calls=stream.tool_calls.get(choice.index, 0),
            )
        logprobs = None
        if choice.logprobs is not None and choice.logprobs.content is not None:
            logprobs = logprob_input(choice.logprobs.content, ids, where)
        result = choice_stream.step(choice.index, ids, logprobs, choice.finish_reason)
    except ValueError as exc:
        raise bad_request(f"{where}: {exc}", "generate_chunk") from exc
    stream.choices[choice.index] = choice_stream.current.dumps()
    stream.tool_calls[choice.index] = choice_stream.tool_calls
    return result
