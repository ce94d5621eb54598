"""The fake LLM backends speak the real wire protocols: unmodified LangChain clients work against them."""

from __future__ import annotations

import asyncio
import json
import operator
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from functools import reduce
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from google.genai import errors as genai_errors
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langchain_google_genai import ChatGoogleGenerativeAI
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

import failures
from tests.fakes.backend import FakeBackend, cut, error, hang, malformed, text, tokens, tool_call, tool_calls
from tests.fakes.gemini_backend import FakeGemini
from tests.fakes.openai_backend import FakeOpenAI
from tests.waiting import DEADLINE

REPO_ROOT = Path(__file__).resolve().parents[2]
# Upper bound for any single awaited step, so a broken fake fails fast instead of at the 60 s timeout.
STEP = 5.0


class WeatherArgs(BaseModel):
    """Arguments of the test tool."""

    city: str = Field(description="City name")


def _get_weather(city: str) -> str:
    return "21C"


WEATHER = StructuredTool.from_function(
    _get_weather, name="get_weather", description="Get the weather for a city.", args_schema=WeatherArgs
)


# ---------------------------------------------------------------------------------------------------------
# Fixtures: one server per module, reset for each test; clients closed on the test's own loop
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as backend:
        yield backend


@pytest.fixture(scope="module")
def gemini_server() -> Iterator[FakeGemini]:
    with FakeGemini() as backend:
        yield backend


def _fresh(backend: FakeBackend) -> Iterator[FakeBackend]:
    backend.reset()
    yield backend
    assert backend.pending == 0, "the test left scripted replies unused"


@pytest.fixture
def openai_backend(openai_server: FakeOpenAI) -> Iterator[FakeBackend]:
    yield from _fresh(openai_server)


@pytest.fixture
def gemini_backend(gemini_server: FakeGemini) -> Iterator[FakeBackend]:
    yield from _fresh(gemini_server)


@pytest.fixture
async def make_openai(openai_backend: FakeOpenAI) -> AsyncIterator[Callable[..., ChatOpenAI]]:
    """ChatOpenAI factory; each model gets its own httpx client (langchain-openai caches a shared one per
    base URL, which would outlive this test's event loop)."""
    http_clients: list[httpx.AsyncClient] = []

    def make(**kwargs: Any) -> ChatOpenAI:
        http_clients.append(httpx.AsyncClient())
        return ChatOpenAI(
            model="fake",
            base_url=openai_backend.base_url,
            api_key="k",
            max_retries=0,
            http_async_client=http_clients[-1],
            **kwargs,
        )

    yield make
    for client in http_clients:
        await client.aclose()


@pytest.fixture
async def make_gemini(gemini_backend: FakeGemini) -> AsyncIterator[Callable[..., ChatGoogleGenerativeAI]]:
    """ChatGoogleGenerativeAI factory; models are closed (`aclose`) on the test's event loop."""
    models: list[ChatGoogleGenerativeAI] = []

    def make(**kwargs: Any) -> ChatGoogleGenerativeAI:
        models.append(
            ChatGoogleGenerativeAI(
                model="gemini-fake",
                google_api_key="k",
                base_url=gemini_backend.base_url,
                max_retries=0,
                **kwargs,
            )
        )
        return models[-1]

    yield make
    for model in models:
        await model.aclose()


async def _stream(llm: Any, messages: Any) -> list[AIMessageChunk]:
    """All chunks of `llm.astream(messages)`, bounded in time."""

    async def collect() -> list[AIMessageChunk]:
        return [chunk async for chunk in llm.astream(messages)]

    return await asyncio.wait_for(collect(), STEP)


def _texts(chunks: list[AIMessageChunk]) -> list[str]:
    return [c.content for c in chunks if c.content]


