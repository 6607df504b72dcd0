"""Real OpenAI clients as users run them, with their defaults, against the session stack:
`openai` (sync and async), `langchain-openai` and `litellm`. Tool calls go to a host of this
module's own serving a model that calls a tool (tests/support/toolmodel.py)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.support.clients import CHAT, HOST_A, client_for, job_of
from tests.support.processes import Processes
from tests.support.stack import Stack
from tests.support.toolmodel import CALL, create_tool_model
from tests.support.workers import new_worker

# langchain (~2 s) and litellm (~5 s) are imported by the tests that use them, not when every
# pytest process collects this module.
if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI

TOOLS_HOST = {"host": "host-tools"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with client_for(stack.api) as client:
        yield client


@pytest.fixture(scope="module")
def tools_host(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A host of this module's own serving the tool-calling model; its name."""
    processes = Processes()
    models = tmp_path_factory.mktemp("tool-model")
    try:
        model = create_tool_model(models / "tools")
        new_worker(processes, stack.redis.url, stack.store, "host-tools", [model], models)
        yield "tools"
    finally:
        processes.stop_all()


def greedy(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT, "temperature": 0, "extra_body": HOST_A, **fields}


# --- openai ---


def test_the_neutral_values_clients_send_are_accepted(stack: Stack, client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(**greedy(max_tokens=12))
    parts: list[Any] = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    neutral = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": parts}],
        temperature=0,
        max_tokens=12,
        n=1,
        frequency_penalty=0,
        presence_penalty=0,
        logprobs=False,
        response_format={"type": "text"},
        store=False,
        user="alice",
        stream_options={"include_usage": False},
        extra_body=HOST_A,
    )
    assert neutral.choices[0].message.content == plain.choices[0].message.content
    assert neutral.choices[0].logprobs is None
    job = job_of(stack.api, neutral.id)
    assert job["request"]["user"] == "alice" and job["request"]["messages"][0]["content"] == "hello"


def test_logprobs_in_chat_whole_and_streamed(client: openai.OpenAI) -> None:
    request = greedy(max_tokens=10, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content
    assert whole.usage is not None and len(entries) == whole.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy
    streamed = [
        e
        for chunk in client.chat.completions.create(**request, stream=True)
        for c in chunk.choices
        if c.logprobs is not None and c.logprobs.content
        for e in c.logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_logprobs_in_completions_whole_and_streamed(client: openai.OpenAI) -> None:
    request: dict[str, Any] = {"model": "tiny", "prompt": "Hello", "max_tokens": 8}
    request |= {"temperature": 0, "logprobs": 2, "extra_body": HOST_A}
    whole = client.completions.create(**request)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "".join(logprobs.tokens) == whole.choices[0].text and len(logprobs.tokens) == 8
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    assert logprobs.text_offset == offsets
    assert logprobs.top_logprobs is not None and all(len(t) == 2 for t in logprobs.top_logprobs)
    chunks = list(client.completions.create(**request, stream=True))
    tokens = [
        t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens or []
    ]
    offsets_streamed = [
        o for c in chunks for ch in c.choices if ch.logprobs for o in ch.logprobs.text_offset or []
    ]
    assert tokens == logprobs.tokens and offsets_streamed == offsets


def test_async_client_with_penalties_alone_and_together(stack: Stack) -> None:
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=stack.api.url + "/v1", api_key="unused", max_retries=0
        ) as client:

            async def one(**fields: Any) -> str:
                done = await client.chat.completions.create(**greedy(max_tokens=30, **fields))
                return done.choices[0].message.content or ""

            async def streamed(**fields: Any) -> str:
                stream = await client.chat.completions.create(
                    **greedy(max_tokens=30, **fields), stream=True
                )
                return "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )

            alone = [await one(presence_penalty=1.5), await one(logit_bias={"40": 6})]
            together = await asyncio.gather(
                one(presence_penalty=1.5), streamed(logit_bias={"40": 6}), one()
            )
            return [*alone, *together]

    penalised, biased, penalised_together, biased_together, plain = asyncio.run(run())
    assert penalised_together == penalised and biased_together == biased
    assert len({penalised, biased, plain}) == 3


def test_openai_client_tool_calls_whole_streamed_and_answered(
    client: openai.OpenAI, tools_host: str
) -> None:
    ask: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    request: dict[str, Any] = {"model": tools_host, "messages": ask, "tools": [WEATHER]}
    request["extra_body"] = TOOLS_HOST
    whole = client.chat.completions.create(**request, parallel_tool_calls=True)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == CALL["name"]
    assert json.loads(call.function.arguments) == CALL["arguments"]
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or []]
    assert [(d.index, d.function and d.function.name) for d in deltas] == [(0, CALL["name"])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The conversation goes on with the call and its result, through the chat template.
    answered = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    follow = client.chat.completions.create(**(request | {"messages": answered}))
    assert follow.choices[0].finish_reason == "tool_calls"
    none = client.chat.completions.create(**request, tool_choice="none")
    assert none.choices[0].finish_reason == "stop" and not none.choices[0].message.tool_calls


# --- langchain-openai ---


def chat_model(stack: Stack, **fields: Any) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="tiny",
        base_url=stack.api.url + "/v1",
        api_key="unused",
        max_retries=0,
        extra_body=HOST_A,
        **fields,
    )


