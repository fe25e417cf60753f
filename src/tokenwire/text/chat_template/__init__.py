"""Sandboxed chat templates that render exactly like transformers' ``apply_chat_template``.

Templates run in MiniJinja (Rust), not in Python: a template from a request cannot climb from a
string to ``__globals__`` the way jinja2 sandbox escapes do. MiniJinja's Python binding hides
underscore names but would expose the public attributes and methods of any Python object it is
given, so everything a template sees is made of exact builtin types (dict, list, str, numbers;
anything else is rebuilt from those, as transformers does), and the only Python callables it
gets are ``raise_exception``, ``strftime_now`` and a few filters that mirror jinja2's
(``tojson``, ``indent``, ``int``, ``float``, the ``iterable`` test). Fuel bounds the work one
render may do; see ``inputs.exact_builtins`` for what a template can still do to its inputs.

transformers renders with jinja2's ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)`` plus loop controls, a ``{% generation %}`` tag, a non-escaping ``tojson``
and those two globals; this package mirrors each of those so the text (and so the token ids) is
identical. A server-configured template MiniJinja cannot render may fall back to that jinja2
set-up (``engine == "jinja2"``); request templates never do.

Request templates (``--trust-request-chat-template``) render in worker processes with time,
memory and output caps (``workers``, ``worker``), and their amplifying filters refuse results
over the output cap (``caps``).

Modules: ``template`` (``ChatTemplate``: context building, engine choice), ``minijinja_env``
and ``jinja2_env`` (the two environments), ``filters`` (the callables templates get), ``caps``,
``workers`` and ``worker`` (request templates), ``inputs`` (what may reach a template),
``errors``, ``model_dir`` (a model's own template).
"""

from .errors import ChatTemplateError, TemplateLimitExceeded
from .model_dir import load_model_chat_template
from .template import DEFAULT_FUEL, ChatTemplate
from .workers import RequestTemplateWorkers, TemplateCompileError, TemplateLimits

__all__ = [
    "DEFAULT_FUEL",
    "ChatTemplate",
    "ChatTemplateError",
    "RequestTemplateWorkers",
    "TemplateCompileError",
    "TemplateLimitExceeded",
    "TemplateLimits",
    "load_model_chat_template",
]