def _merge(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    return reduce(operator.add, chunks)


async def _first_chunk_while_held(llm: BaseChatModel, backend: FakeBackend) -> None:
    """The first token reaches the client while the backend still holds the rest of the stream."""
    hold = threading.Event()
    backend.script(text("first", " second", " third", hold=hold))
    stream = aiter(llm.astream("hi"))
    first = await asyncio.wait_for(anext(stream), STEP)
    assert first.content == "first"
    hold.set()
    rest = await asyncio.wait_for(_drain(stream), STEP)
    assert "".join(_texts(rest)) == " second third"


async def _drain(stream: AsyncIterator[AIMessageChunk]) -> list[AIMessageChunk]:
    return [chunk async for chunk in stream]


# ---------------------------------------------------------------------------------------------------------
# OpenAI
# ---------------------------------------------------------------------------------------------------------


async def test_openai_astream_text_arrives_in_chunks(make_openai, openai_backend):
    openai_backend.script(text("Hello", " there", ", world"))
    chunks = await _stream(make_openai(), "hi")
    assert _texts(chunks) == ["Hello", " there", ", world"]
    [request] = openai_backend.requests
    assert (request.method, request.path) == ("POST", "/v1/chat/completions")
    assert request.headers["authorization"] == "Bearer k"
    assert request.json["stream"] is True
    assert request.json["messages"] == [{"role": "user", "content": "hi"}]


async def test_openai_ainvoke_returns_joined_text_and_usage(make_openai, openai_backend):
    openai_backend.script(text("Hello", " world"))
    answer = await make_openai().ainvoke("hi")
    assert answer.content == "Hello world"
    assert answer.usage_metadata["output_tokens"] == 2
    assert openai_backend.requests[0].json["stream"] is False


async def test_openai_usage_chunk_only_when_requested(make_openai, openai_backend):
    openai_backend.script(text("a", "b"), text("a", "b"))
    with_usage = _merge(await _stream(make_openai(stream_usage=True), "hi"))
    without_usage = _merge(await _stream(make_openai(stream_usage=False), "hi"))
    assert with_usage.usage_metadata["output_tokens"] == 2
    assert without_usage.usage_metadata is None
    assert openai_backend.requests[0].json["stream_options"] == {"include_usage": True}


async def test_openai_streamed_tool_call_round_trip(make_openai, openai_backend):
    openai_backend.script(
        tool_call("get_weather", {"city": "Paris"}, call_id="call_abc"), text("It is 21C", " in Paris.")
    )
    llm = make_openai().bind_tools([WEATHER])
    history: list[BaseMessage] = [HumanMessage("weather in Paris?")]
    call = _merge(await _stream(llm, history))
    assert call.tool_calls == [
        {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_abc", "type": "tool_call"}
    ]
    history += [call, ToolMessage("21C", tool_call_id="call_abc")]
    answer = _merge(await _stream(llm, history))
    assert answer.content == "It is 21C in Paris."

    first, second = openai_backend.requests
    assert first.json["tools"][0]["function"]["name"] == "get_weather"
    assert first.json["tools"][0]["function"]["parameters"]["properties"]["city"]["type"] == "string"
    assert {"role": "tool", "content": "21C", "tool_call_id": "call_abc"} in second.json["messages"]


@pytest.mark.parametrize("streamed", [True, False], ids=["astream", "ainvoke"])
async def test_openai_parallel_tool_calls(make_openai, openai_backend, streamed):
    openai_backend.script(
        tool_calls(
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})], text_before="Sure."
        )
    )
    llm = make_openai().bind_tools([WEATHER])
    message = _merge(await _stream(llm, "weather?")) if streamed else await llm.ainvoke("weather?")
    assert message.content == "Sure."
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert len({c["id"] for c in message.tool_calls}) == 2


@pytest.mark.parametrize(
    ("status", "exception"), [(500, openai.InternalServerError), (404, openai.NotFoundError)]
)
async def test_openai_error_raises_client_error(make_openai, openai_backend, status, exception):
    openai_backend.script(error(status, "boom"))
    with pytest.raises(exception, match="boom"):
        await _stream(make_openai(), "hi")
    assert len(openai_backend.requests) == 1


async def test_openai_hang_hits_client_timeout(make_openai, openai_backend):
    openai_backend.script(hang(5))
    with pytest.raises(openai.APITimeoutError):
        await _stream(make_openai(timeout=0.2), "hi")


async def test_openai_malformed_stream_raises(make_openai, openai_backend):
    openai_backend.script(malformed())
    with pytest.raises(json.JSONDecodeError):
        await _stream(make_openai(), "hi")


