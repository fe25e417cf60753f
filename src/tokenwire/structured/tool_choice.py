"""A request's tool choice as an output constraint over the tool parser's own call format.

``tool_choice: "required"`` or a named tool (chat, Responses), Anthropic's ``any`` / ``tool``,
and ``parallel_tool_calls: false`` / ``disable_parallel_tool_use`` are promises about the
output. A template only asks the model to keep them; a grammar makes it (vLLM and SGLang do the
same). The grammar spells calls exactly as the server's tool parser reads them and as the
model's template renders them back (hermes: ``<tool_call>\\n{"name": ..., "arguments": ...}
\\n</tool_call>``, the tags as their single tokens; llama3_json: ``{"name": ...,
"parameters": ...}`` separated by ``; ``), so the parser always finds the calls and the sampled
ids are the ones a trainer would render.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenwire.protocol.chat import Tool
from tokenwire.structured.spec import Constraint

# Tool parsers whose call format the grammar can spell, and each one's arguments key.
ARGUMENTS_KEYS = {"hermes": "arguments", "llama3_json": "parameters"}


@dataclass(frozen=True, slots=True)
class ToolForcing:
    """What a request's tool choice demands of its output, beyond what a template asks."""

    names: tuple[str, ...]  # the tools a call may name
    at_least_one: bool  # "required", a named tool, Anthropic's "any" / "tool"
    at_most_one: bool  # parallel_tool_calls false / disable_parallel_tool_use


def tool_forcing(
    tools: Sequence[Tool] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
) -> ToolForcing | None:
    """The forcing a request's tool fields make (None: the model chooses freely). A named tool
    that is not offered, or a forcing choice without ``tools``, is a ``ValueError`` (a 400):
    the promise could not be kept, and dropping it silently would answer text (vLLM refuses
    both; an empty ``tools`` list with ``required`` forces nothing, as OpenAI and vLLM read it)."""
    if tool_choice == "none":
        return None
    if tools is None and (tool_choice == "required" or isinstance(tool_choice, dict)):
        raise ValueError("tool_choice forces a tool call, but the request offers no tools")
    if not tools and not isinstance(tool_choice, dict):
        return None
    tools = tools or ()
    names = tuple(tool.function.name for tool in tools)
    at_most_one = parallel_tool_calls is False
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError("tool_choice.function.name is required for a named tool choice")
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not in tools")
        return ToolForcing((name,), at_least_one=True, at_most_one=at_most_one)
    if tool_choice == "required":
        return ToolForcing(names, at_least_one=True, at_most_one=at_most_one)
    if at_most_one:  # "auto" (or unset) with parallel calls off: text, or one call
        return ToolForcing(names, at_least_one=False, at_most_one=True)
    return None


def tool_calls_constraint(
    tool_parser: str, tools: Sequence[Tool], forcing: ToolForcing
) -> Constraint:
    """The constraint for ``forcing`` in ``tool_parser``'s call format; ``ValueError`` for a
    parser whose format no grammar here spells."""
    if tool_parser not in ARGUMENTS_KEYS:
        raise ValueError(
            f"tool_choice cannot be enforced with the {tool_parser!r} tool parser (enforced "
            f"with: {', '.join(ARGUMENTS_KEYS)})"
        )
    parameters = {tool.function.name: tool.function.parameters for tool in tools}
    spec = {
        "format": tool_parser,
        "tools": [[name, parameters[name] or {"type": "object"}] for name in forcing.names],
        "at_least_one": forcing.at_least_one,
        "at_most_one": forcing.at_most_one,
    }
    return Constraint("tool_calls", json.dumps(spec, sort_keys=True, separators=(",", ":")))


def tool_calls_lark(
    spec_json: str, json_options: dict[str, Any], added_tokens: frozenset[str] = frozenset()
) -> str:
    """The Lark grammar (llguidance's dialect) of a ``tool_calls`` constraint's value.

    The call object's keys come in the template's order (name first); each tool's parameters
    schema is applied leniently (keywords the grammar engine cannot enforce are skipped, not
    refused: a tool list is the harness's, not a promise about this output). A tag that is one
    of ``added_tokens`` is matched as that token, never spelled in pieces."""
    spec = json.loads(spec_json)
    arguments = ARGUMENTS_KEYS[spec["format"]]
    options = {**json_options, "lenient": True}
    alternatives = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, arguments: _object_schema(params, index)},
            "required": ["name", arguments],
            "additionalProperties": False,
        }
        for index, (name, params) in enumerate(spec["tools"])
    ]
    body = json.dumps({"anyOf": alternatives, "x-guidance": options})
    if spec["format"] == "hermes":
        open_, close = (_tag(tag, added_tokens) for tag in ("<tool_call>", "</tool_call>"))
        call = f'call: {open_} "\\n" call_json "\\n" {close}'
        separator = '"\\n"'
    else:
        call = "call: call_json"
        separator = '";" " "?'
    calls = "call" if spec["at_most_one"] else f"call ({separator} call)*"
    if spec["at_least_one"]:
        start = calls
    elif spec["format"] == "hermes":
        start = "TEXT call?"  # auto, one call at most: prose, then perhaps one call
    else:
        start = "TEXT_NOT_JSON | call"
    return "\n".join(
        (
            f"start: {start}",
            call,
            f"call_json: %json {body}",
            "TEXT: /(?s:.*)/",
            # llama3_json reads output that opens with "{" as calls: text must not.
            "TEXT_NOT_JSON: /(?s:\\s*[^\\s{].*)?/",
        )
    )


def _tag(tag: str, added_tokens: frozenset[str]) -> str:
    return tag if tag in added_tokens else json.dumps(tag)


def _object_schema(params: Any, index: int) -> Any:
    """A tool's parameters schema (a JSON object whatever it says, as the parsers want), as a
    schema resource of its own: its local ``$ref`` pointers (``#/$defs/...``, pydantic's for
    every enum and nested model; ``#/definitions/...``; ``#``) name its own root, and nested
    in the grammar's document they would name that document's (a 400: "Pointer '/$defs/...'
    does not exist"). An ``$id`` makes the tool's root theirs again; one it has is kept."""
    if not isinstance(params, dict) or not params:
        return {"type": "object"}
    if "$id" in params:
        return params
    return {"$id": f"urn:tokenwire:tool:{index}", **params}
