"""tokenwire.client: every endpoint through the sync and the async client, and typed errors."""

from __future__ import annotations

import asyncio

import pytest

from tests.chat_fixtures import TOOLS
from tests.conftest import API_KEY, CONTROL_KEY, Server, free_port
from tokenwire.client import (
    APIConnectionError,
    AsyncClient,
    AsyncFleet,
    AuthenticationError,
    BadRequestError,
    ChatCompletion,
    Client,
    Extension,
    Fleet,
    NotFoundError,
    Prompt,
)

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
SAMPLING = {"max_tokens": 6, "temperature": 1.0, "seed": 7, "logprobs": True}


@pytest.fixture(scope="module")
def client(qwen3_server: Server):
    with Client(qwen3_server.url, api_key=API_KEY) as client:
        yield client


def test_info_and_tokens(client: Client) -> None:
    assert client.health() is True
    assert [card.id for card in client.models()] == ["qwen3-tiny", "qwen3-alias"]
    assert client.models()[0].max_model_len == 4096
    assert client.version()
    tokens = client.tokenize("Hello world", return_token_strs=True)
    assert tokens.count == len(tokens.tokens) == 2 and tokens.token_strs == ["Hello", "Ġworld"]
    assert client.detokenize(tokens.tokens) == "Hello world"
    chat = client.tokenize_chat(MESSAGES, tools=TOOLS)
    assert chat.tokens == client.render_chat(MESSAGES, tools=TOOLS).token_ids


def test_render_generate_derender_extend(client: Client) -> None:
    prompt = client.render_chat(MESSAGES, tools=TOOLS, max_tokens=6, logprobs=True)
    assert isinstance(prompt, Prompt) and prompt.request_id.startswith("chatcmpl-")
    result = client.generate(prompt, {"seed": 3})
    choice = result.choices[0]
    assert result.request_id == prompt.request_id
    assert 1 <= len(choice.token_ids) <= 6
    assert len(choice.token_logprobs) == len(choice.token_ids)
    same = client.generate(prompt.token_ids, {**prompt.sampling_params, "seed": 3})
    assert same.choices[0].token_ids == choice.token_ids

    usage = {"include_usage": True}
    streamed = list(client.generate_stream(prompt, {"seed": 3}, stream_options=usage))
    assert [i for chunk in streamed for c in chunk.choices for i in c.token_ids] == (
        choice.token_ids
    )
    assert streamed[-1].usage is not None

    completion = client.derender_chat(
        result, prompt_token_ids=prompt.token_ids, chat_request={"messages": MESSAGES}
    )
    assert isinstance(completion, ChatCompletion)
    message = completion.choices[0].message
    assert completion.id == prompt.request_id and message.role == "assistant"
    assert "reasoning" not in message.for_history()

    extension = client.extend(
        [*prompt.token_ids, *choice.token_ids],
        [*MESSAGES, message.for_history()],
        [{"role": "user", "content": "Thanks"}],
        tools=TOOLS,
        keep_history=True,
    )
    assert isinstance(extension, Extension) and extension.extended
    assert extension.token_ids[: extension.kept_tokens] == [*prompt.token_ids, *choice.token_ids]


def test_completion_endpoints(client: Client) -> None:
    prompts = client.render_completion(["Hello", "Bonjour"], max_tokens=3)
    assert [p.request_id.endswith(f"-{i}") for i, p in enumerate(prompts)] == [True, True]
    results = [client.generate(p) for p in prompts]
    derendered = client.derender_completion(results)
    assert [c.index for c in derendered.choices] == [0, 1]
    assert client.completion("Hello", max_tokens=2).choices[0].finish_reason == "length"
    chat = client.chat_completion(MESSAGES, max_tokens=2)
    assert chat.choices[0].message.role == "assistant"
    assert client.abort(["no-such-request"]) == 0


