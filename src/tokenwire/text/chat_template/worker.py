"""A request-template worker process: renders the templates its parent sends, one at a time.

Run as ``python -m tokenwire.text.chat_template.worker`` by ``workers.RequestTemplateWorkers``.
Every frame, both ways, is 8 bytes of big-endian length then ASCII JSON (lone surrogates
survive as escapes). The first frame sets the worker up (special tokens and caps); the worker
answers ``{"ready": true}``, then one answer per render: ``{"text"}`` or ``{"error", "stage"}``
(``compile``, ``render`` or ``limit``). The memory cap applies from after the imports, so it is what
rendering may add; a CPU-time cap per render stops a render even if the parent is gone.
"""

from __future__ import annotations

import math
import resource
import signal
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .errors import ChatTemplateError, TemplateLimitExceeded
from .template import ChatTemplate
from .workers import encode_frame, read_frame

# Templates compiled once per worker; least recently used out.
MAX_CACHED_TEMPLATES = 16


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is for the server
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames may reach the parent's pipe
    setup = read_frame(stdin)
    if setup is None:
        return
    _cap_memory(int(setup["memory_bytes"]))
    stdout.write(encode_frame({"ready": True}))
    stdout.flush()
    templates: OrderedDict[str, ChatTemplate] = OrderedDict()
    while (request := read_frame(stdin)) is not None:
        _cap_cpu(float(setup["timeout_s"]))
        stdout.write(encode_frame(_render(templates, setup, request)))
        stdout.flush()


def _render(
    templates: OrderedDict[str, ChatTemplate], setup: dict[str, Any], request: dict[str, Any]
) -> dict[str, Any]:
    source = request["source"]
    template = templates.get(source)
    if template is None:
        try:
            template = ChatTemplate(
                source,
                special_tokens=setup["special_tokens"],
                allow_jinja2_fallback=False,
                max_chars=int(setup["max_chars"]),
            )
        except ChatTemplateError as exc:
            return {"error": str(exc), "stage": "compile"}
        templates[source] = template
        while len(templates) > MAX_CACHED_TEMPLATES:
            templates.popitem(last=False)
    else:
        templates.move_to_end(source)
    try:
        text = template.render(
            request["messages"],
            tools=request["tools"],
            add_generation_prompt=request["add_generation_prompt"],
            continue_final_message=request["continue_final_message"],
            **request["template_kwargs"],
        )
    except TemplateLimitExceeded as exc:
        return {"error": str(exc), "stage": "limit"}
    except ChatTemplateError as exc:
        return {"error": str(exc), "stage": "render"}
    return {"text": text}


def _cap_memory(extra_bytes: int) -> None:
    """Address space: what the worker holds now plus ``extra_bytes`` (Linux; elsewhere none)."""
    status = Path("/proc/self/status")
    if not status.exists():
        return
    for line in status.read_text().splitlines():
        if line.startswith("VmSize:"):
            current = int(line.split()[1]) * 1024
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (current + extra_bytes, hard))
            return


def _cap_cpu(timeout_s: float) -> None:
    """SIGXCPU ends this process once the next render used twice its time cap of CPU."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used + 2 * timeout_s + 1)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


if __name__ == "__main__":
    main()
