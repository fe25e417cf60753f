"""Each peer's structured-output fields as one ``Constraint`` (no grammar engine imported here).

The one internal wire form is vLLM's ``structured_outputs`` object (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``, ``structural_tag`` and its options): chat's
``response_format`` and vLLM's older ``guided_*`` fields, SGLang's ``json_schema`` / ``regex`` /
``ebnf``, Anthropic's ``output_format`` and Responses' ``text.format`` all become one, so that
render -> generate carries it and every route compiles it the same way.

Every refusal is a ``ValueError`` whose message names the field (a 400 before generating).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

ConstraintKind = Literal["json", "regex", "choice", "grammar", "tool_calls"]
# Reasoning before the constrained output (a reasoning parser is on): none; an optional
# ``<think>...</think>`` block the model may open; or the rest of one the prompt opened.
Reasoning = Literal["none", "optional", "open"]
# What a schema, regex or grammar may weigh as text: bigger ones are refused before compiling.
MAX_CONSTRAINT_BYTES = 256 * 1024
MAX_CHOICES = 1024
# vLLM's StructuredOutputsParams: the constraint kinds (exactly one is set) and the options.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
OPTIONS = (
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
    "_backend",
    "_backend_was_auto",
)
# response_format / text.format types served, and those refused (they would change the tokens).
FORMAT_TYPES = ("text", "json_object", "json_schema")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match. ``value``: the JSON schema as canonical JSON text
    (``json``), the regex or grammar text, the choices as a JSON list (``choice``), or the
    forced tool calls (``tool_calls``, ``structured.tool_choice``). ``any_whitespace``: JSON may
    carry any whitespace between tokens (vLLM's default), else compact separators only.
    ``reasoning``: the constraint starts after the model's reasoning, as vLLM's does with a
    reasoning parser (a request's own ``grammar`` is taken as written: always "none"). Equal
    constraints compile once (``key``)."""

    kind: ConstraintKind
    value: str
    any_whitespace: bool = True
    additional_properties: bool = True
    whitespace_pattern: str | None = None
    reasoning: Reasoning = "none"

    @property
    def key(self) -> tuple[Any, ...]:
        return (
            self.kind,
            self.value,
            self.any_whitespace,
            self.additional_properties,
            self.whitespace_pattern,
            self.reasoning,
        )


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _sized(text: str, param: str) -> str:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
        raise ValueError(f"{param} is larger than {MAX_CONSTRAINT_BYTES} bytes")
    return text


def _schema(value: Any, param: str) -> str:
    """A JSON schema given as an object, a boolean or JSON text, as canonical JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(_sized(value, param))
        except ValueError as exc:
            raise ValueError(f"{param} is not valid JSON: {exc}") from None
    if not isinstance(value, dict | bool):
        raise ValueError(f"{param} must be a JSON schema (an object or a boolean)")
    return _sized(_canonical(value), param)


def constraint_of(fields: dict[str, Any], param: str = "structured_outputs") -> Constraint:
    """vLLM's ``structured_outputs`` (or ``guided_decoding``) object as a ``Constraint``."""
    unknown = [k for k in fields if k not in KINDS and k not in OPTIONS]
    if unknown:
        raise ValueError(f"{param}.{unknown[0]} is not a structured outputs field")
    kinds = [k for k in KINDS if fields.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(
            f"{param} needs exactly one of {', '.join(KINDS)}; got "
            f"{', '.join(kinds) if kinds else 'none'}"
        )
    kind = kinds[0]
    value = fields[kind]
    where = f"{param}.{kind}"
    any_ws = not fields.get("disable_any_whitespace", False)
    additional = not fields.get("disable_additional_properties", False)
    pattern = fields.get("whitespace_pattern")
    if pattern is not None and not isinstance(pattern, str):
        raise ValueError(f"{param}.whitespace_pattern must be a string")
    if kind == "structural_tag":
        raise ValueError(f"{where} is not supported by tokenwire yet")
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"{where} must be true")
        return Constraint("json", '{"type":"object"}', any_ws, additional, pattern)
    if kind == "json":
        return Constraint("json", _schema(value, where), any_ws, additional, pattern)
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError(f"{where} must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise ValueError(f"{where} has more than {MAX_CHOICES} choices")
        return Constraint("choice", _sized(_canonical(value), where))
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string")
    return Constraint(kind, _sized(value, where))


def response_format_fields(value: Any, param: str = "response_format") -> dict[str, Any] | None:
    """Chat's ``response_format``, Responses' ``text.format`` or Anthropic's ``output_format``
    as ``structured_outputs`` (None: free text). The schema sits in ``json_schema.schema``
    (chat) or beside ``type`` (Responses, Anthropic)."""
    if not isinstance(value, dict):
        raise ValueError(f"{param} must be an object")
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        raise ValueError(
            f"{param}.type {kind!r} is not supported by tokenwire (supported: "
            f"{', '.join(FORMAT_TYPES)})"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    nested = value.get("json_schema")
    if nested is not None and not isinstance(nested, dict):
        raise ValueError(f"{param}.json_schema must be an object")
    where = f"{param}.json_schema.schema" if nested is not None else f"{param}.schema"
    schema = (nested or value).get("schema")
    if schema is None:
        raise ValueError(f"{where} is required for type json_schema")
    return {"json": schema}


def guided_fields(
    guided_json: Any = None,
    guided_regex: Any = None,
    guided_choice: Any = None,
    guided_grammar: Any = None,
) -> dict[str, Any] | None:
    """vLLM's older top-level ``guided_*`` request fields as ``structured_outputs``."""
    given = {
        "json": guided_json,
        "regex": guided_regex,
        "choice": guided_choice,
        "grammar": guided_grammar,
    }
    set_ = {k: v for k, v in given.items() if v is not None}
    if not set_:
        return None
    if len(set_) > 1:
        names = ", ".join(f"guided_{k}" for k in set_)
        raise ValueError(f"only one structured output constraint may be set; got {names}")
    return set_


def one_of(sources: dict[str, dict[str, Any] | None]) -> dict[str, Any] | None:
    """The one ``structured_outputs`` the request's fields make (several: a 400 naming them)."""
    given = {name: fields for name, fields in sources.items() if fields}
    if len(given) > 1:
        raise ValueError(
            f"only one structured output constraint may be set; got {', '.join(given)}"
        )
    return next(iter(given.values()), None)