async def test_openai_cut_stream_ends_without_finish_reason_usage_or_done(openai_backend):
    openai_backend.script(cut("alpha ", "be"), cut(reply=tool_call("get_weather", {"city": "Paris"})))
    async with httpx.AsyncClient(timeout=STEP) as http:
        for _ in range(2):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "stream_options": {"include_usage": True}}
            r = await http.post(openai_backend.base_url + "/chat/completions", json=body)
            events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
            assert r.status_code == 200 and events and "[DONE]" not in events
            chunks = [json.loads(e) for e in events]
            assert all(c["choices"] and c["choices"][0]["finish_reason"] is None and "usage" not in c for c in chunks)
    texts = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert texts[0] is None and any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)


async def test_openai_abrupt_cut_breaks_the_connection_after_the_chunks(make_openai, openai_backend):
    openai_backend.script(cut("alpha ", "be", abrupt=True))
    received = []
    with pytest.raises(openai.APIConnectionError):
        async for chunk in make_openai().astream("hi"):
            received.append(chunk.content)
    assert "alpha be".startswith("".join(received))  # what was in flight with the drop may be lost with it
    openai_backend.script(cut("alpha ", "be", abrupt=True))
    async with httpx.AsyncClient(timeout=STEP) as http:  # non-streamed: half a JSON body, then the connection drops
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(openai_backend.base_url + "/chat/completions", json={"model": "m", "messages": []})


async def test_openai_cut_after_the_finish_reason_loses_only_usage_and_done(openai_backend):
    openai_backend.script(cut("alpha ", "be", finished=True, abrupt=True))
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    received = ""
    async with httpx.AsyncClient(timeout=STEP) as http:
        with pytest.raises(httpx.RemoteProtocolError):  # the body's end never comes
            async with http.stream("POST", openai_backend.base_url + "/chat/completions", json=body) as r:
                async for piece in r.aiter_text():
                    received += piece
    chunks = [json.loads(e.removeprefix("data: ")) for e in received.split("\n\n") if e]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]  # no usage, no [DONE]


async def test_openai_first_chunk_arrives_while_backend_holds(make_openai, openai_backend):
    await _first_chunk_while_held(make_openai(), openai_backend)


async def test_openai_echo_by_default_and_model_list(make_openai, openai_backend):
    chunks = await _stream(
        make_openai(), [HumanMessage("first"), AIMessage("ok"), HumanMessage("hello world")]
    )
    assert _texts(chunks) == ["echo: ", "hello ", "world"]
    async with httpx.AsyncClient() as client:
        models = (await client.get(openai_backend.base_url + "/models")).json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"


async def test_custom_default_reply():
    with FakeOpenAI(default_reply=lambda _request: tokens(4)) as backend:
        async with httpx.AsyncClient() as http:
            llm = ChatOpenAI(
                model="fake", base_url=backend.base_url, api_key="k", max_retries=0, http_async_client=http
            )
            assert _texts(await _stream(llm, "hi")) == ["tok "] * 4


def test_cli_serves_until_interrupted():
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.openai_backend", "--port", "0"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        base_url = banner.split("base URL: ")[1].split()[0]
        answer = httpx.post(
            base_url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert answer.json()["choices"][0]["message"]["content"] == "echo: hi"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=DEADLINE) == 0  # generous: prompt, but a loaded machine is slow (test_fake_signals)
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


# ---------------------------------------------------------------------------------------------------------
# Gemini
# ---------------------------------------------------------------------------------------------------------


async def test_gemini_astream_text_arrives_in_chunks(make_gemini, gemini_backend):
    gemini_backend.script(text("Hello", " there", ", world"))
    chunks = await _stream(make_gemini(), "hi")
    assert _texts(chunks) == ["Hello", " there", ", world"]
    [request] = gemini_backend.requests
    assert request.path == "/v1beta/models/gemini-fake:streamGenerateContent"
    assert request.query == {"alt": "sse"}
    assert request.headers["x-goog-api-key"] == "k"
    assert request.json["contents"] == [{"role": "user", "parts": [{"text": "hi"}]}]
    assert _merge(chunks).usage_metadata["output_tokens"] == 3


async def test_gemini_ainvoke_returns_single_text(make_gemini, gemini_backend):
    gemini_backend.script(text("Hello", " world"))
    answer = await make_gemini().ainvoke("hi")
    assert answer.content == "Hello world"
    assert gemini_backend.requests[0].path.endswith(":generateContent")


