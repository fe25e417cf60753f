"""Prompts the server remembers, so that the next turn's extend names one instead of resending it.

A render or extend asked for a ``prompt_handle`` keeps its prompt ids, the conversation they hold
and the template's text of it under a random handle; an extend that names the handle sends only
the ids sampled after it, the reply and the new messages, and pays for those (issue 33: 74 ms of
re-checking and re-rendering a 74K-token history every turn before). Entries never change (a
handle can be extended twice: a search tree); the least recently used go first once they hold
``--prompt-memory-bytes``. A handle is a capability: only the credential that asked for it (or
the control key) can use it, and one it cannot use looks like one that was never made.
"""

from __future__ import annotations

import itertools
import secrets
import sys
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import orjson

from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.session_store import Owner
from tokenwire.protocol.chat import ChatMessage
from tokenwire.protocol.openai import ChatCompletionRequest

# A list's int: its object and the list's pointer to it.
_BYTES_PER_ID = 36
UNKNOWN_HANDLE = (
    "previous_prompt: no prompt with this handle (never made, evicted from "
    "--prompt-memory-bytes, or made by another credential or server process): send "
    "previous_token_ids and previous_messages instead"
)


class ChainedIds(Sequence[int]):
    """Prompt ids held as the lists that made them, in order, none of them ever changed: the
    next turn of a remembered prompt shares its lists and adds one of the ids after them. A
    list of a 68K-id history's ids would copy them every turn (0.1-0.3 ms) and grow the
    process by 544 KB a remembered turn, whose pages fault in at ~4 µs each here."""

    __slots__ = ("_len", "_pieces", "_starts")

    def __init__(self, pieces: Sequence[Sequence[int]]) -> None:
        self._pieces = tuple(piece for piece in pieces if piece)
        self._starts = list(itertools.accumulate((len(p) for p in self._pieces[:-1]), initial=0))
        self._len = sum(map(len, self._pieces))

    @classmethod
    def joined(cls, lead: Sequence[int], rest: Sequence[int]) -> ChainedIds:
        """``lead``'s ids, then ``rest``'s (``lead``'s lists shared, not copied)."""
        pieces = lead._pieces if isinstance(lead, ChainedIds) else (lead,)
        return cls((*pieces, rest))

    def prefix_then(self, size: int, rest: Sequence[int]) -> ChainedIds:
        """The first ``size`` ids, then ``rest``: the lists kept whole are shared, the one cut
        is copied up to ``size``."""
        if size >= self._len:
            return ChainedIds((*self._pieces, rest))
        at = bisect_right(self._starts, size) - 1
        head = self._pieces[at][: size - self._starts[at]]
        return ChainedIds((*self._pieces[:at], head, rest))

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._pieces)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return list(self)[index]
            taken: list[int] = []
            at = bisect_right(self._starts, start) - 1
            while start < stop:  # from each list the slice reaches, its part
                offset = self._starts[at]
                piece = self._pieces[at]
                taken += piece[start - offset : stop - offset]
                start = offset + len(piece)
                at += 1
            return taken
        position = index + self._len if index < 0 else index
        if not 0 <= position < self._len:
            raise IndexError("ChainedIds index out of range")
        at = bisect_right(self._starts, position) - 1
        return self._pieces[at][position - self._starts[at]]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(other) == self._len and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChainedIds({list(self)!r})"


@dataclass(frozen=True, slots=True)
class RememberedPrompt:
    token_ids: Sequence[int]
    messages: list[ChatMessage]  # the conversation the ids hold
    # The template's text of ``messages`` with a generation prompt (what extend renders as the
    # next turn's "prompt"), or None when it was rendered with other flags.
    text: str | None
    template_options: bytes  # what else the template read (``template_options``)
    owner: Owner
    ids_json: IdsJson  # ``token_ids``, as the answer that made it sent them

    @property
    def size(self) -> int:
        text = sys.getsizeof(self.text) if self.text is not None else 0
        # The messages hold about the text's characters once more. The ids of chained prompts
        # count in each (an over-count: they share their lists, and most of their ints).
        return _BYTES_PER_ID * len(self.token_ids) + 2 * text + len(self.ids_json)


