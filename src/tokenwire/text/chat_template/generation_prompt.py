"""Templates whose generation prompt is an appended block: proven from the template's syntax.

Extend compares the template's text of a history without the generation prompt with the text
it remembers of the same history with it. Most templates end with
``{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}`` and read the flag nowhere
else: then, for every conversation, the render with the flag is the render without it plus that
block's text, and that text depends on nothing the conversation sets. Where the syntax tree
shows exactly that, the render without the flag is the remembered text less the block's text,
and the history need not be rendered again (issue 33: a 68K-token history renders in ~1 ms).
Anything this module does not recognise is not proven, and the history is rendered as before.
"""

from __future__ import annotations

import jinja2
import jinja2.nodes as nodes

# What the block may read: names the conversation does not set. ``messages``, ``tools`` and
# ``documents`` are the conversation; a name the template assigns (set, for, macro, import) may
# hold anything computed from it.
_CONVERSATION_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# Tests that read only their operand (no callables, no clock).
_PLAIN_TESTS = frozenset(
    {"defined", "undefined", "none", "true", "false", "boolean", "string", "number", "sameas"}
)
_TEMPLATE_STRUCTURE = (nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport, nodes.Block)


def appends_generation_prompt(environment: jinja2.Environment, source: str) -> bool:
    """Whether ``source`` (parsed as ``environment`` parses it) reads ``add_generation_prompt``
    only as the whole test of its last top-level statement, an ``if`` without ``elif``/``else``
    whose body writes only constants and context variables the template never assigns, under
    plain tests of those: the render with the flag is then the render without it plus that
    body's text, for every conversation."""
    try:
        tree = environment.parse(source)
    except jinja2.TemplateError:
        return False
    body = list(tree.body)
    while body and _writes_nothing(body[-1]):
        body.pop()
    if not body or any(True for _ in tree.find_all(_TEMPLATE_STRUCTURE)):
        return False
    last = body[-1]
    if not (
        isinstance(last, nodes.If)
        and isinstance(last.test, nodes.Name)
        and last.test.name == "add_generation_prompt"
        and not last.elif_
        and not last.else_
    ):
        return False
    flag_reads = [n for n in tree.find_all(nodes.Name) if n.name == "add_generation_prompt"]
    if flag_reads != [last.test]:
        return False
    assigned = _assigned_names(tree)
    return all(_constant_statement(statement, assigned) for statement in last.body)


def _writes_nothing(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Output) and all(
        isinstance(part, nodes.TemplateData) and part.data == "" for part in node.nodes
    )


def _assigned_names(tree: nodes.Template) -> set[str]:
    names = {n.name for n in tree.find_all(nodes.Name) if n.ctx in ("store", "param")}
    names.update(n.name for n in tree.find_all(nodes.NSRef))
    names.update(n.name for n in tree.find_all(nodes.Macro))
    return names


def _constant_statement(node: nodes.Node, assigned: set[str]) -> bool:
    if isinstance(node, nodes.Output):
        return all(
            isinstance(part, nodes.TemplateData) or _context_value(part, assigned)
            for part in node.nodes
        )
    if isinstance(node, nodes.If):
        return (
            _context_value(node.test, assigned)
            and all(_constant_statement(n, assigned) for n in node.body)
            and all(_constant_statement(n, assigned) for n in node.elif_)
            and all(_constant_statement(n, assigned) for n in node.else_)
        )
    return False


def _context_value(node: nodes.Node, assigned: set[str]) -> bool:
    """An expression of constants and unassigned context variables, without calls, filters,
    attribute lookups or anything else that could reach the conversation."""
    if isinstance(node, nodes.Const):
        return True
    if isinstance(node, nodes.Name):
        return node.name not in _CONVERSATION_NAMES and node.name not in assigned
    if isinstance(node, nodes.Not):
        return _context_value(node.node, assigned)
    if isinstance(node, (nodes.And, nodes.Or)):
        return _context_value(node.left, assigned) and _context_value(node.right, assigned)
    if isinstance(node, nodes.Test):
        return (
            node.name in _PLAIN_TESTS
            and not node.kwargs
            and node.dyn_args is None
            and node.dyn_kwargs is None
            and _context_value(node.node, assigned)
            and all(_context_value(arg, assigned) for arg in node.args)
        )
    if isinstance(node, nodes.Compare):
        return _context_value(node.expr, assigned) and all(
            _context_value(operand.expr, assigned) for operand in node.ops
        )
    return False
