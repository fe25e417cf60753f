"""How template failures reach callers: one ``ChatTemplateError`` with a client-safe message."""

from __future__ import annotations

import jinja2
import minijinja


class ChatTemplateError(ValueError):
    """A template failed to compile or render, or called ``raise_exception()``.

    The message is the template's own (or the engine's short description): the api layer
    returns it to the client as a 400.
    """


class TemplateLimitExceeded(ChatTemplateError):
    """A request template went over one of its caps (output size, time, memory); the message
    names the cap and its flag."""


MEMORY_CAP = "request template over the memory cap (--request-template-memory-bytes)"


class TemplateRaised(Exception):
    """What ``raise_exception()`` throws: minijinja passes Python exceptions through unchanged."""


def as_template_error(exc: BaseException) -> ChatTemplateError:
    """The short, client-safe message for any failure inside compile or render."""
    if isinstance(exc, ChatTemplateError):
        return exc
    if isinstance(exc, TemplateRaised):
        return ChatTemplateError(str(exc))
    if isinstance(exc, minijinja.TemplateError):
        return ChatTemplateError(exc.message)  # "what (in chat_template:LINE)", no context dump
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return ChatTemplateError(f"{exc.message} (line {exc.lineno})")
    if isinstance(exc, jinja2.TemplateError):
        return ChatTemplateError(str(exc))
    if isinstance(exc, RecursionError):
        return ChatTemplateError("Chat template recursed too deeply.")
    if isinstance(exc, MemoryError):  # only request templates run under a memory cap
        return TemplateLimitExceeded(MEMORY_CAP)
    return ChatTemplateError(f"Chat template failed: {type(exc).__name__}: {exc}")


def is_panic(exc: BaseException) -> bool:
    # pyo3's PanicException derives from BaseException, so ``except Exception`` misses it.
    return type(exc).__name__ == "PanicException"
