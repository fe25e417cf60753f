"""``qwen3`` reasoning parser: ``<think>`` blocks, and ``<tool_call>`` as an implicit end.

Qwen3 opens ``<think>`` itself (older templates) or gets it from the prompt (Qwen3.5, and
``enable_thinking=false`` puts a closed empty block in the prompt: all output is content). The
caller says which through ``prompt_in_think``. A ``</think>`` with no opening tag and no open
block in the prompt is plain content text.
"""

from __future__ import annotations

from .think import ThinkTagParser


class Qwen3ReasoningParser(ThinkTagParser):
    name = "qwen3"
    close_without_open = False
    tool_call_ends_reasoning = True
