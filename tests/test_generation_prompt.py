"""The generation prompt as an appended block, proven from a template's syntax: where it is
proven, every render with ``add_generation_prompt`` is the render without it plus
``appended_generation_prompt``'s text (checked on every real template of llama.cpp's set and
the conversations of test_chat_template); where a template could write anything else, nothing
is proven."""

from __future__ import annotations

import copy

import pytest

from tests.test_chat_template import CASES, TEMPLATE_KWARGS, _ours, _template_names
from tokenwire.text.chat_template import ChatTemplate
from tokenwire.text.chat_template.generation_prompt import appends_generation_prompt
from tokenwire.text.chat_template.jinja2_env import jinja2_environment

# The model families extend runs on most: each writes its generation prompt as the last block.
PROVEN = {
    "Qwen-Qwen3-0.6B.jinja",
    "Qwen-Qwen2.5-7B-Instruct.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
}
# R1 writes it only when the last turn was no tool result (``ns.is_tool``): not a constant.
NOT_PROVEN = {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"}
KWARGS = ({}, {"enable_thinking": False}, {"enable_thinking": True})


def proven(source: str) -> bool:
    return appends_generation_prompt(jinja2_environment(), source)


@pytest.mark.parametrize("name", _template_names())
def test_proven_templates_append_their_generation_prompt(name: str) -> None:
    template = _ours(name)
    assert (name in PROVEN) <= proven(template.source), name
    assert not (name in NOT_PROVEN and proven(template.source)), name
    if not proven(template.source):
        assert template.appended_generation_prompt() is None
        return
    extra = TEMPLATE_KWARGS.get(name, {})
    for kwargs in KWARGS:
        appended = template.appended_generation_prompt(**extra, **kwargs)
        if appended is None:  # its one-message probe does not render (e.g. wants a system)
            continue
        for case in CASES:
            if case.continue_final_message:
                continue
            render = {"tools": case.tools, **extra, **kwargs}
            try:
                without = template.render(copy.deepcopy(case.messages), **render)
            except Exception:
                continue
            with_prompt = template.render(
                copy.deepcopy(case.messages), add_generation_prompt=True, **render
            )
            assert with_prompt == without + appended, f"{name} {case.name} {kwargs}"


def test_qwen3_generation_prompt_follows_enable_thinking() -> None:
    template = _ours("Qwen-Qwen3-0.6B.jinja")
    assert template.appended_generation_prompt() == "<|im_start|>assistant\n"
    assert template.appended_generation_prompt(enable_thinking=False) == (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_the_generation_prompt_is_found_once_per_kwargs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its text depends on the template kwargs alone (what the proof shows): each kwargs'
    is rendered once, whatever order their keys come in, and kwargs that are not JSON are
    rendered each time."""
    template = _ours("Qwen-Qwen3-0.6B.jinja")
    renders: list[dict] = []
    real = template._generation_prompt
    monkeypatch.setattr(template, "_generation_prompt", lambda k: renders.append(k) or real(k))
    off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for _ in range(3):
        assert template.appended_generation_prompt(enable_thinking=False, x=1) == off
        assert template.appended_generation_prompt(x=1, enable_thinking=False) == off
        assert template.appended_generation_prompt(x=1) == "<|im_start|>assistant\n"
    assert renders == [{"enable_thinking": False, "x": 1}, {"x": 1}]
    assert template.appended_generation_prompt(x={1: 2}) == "<|im_start|>assistant\n"
    assert template.appended_generation_prompt(x={1: 2}) == "<|im_start|>assistant\n"
    assert len(renders) == 4


LAST = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.mark.parametrize(
    "source",
    [
        # The flag read elsewhere, or not as the whole test of the last block.
        "{% if add_generation_prompt %}x{% endif %}"
        + LAST
        + "{% if add_generation_prompt %}a{% endif %}",
        LAST + "{% if add_generation_prompt and messages %}a{% endif %}",
        LAST + "{% if not add_generation_prompt %}a{% endif %}",
        LAST + "{{ add_generation_prompt }}",
        # An else or elif branch writes when the flag is off.
        LAST + "{% if add_generation_prompt %}a{% else %}b{% endif %}",
        LAST + "{% if add_generation_prompt %}a{% elif tools %}b{% endif %}",
        # Something written after the block.
        LAST + "{% if add_generation_prompt %}a{% endif %}\n\ntail",
        LAST + "{% if add_generation_prompt %}a{% endif %}{{ eos_token }}",
        # The block reads the conversation or what the template computed from it.
        LAST + "{% if add_generation_prompt %}{{ messages[-1].role }}{% endif %}",
        LAST + "{% if add_generation_prompt %}{{ m }}{% endif %}",
        "{% set ns = namespace(t=false) %}" + LAST + "{% if add_generation_prompt %}"
        "{% if ns.t %}a{% endif %}{% endif %}",
        "{% set think = messages|length %}" + LAST + "{% if add_generation_prompt %}"
        "{{ think }}{% endif %}",
        LAST + "{% if add_generation_prompt %}{% if tools %}a{% endif %}{% endif %}",
        # Calls, filters, lookups and statements other than output and if.
        LAST + "{% if add_generation_prompt %}{{ strftime_now('%Y') }}{% endif %}",
        LAST + "{% if add_generation_prompt %}{{ bos_token|upper }}{% endif %}",
        LAST + "{% if add_generation_prompt %}{{ bos_token.upper() }}{% endif %}",
        LAST + "{% if add_generation_prompt %}{% set x = 1 %}{{ x }}{% endif %}",
        LAST + "{% if add_generation_prompt %}{% for i in range(2) %}a{% endfor %}{% endif %}",
        "{% macro g() %}x{% endmacro %}" + LAST + "{% if add_generation_prompt %}{{ g() }}"
        "{% endif %}",
        # Not a template jinja2 parses.
        LAST + "{% if add_generation_prompt %}",
    ],
)
def test_what_could_write_more_is_not_proven(source: str) -> None:
    assert not proven(source)


@pytest.mark.parametrize(
    "source",
    [
        LAST + "{% if add_generation_prompt %}<a>{% endif %}",
        LAST + "{%- if add_generation_prompt %}\n    {{- '<a>' }}\n{%- endif %}\n",
        LAST + "{% if add_generation_prompt %}{{ bos_token }}{% if enable_thinking is defined "
        "and enable_thinking is false %}<t/>{% elif mode == 'x' %}x{% endif %}{% endif %}",
    ],
)
def test_plain_blocks_are_proven(source: str) -> None:
    assert proven(source)
    template = ChatTemplate(source, special_tokens={"bos_token": "<s>"})
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for kwargs in ({}, {"enable_thinking": False}, {"mode": "x"}):
        appended = template.appended_generation_prompt(**kwargs)
        assert appended
        expected = template.render(messages, add_generation_prompt=True, **kwargs)
        assert expected == template.render(messages, **kwargs) + appended
