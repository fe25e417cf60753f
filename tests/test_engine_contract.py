"""Every engine class conforms to the engine contract (``engine.base``), checked on the classes
alone (no model, no vLLM): the engines drifted from the protocols before, and nothing else
compares them.

For each protocol member an engine class must have it: a method with the protocol's parameter
names, kinds and defaults, async where the protocol's is (``generate``: an async generator, or a
plain method returning an async iterator); a data member as a class attribute, a property, or
an attribute ``__init__`` assigns. And an engine has no public method the protocols lack, but
those listed below as its own.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

from tests.fake_engine import FakeEngine
from tokenwire.engine.base import AdapterEngine, GenerationEngine, WeightEngine
from tokenwire.engine.hf.engine import HFEngine
from tokenwire.engine.vllm.engine import VLLMEngine

PROTOCOLS: tuple[type, ...] = (GenerationEngine, WeightEngine, AdapterEngine)
# Public methods and properties an engine has beyond the protocols, and why.
OWN_MEMBERS: dict[type, frozenset[str]] = {
    HFEngine: frozenset(),
    VLLMEngine: frozenset(),
    # The fake's test helpers: sizing it like a model, its pause state, a fresh state per test,
    # fault injection.
    FakeEngine: frozenset({"for_model", "paused", "reset", "die"}),
}
ENGINES = tuple(OWN_MEMBERS)


def protocol_methods(protocol: type) -> dict[str, Callable[..., Any]]:
    return {
        name: value
        for name, value in vars(protocol).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }


def protocol_data(protocol: type) -> list[str]:
    return list(inspect.get_annotations(protocol))


def init_assigned(cls: type) -> set[str]:
    """The attributes ``cls.__init__`` assigns on ``self``."""
    init = vars(cls).get("__init__")
    if init is None:
        return set()
    tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    names: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return names


def call_kind(function: Callable[..., Any]) -> str:
    if inspect.isasyncgenfunction(function):
        return "async generator"
    if inspect.iscoroutinefunction(function):
        return "async"
    return "sync"


def parameters(function: Callable[..., Any]) -> str:
    """The parameters' names, kinds and defaults (``(self, mode, *, clear_cache=False)``):
    annotations may differ, the call may not."""
    signature = inspect.signature(function)
    bare = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=bare, return_annotation=signature.empty))


def returns_async_iterator(function: Callable[..., Any]) -> bool:
    return str(inspect.signature(function).return_annotation).startswith("AsyncIterator[")


def check_method(engine: type, name: str, declared: Callable[..., Any]) -> list[str]:
    where = f"{engine.__name__}.{name}"
    member = inspect.getattr_static(engine, name, None)
    if member is None:
        return [f"{where} is missing (declared by the protocol)"]
    if not inspect.isfunction(member):
        return [f"{where} is a {type(member).__name__}; the protocol declares a method"]
    problems = []
    if parameters(member) != parameters(declared):
        problems.append(f"{where}{parameters(member)}; the protocol's is {parameters(declared)}")
    want, got = call_kind(declared), call_kind(member)
    if want == "sync" and returns_async_iterator(declared):
        if got == "async" or (got == "sync" and not returns_async_iterator(member)):
            problems.append(f"{where} must be an async generator or return an AsyncIterator")
    elif got != want:
        problems.append(f"{where} is {got}; the protocol's is {want}")
    return problems


def check_data(engine: type, name: str) -> list[str]:
    member = inspect.getattr_static(engine, name, None)
    if inspect.isfunction(member):
        return [f"{engine.__name__}.{name} is a method; the protocol declares a data member"]
    if member is not None or name in init_assigned(engine):
        return []
    return [
        f"{engine.__name__}.{name} is missing (declared by the protocol): no class attribute, "
        "property or assignment in __init__"
    ]


def public_methods(engine: type) -> set[str]:
    """Public functions, properties, class and static methods defined by ``engine`` itself."""
    kinds = (property, classmethod, staticmethod)
    return {
        name
        for name, value in vars(engine).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, kinds))
    }


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_engine_has_every_protocol_member(engine: type, protocol: type) -> None:
    problems: list[str] = []
    for name, declared in protocol_methods(protocol).items():
        problems += check_method(engine, name, declared)
    for name in protocol_data(protocol):
        problems += check_data(engine, name)
    if problems:
        pytest.fail(f"{engine.__name__} breaks {protocol.__name__}:\n" + "\n".join(problems))


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_engine_has_no_public_method_outside_the_contract(engine: type) -> None:
    declared = {name for protocol in PROTOCOLS for name in protocol_methods(protocol)}
    declared |= {name for protocol in PROTOCOLS for name in protocol_data(protocol)}
    extra = sorted(public_methods(engine) - declared - OWN_MEMBERS[engine])
    if extra:
        pytest.fail(
            f"{engine.__name__} has public methods no protocol declares: {', '.join(extra)} "
            "(make them private, add them to a protocol, or list them in OWN_MEMBERS)"
        )


def test_the_protocols_are_what_this_test_reads() -> None:
    """The checks above see every protocol member (a protocol without any would pass them)."""
    assert all(protocol_methods(p) for p in PROTOCOLS)
    assert "eos_token_ids" in protocol_data(GenerationEngine)