def test_langchain_chat_invoke_stream_and_batch(stack: Stack) -> None:
    from langchain_core.messages import HumanMessage

    llm = chat_model(stack, temperature=0, max_tokens=16)
    invoked = llm.invoke([HumanMessage("hello")])
    assert isinstance(invoked.content, str) and len(invoked.content) > 0
    streamed = "".join(str(chunk.content) for chunk in llm.stream([HumanMessage("hello")]))
    assert streamed == invoked.content
    batch = llm.batch(["hello", "hi", "hello"])
    assert batch[0].content == batch[2].content == invoked.content
    assert batch[1].content != invoked.content


def test_langchain_completions_class_with_its_defaults(stack: Stack) -> None:
    # OpenAI() sends temperature 0.7, top_p 1, frequency_penalty 0, presence_penalty 0, n 1,
    # max_tokens 256 and the prompt as a list: refused before, all accepted now.
    from langchain_openai import OpenAI

    llm = OpenAI(
        model="tiny",
        base_url=stack.api.url + "/v1",
        api_key="unused",
        max_retries=0,
        extra_body=HOST_A,
    )
    assert llm.frequency_penalty == 0 and llm.presence_penalty == 0 and llm.n == 1
    [[generation]] = llm.generate(["Once upon a time"]).generations
    # Sampled at 0.7 with no seed, the tiny model may draw its end token first: "" is an answer.
    assert isinstance(generation.text, str)
    assert generation.generation_info is not None
    assert generation.generation_info["finish_reason"] in {"stop", "length"}
    seeded = OpenAI(
        model="tiny",
        base_url=stack.api.url + "/v1",
        api_key="unused",
        max_retries=0,
        extra_body=HOST_A,
        seed=7,
        max_tokens=12,
    )
    assert seeded.invoke("x") == seeded.invoke("x")


def test_langchain_bind_tools_gets_the_models_call(stack: Stack, tools_host: str) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(
        model=tools_host,
        base_url=stack.api.url + "/v1",
        api_key="unused",
        max_retries=0,
        extra_body=TOOLS_HOST,
    ).bind_tools([get_weather])
    message = llm.invoke([HumanMessage("Weather in Paris?")])
    assert isinstance(message, AIMessage)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        (CALL["name"], CALL["arguments"])
    ]
    result = get_weather.invoke(message.tool_calls[0]["args"])
    again = llm.invoke(
        [
            HumanMessage("Weather in Paris?"),
            message,
            ToolMessage(result, tool_call_id=message.tool_calls[0]["id"]),
        ]
    )
    assert isinstance(again, AIMessage) and again.tool_calls


# --- litellm ---


def litellm_args(stack: Stack, **fields: Any) -> dict[str, Any]:
    return {
        "model": "openai/tiny",
        "api_base": stack.api.url + "/v1",
        "api_key": "unused",
        "messages": [{"role": "user", "content": "hello"}],
        "temperature": 0,
        "max_tokens": 16,
        "extra_body": HOST_A,
        "num_retries": 0,
        **fields,
    }


def test_litellm_completion_acompletion_and_stream(stack: Stack, client: openai.OpenAI) -> None:
    # litellm fetches a price list at import unless told to use its bundled copy (no network).
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    expected = client.chat.completions.create(**greedy(max_tokens=16)).choices[0].message.content
    done: Any = litellm.completion(**litellm_args(stack))
    assert done.choices[0].message.content == expected
    assert done.usage.completion_tokens == 16
    async_done: Any = asyncio.run(litellm.acompletion(**litellm_args(stack, frequency_penalty=0)))
    assert async_done.choices[0].message.content == expected
    stream: Any = litellm.completion(**litellm_args(stack, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
