"""A tokenwire server whose model thinks: the real app (Qwen3's tokenizer, chat template and
parsers, sessions) over the project's fake engine scripted to think before it calls
``get_weather`` and, once a tool result is in the prompt, to think before it answers. The
test model's random weights never open a ``<think>`` block, and a harness's handling of
thinking blocks is what ``test_thinking_sessions`` checks.

    python tests/frameworks/thinking_server.py PORT
"""

from __future__ import annotations

import sys
from pathlib import Path

from tokenizers import Tokenizer

from tests.fake_engine import FakeEngine

API_KEY = "thinking-key"
IM_END = 151645  # Qwen3's end of turn
TOOL_RESPONSE = 151665  # <tool_response>: a tool result is in the prompt
THINK_AND_CALL = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
THINK_AND_ANSWER = "<think>\nThe tool said it.\n</think>\n\nIt is sunny in Paris."
FLAGS = (
    *("--served-model-name", "qwen3-tiny"),
    *("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"),
)


def make_engine(view: Path) -> FakeEngine:
    tokenizer = Tokenizer.from_file(str(view / "tokenizer.json"))
    call, answer = (
        [*tokenizer.encode(text, add_special_tokens=False).ids, IM_END]
        for text in (THINK_AND_CALL, THINK_AND_ANSWER)
    )
    engine = FakeEngine.for_model(view)
    engine.script = lambda _, prompt, __: answer if TOOL_RESPONSE in prompt else call
    return engine


if __name__ == "__main__":
    from serverbench import serve_fake_engine  # on the path tree_env gives the server

    flags = (*FLAGS, "--api-key", API_KEY)
    serve_fake_engine(int(sys.argv[1]), make_engine, *flags, model="qwen3-tiny")