@pytest.mark.parametrize("streamed", [True, False], ids=["astream", "ainvoke"])
async def test_gemini_tool_call_round_trip(make_gemini, gemini_backend, streamed):
    gemini_backend.script(tool_call("get_weather", {"city": "Paris"}), text("It is 21C in Paris."))
    llm = make_gemini().bind_tools([WEATHER])

    async def ask(messages: list[BaseMessage]) -> BaseMessage:
        return _merge(await _stream(llm, messages)) if streamed else await llm.ainvoke(messages)

    history: list[BaseMessage] = [HumanMessage("weather in Paris?")]
    call = await ask(history)
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("get_weather", {"city": "Paris"})]
    history += [call, ToolMessage("21C", tool_call_id=call.tool_calls[0]["id"])]
    assert (await ask(history)).content == "It is 21C in Paris."

    first, second = gemini_backend.requests
    [declaration] = first.json["tools"][0]["functionDeclarations"]
    assert declaration["name"] == "get_weather"
    assert declaration["parameters"]["properties"]["city"]["type"] == "STRING"
    assert second.json["contents"][-1] == {
        "role": "user",
        "parts": [{"functionResponse": {"name": "get_weather", "response": {"output": "21C"}}}],
    }


async def test_gemini_parallel_tool_calls_keep_explicit_ids(make_gemini, gemini_backend):
    gemini_backend.script(
        tool_calls([("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
        tool_call("get_weather", {"city": "Oslo"}, call_id="fc-1"),
    )
    llm = make_gemini().bind_tools([WEATHER])
    parallel = _merge(await _stream(llm, "weather?"))
    assert [c["args"]["city"] for c in parallel.tool_calls] == ["Paris", "Rome"]
    assert (await llm.ainvoke("weather?")).tool_calls[0]["id"] == "fc-1"


async def test_gemini_error_raises_client_error(make_gemini, gemini_backend):
    gemini_backend.script(error(500, "boom"))
    with pytest.raises(genai_errors.ServerError, match="boom"):
        await _stream(make_gemini(), "hi")
    assert len(gemini_backend.requests) == 1  # max_retries=0 means a single attempt in google-genai 2.34


async def test_gemini_hang_hits_client_timeout(make_gemini, gemini_backend):
    gemini_backend.script(hang(5))
    # google-genai lets its transport's timeout through unwrapped: aiohttp's (installed with the OpenAI SDK's
    # transport, models.py), which google-genai then prefers, or httpx's.
    with pytest.raises((httpx.TimeoutException, TimeoutError)) as caught:
        await _stream(make_gemini(timeout=0.2), "hi")
    assert failures.failure(caught.value).kind == "timeout"


async def test_gemini_malformed_stream_raises(make_gemini, gemini_backend):
    gemini_backend.script(malformed())
    with pytest.raises(genai_errors.UnknownApiResponseError):
        await _stream(make_gemini(), "hi")


@pytest.mark.parametrize("abrupt", [False, True])
async def test_gemini_cut_stream_sends_no_finish_reason(make_gemini, gemini_backend, abrupt):
    gemini_backend.script(cut("alpha ", "be", abrupt=abrupt))
    received: list[AIMessageChunk] = []
    try:
        async for chunk in make_gemini().astream("hi"):
            received.append(chunk)
    except Exception as exc:
        assert abrupt, exc  # the body broke off before its end: the transport's error
        assert any(type(e).__name__ == "ClientPayloadError" or isinstance(e, httpx.RemoteProtocolError)
                   for e in failures.chain(exc)), repr(exc)
    got = "".join(_texts(received))
    assert got == "alpha be" if not abrupt else "alpha be".startswith(got)  # the drop may lose what was in flight
    assert not any(c.response_metadata.get("finish_reason") for c in received)


async def test_gemini_first_chunk_arrives_while_backend_holds(make_gemini, gemini_backend):
    await _first_chunk_while_held(make_gemini(), gemini_backend)


async def test_gemini_echoes_last_user_text_by_default(make_gemini, gemini_backend):
    history = [HumanMessage("first"), AIMessage("ok"), HumanMessage("hello world")]
    assert _texts(await _stream(make_gemini(), history)) == ["echo: ", "hello ", "world"]
    assert (await make_gemini().ainvoke("ping")).content == "echo: ping"
