"""``deepseek_r1`` reasoning parser: ``<think>`` blocks, where the opening tag may be missing.

The R1 template ends the prompt with ``<think>\\n``, so outputs usually carry only
``</think>``. With ``prompt_in_think`` known the output is reasoning from the start; without it
a ``</think>`` still marks everything before it as reasoning (vLLM's behaviour), and output
with neither tag is content.
"""

from __future__ import annotations

from .think import ThinkTagParser


class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = "deepseek_r1"
    close_without_open = True
    tool_call_ends_reasoning = False