def test_typed_errors(client: Client, qwen3_server: Server) -> None:
    with pytest.raises(BadRequestError) as bad:
        client.detokenize([10**7])
    assert bad.value.status_code == 400 and bad.value.error_type == "BadRequestError"
    assert "out of vocabulary" in bad.value.message
    with pytest.raises(NotFoundError) as missing:
        client.render_chat(MESSAGES, model="nope")
    assert missing.value.param == "model"
    with pytest.raises(BadRequestError, match="stop strings"):
        list(client.generate_stream([1, 2], {"stop": ["x"], "detokenize": False}))
    with Client(qwen3_server.url) as anonymous, pytest.raises(AuthenticationError):
        anonymous.models()
    with Client(f"http://127.0.0.1:{free_port()}") as nowhere, pytest.raises(APIConnectionError):
        nowhere.version()


def test_async_client(qwen3_server: Server) -> None:
    async def run() -> None:
        async with AsyncClient(qwen3_server.url, api_key=API_KEY) as client:
            assert await client.health()
            prompt = await client.render_chat(MESSAGES, **SAMPLING)
            # Concurrent requests need their own ids (a running id is refused).
            results = await asyncio.gather(
                *(client.generate(prompt, request_id=f"same-seed-{i}") for i in range(3))
            )
            ids = [result.choices[0].token_ids for result in results]
            assert ids[0] == ids[1] == ids[2]  # same seed
            chunks = [chunk async for chunk in client.generate_stream(prompt)]
            assert [i for c in chunks for choice in c.choices for i in choice.token_ids] == ids[0]
            derendered = await client.derender_chat(results[0])
            assert derendered.choices[0].message.role == "assistant"
            with pytest.raises(BadRequestError) as bad:
                await client.extend([1], MESSAGES, MESSAGES)
            assert "previous_messages" in bad.value.message

    asyncio.run(run())


def test_control_routes(rl_server: Server, qwen3_server: Server) -> None:
    from tokenwire.assets import prepare

    with Client(rl_server.url, api_key=API_KEY) as client:
        control = client.control
        assert control.load() == 0
        assert control.pause("keep") is True
        assert control.is_paused() is True
        control.update_weight_version("named", abort_all_requests=False)
        assert control.weight_version() == "named"
        assert control.update_weights(str(prepare("smollm2-135m-instruct")), "step-1") == "step-1"
        assert control.weight_version() == "step-1"
        with pytest.raises(BadRequestError):
            control.update_weights("/no/such/checkpoint")
        control.resume()
        assert control.is_paused() is False
        control.sleep()
        assert control.is_sleeping() is True
        control.wake_up()
        assert control.is_sleeping() is False
        assert isinstance(control.reset_prefix_cache(), bool)
        assert client.abort() == 0

        async def run() -> None:
            async with AsyncClient(rl_server.url, api_key=API_KEY) as aclient:
                await aclient.control.pause("abort", clear_cache=True)
                assert await aclient.control.is_paused()
                await aclient.control.resume()
                assert await aclient.control.weight_version() == "step-1"

        asyncio.run(run())
        control.update_weight_version("default", abort_all_requests=False)  # as it was
    with Client(qwen3_server.url, api_key=API_KEY) as client, pytest.raises(NotFoundError):
        client.control.pause()


def test_a_fleet_sends_each_control_call_to_every_server(control_server: Server) -> None:
    # One server twice stands for two: each call reaches every URL, answers in their order.
    urls = [control_server.url, control_server.url]
    with Fleet(urls, api_key=CONTROL_KEY) as fleet:
        assert fleet.each(lambda control: control.update_weight_version("v2")) == [None] * 2
        assert fleet.each(lambda control: control.weight_version()) == ["v2", "v2"]

        async def run() -> list[str]:
            async with AsyncFleet(urls, api_key=CONTROL_KEY) as afleet:
                await afleet.each(lambda control: control.pause("keep"))
                assert await afleet.each(lambda control: control.is_paused()) == [True, True]
                await afleet.each(lambda control: control.resume())
                return await afleet.each(lambda control: control.weight_version())

        assert asyncio.run(run()) == ["v2", "v2"]
        fleet.each(lambda control: control.update_weight_version("default"))
    with Fleet(urls, api_key=API_KEY) as fleet, pytest.raises(AuthenticationError):
        fleet.each(lambda control: control.pause())  # the router's key: refused
    with pytest.raises(ValueError):
        Fleet(control_server.url)  # type: ignore[arg-type] - a string, not a list
