"""/v1/chat/completions through the real `openai` client on the real SmolLM2 server: a real
answer, and the same request made step by step. Formatting, streaming, parsers and errors are in
``test_fast_openai``."""

from __future__ import annotations

import httpx
import openai

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_completion_answers_paris(
    smollm2_openai: openai.OpenAI, smollm2: httpx.Client
) -> None:
    completion = smollm2_openai.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=PARIS,
        temperature=0,
        max_tokens=24,
        logprobs=True,
        top_logprobs=2,
    )
    choice = completion.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.message.content
    tokens = [entry.token for entry in choice.logprobs.content]
    # The logprob tokens join to the content plus the stop token's text.
    assert "".join(tokens) == choice.message.content + "<|im_end|>"
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    # The same request made step by step: render -> generate -> derender.
    rendered = smollm2.post(
        "/v1/chat/completions/render", json={"messages": PARIS, "temperature": 0, "max_tokens": 24}
    ).json()
    generated = smollm2.post("/inference/v1/generate", json=rendered).json()
    derendered = smollm2.post(
        "/v1/chat/completions/derender",
        json={
            "generate_response": generated,
            "prompt_token_ids": rendered["token_ids"],
            "chat_request": {"messages": PARIS},
        },
    ).json()
    assert derendered["choices"][0]["message"]["content"] == choice.message.content
    assert completion.usage.prompt_tokens == len(rendered["token_ids"])