@dataclass(frozen=True, slots=True)
class IdsJson:
    """Prompt ids as JSON: the runs of numbers (``b"1,2,3"``) that make the array, in order.
    A remembered prompt's next turn shares its runs and adds one, as its ids share their lists
    (``ChainedIds``): one array of a 68K-id history would hold another 400 KB every turn."""

    runs: tuple[bytes | memoryview, ...]

    @classmethod
    def of(cls, token_ids: Sequence[int]) -> IdsJson:
        array = orjson.dumps(token_ids if isinstance(token_ids, list) else list(token_ids))
        return cls((memoryview(array)[1:-1],) if token_ids else ())

    def then(self, token_ids: Sequence[int]) -> IdsJson:
        """These ids, then ``token_ids``."""
        return IdsJson((*self.runs, *IdsJson.of(token_ids).runs))

    def array(self) -> bytes:
        """The JSON array (one copy of the runs)."""
        parts: list[bytes | memoryview] = []
        for run in self.runs:
            parts += (b",", run)
        parts[:1] = [b"["]  # the first comma opens the array
        parts.append(b"]")
        return b"".join(parts)

    def __len__(self) -> int:
        return sum(map(len, self.runs))


def ids_json(token_ids: Sequence[int], prefix: RememberedPrompt | None = None) -> IdsJson:
    """``token_ids`` as JSON; where they start with ``prefix``'s ids, its JSON is reused for
    them and only the rest is encoded (a 68K-id prompt encodes in ~0.4 ms: a long
    conversation's turn pays for its new ids)."""
    if prefix is None:
        return IdsJson.of(token_ids)
    return prefix.ids_json.then(token_ids[len(prefix.token_ids) :])


def template_options(body: ChatCompletionRequest) -> bytes:
    """What a render reads besides the messages; a remembered prompt extends only under the
    same."""
    options = {
        "tools": [tool.model_dump(exclude_unset=True) for tool in body.tools or ()],
        "documents": body.documents,
        "chat_template": body.chat_template,
        "chat_template_kwargs": body.chat_template_kwargs,
        "add_special_tokens": body.add_special_tokens,
    }
    return orjson.dumps(options, option=orjson.OPT_SORT_KEYS)


def recorded_tools(options: str | bytes) -> list[dict[str, Any]]:
    """The tools of ``template_options`` (chat form), for a turn that continues under them."""
    return orjson.loads(options)["tools"]


class PromptMemory:
    """The remembered prompts, by handle; one per server process."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, RememberedPrompt] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def remember(self, prompt: RememberedPrompt) -> str | None:
        """The prompt's handle; None where this server remembers none (a client then sends
        the full form, as after an eviction)."""
        if self.max_bytes <= 0:
            return None
        handle = f"prompt-{secrets.token_hex(16)}"
        size = prompt.size
        with self._lock:
            self._entries[handle] = prompt
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.size
        return handle

    def remember_render(
        self,
        body: ChatCompletionRequest,
        token_ids: Sequence[int],
        messages: list[ChatMessage],
        text: str,
        owner: Owner,
        token_ids_json: IdsJson,
    ) -> str | None:
        """Remember what ``body`` rendered (``messages`` -> ``text`` -> ``token_ids``, sent as
        ``token_ids_json``); the text is kept only where it is the render extend needs of a
        history, the one a reply follows (a generation prompt, no continued final message)."""
        follows = body.add_generation_prompt and not body.continue_final_message
        kept_text = text if follows else None
        options = template_options(body)
        prompt = RememberedPrompt(token_ids, messages, kept_text, options, owner, token_ids_json)
        return self.remember(prompt)

    def recall(self, handle: str, owner: Owner) -> RememberedPrompt:
        with self._lock:
            prompt = self._entries.get(handle)
            if prompt is not None:
                self._entries.move_to_end(handle)
        if prompt is None or not (owner.control or prompt.owner.digest == owner.digest):
            raise InvalidRequest(UNKNOWN_HANDLE, "previous_prompt")
        return prompt

    @property
    def held_bytes(self) -> int:
        return self._bytes
