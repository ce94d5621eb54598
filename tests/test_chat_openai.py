"""chat_openai: the SDK's raw path sends what `create()` would and streams the same answer; each message is
converted into the body once, and the body is still LangChain's own conversion, byte for byte."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import httpx2
import openai
import pytest
from langchain_core.callbacks import AsyncCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.ai import add_ai_message_chunks
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

import failures
import llm_errors
import models as model_module
from chat_openai import RawCompletions, chunk_stream, openai_chat_model, raw_streams
from models import HistoryCache, to_lc_messages
from tests.fakes.backend import ErrorReply, TextReply, ToolCall, ToolCallsReply
from tests.fakes.openai_backend import FakeOpenAI


@pytest.fixture
def backend() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


@tool
def lookup(city: str, days: int = 1) -> str:
    """The weather of a city."""
    return city


MESSAGES = [SystemMessage("you are terse"), HumanMessage("hi ü 😀"), AIMessage("", tool_calls=[
    {"name": "lookup", "args": {"city": "Oslo"}, "id": "c1"}]), ToolMessage("sunny", tool_call_id="c1"),
            HumanMessage("and tomorrow?")]


def models(backend: FakeOpenAI, transport: str = "httpx", **extra: Any) -> tuple[ChatOpenAI, ChatOpenAI]:
    """The stock model and ours; with `transport="aiohttp"` both on the SDK's aiohttp transport (the server's:
    ours then sends without httpx2 in between, RawCompletions._send_direct)."""
    common: dict[str, Any] = {"model": "fake-model", "base_url": backend.base_url, "api_key": "k", "streaming": True,
                              "max_retries": 0, "stream_usage": True, **extra}
    if transport == "aiohttp":
        pools = [openai.DefaultAioHttpClient(), openai.DefaultAioHttpClient()]
        _POOLS.extend(pools)
        return ChatOpenAI(**common, http_async_client=pools[0]), openai_chat_model(**common, http_async_client=pools[1])
    return ChatOpenAI(**common), openai_chat_model(**common)


_POOLS: list[Any] = []


@pytest.fixture(autouse=True)
async def _close_pools() -> AsyncIterator[None]:
    yield
    while _POOLS:
        await _POOLS.pop().aclose()


TRANSPORTS = pytest.mark.parametrize("transport", ["httpx", "aiohttp"])


def sent_direct(raw: ChatOpenAI) -> bool:
    """Whether `raw`'s last streamed call went to aiohttp without httpx2 in between."""
    kept = raw.async_client._direct_for
    return kept is not None and kept[1] is not None


async def collect(llm: Any, messages: list[Any] = MESSAGES) -> Any:
    full = None
    async for chunk in llm.astream(messages):
        full = chunk if full is None else full + chunk
    return full


@TRANSPORTS
async def test_the_body_and_the_answer_are_the_sdks(backend: FakeOpenAI, transport: str) -> None:
    # (logit_bias: keys that are not strings, which JSON makes strings; a body orjson refuses goes through the SDK)
    bias = {"logit_bias": {50256: -100}} if transport == "httpx" else {}
    stock, raw = models(backend, transport, temperature=0.2, extra_body={"top_k": 5}, default_headers={"X-Team": "a"},
                        **bias)
    assert isinstance(raw.async_client, RawCompletions)
    answers = []
    for llm in (stock.bind_tools([lookup]), raw.bind_tools([lookup])):
        backend.script(TextReply(("It ", "will ", "rain.")))
        answers.append(await collect(llm))
    sent_stock, sent_raw = backend.requests[-2:]
    assert sent_raw.json == sent_stock.json  # the same body without the SDK's transform
    assert sent_raw.json["top_k"] == 5 and sent_raw.json["stream_options"] == {"include_usage": True}
    assert sent_raw.json.get("logit_bias") == ({"50256": -100} if bias else None)
    assert sent_raw.headers["content-type"] == sent_stock.headers["content-type"] == "application/json"
    assert sent_raw.headers["authorization"] == "Bearer k" and sent_raw.headers["x-team"] == "a"
    # The kept request (RawCompletions._template) carries every header the SDK's own request does.
    assert {k: v for k, v in sent_raw.headers.items() if k != "content-length"} == {
        k: v for k, v in sent_stock.headers.items() if k != "content-length"}
    assert sent_raw.path == sent_stock.path
    assert answers[1].content == answers[0].content == "It will rain."
    assert answers[1].usage_metadata == answers[0].usage_metadata
    assert answers[1].response_metadata["finish_reason"] == "stop"
    assert sent_direct(raw) == (transport == "aiohttp")


@TRANSPORTS
async def test_tool_calls_stream_as_with_the_sdks_models(backend: FakeOpenAI, transport: str) -> None:
    stock, raw = models(backend, transport)
    calls = []
    for llm in (stock, raw):
        backend.script(ToolCallsReply((ToolCall("lookup", {"city": "Oslo", "days": 2}, "call_1"),), "Checking."))
        calls.append(await collect(llm.bind_tools([lookup])))
    assert calls[1].tool_calls == calls[0].tool_calls == [
        {"name": "lookup", "args": {"city": "Oslo", "days": 2}, "id": "call_1", "type": "tool_call"}]
    assert calls[1].content == calls[0].content


@TRANSPORTS
async def test_http_errors_raise_the_sdks_exceptions(backend: FakeOpenAI, transport: str) -> None:
    _, raw = models(backend, transport)
    for status, error in ((503, openai.InternalServerError), (429, openai.RateLimitError),
                          (401, openai.AuthenticationError), (400, openai.BadRequestError)):
        backend.script(ErrorReply(status, "overloaded"))
        with pytest.raises(error) as caught:
            await collect(raw)
        assert caught.value.status_code == status and "overloaded" in str(caught.value)
        assert caught.value.response.request.url.path.endswith("/chat/completions")
    backend.script(TextReply(("fine",)))  # the connection after an error answer still serves
    assert (await collect(raw)).content == "fine" and sent_direct(raw) == (transport == "aiohttp")


async def test_calls_it_does_not_stream_go_through_create(backend: FakeOpenAI) -> None:
    _, raw = models(backend, streaming=False)
    backend.script(TextReply(("whole",)))
    reply = await raw.ainvoke(MESSAGES)
    assert reply.content == "whole" and backend.requests[-1].json.get("stream") is not True


_ANSWER = (b'data: {"id":"a","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,'
           b'"delta":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')


def _long_history(n: int) -> list[dict[str, Any]]:
    """User questions, answers (some calling a tool, with an empty text), tool results; text JSON escapes differ on."""
    history: list[dict[str, Any]] = []
    while len(history) < n:
        i = len(history)
        history.append({"role": "user", "content": f"question {i}: ü 😀 \u2028 \x01 \\ \"quoted\" </script>"})
        if i % 3 == 0:
            history.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{i}", "name": "lookup", "args": {"city": f"Zürich {i}", "days": i, "ratio": 0.1 * i}}]})
            history.append({"role": "tool", "tool_call_id": f"c{i}", "name": "lookup", "content": f"result\n{i}"})
        history.append({"role": "assistant", "content": f"answer {i}:\n\t" + "word " * 40})
    return history


async def test_a_long_history_is_sent_as_langchain_converts_it_byte_for_byte() -> None:
    """The body from the session's kept messages (HistoryCache, the model's memo of their dicts) is the body
    LangChain builds from a fresh conversion and the SDK writes with `json.dumps` (`raw`: its key order is
    LangChain's; the stock `create()` reorders the keys), at every turn, edits and trims included."""
    sent: dict[str, list[bytes]] = {"stock": [], "raw": [], "ours": []}

    def client(name: str) -> httpx.AsyncClient:
        def answer(request: httpx.Request) -> httpx.Response:
            sent[name].append(request.read())
            return httpx.Response(200, content=_ANSWER, headers={"content-type": "text/event-stream"})
        return httpx.AsyncClient(transport=httpx.MockTransport(answer))

    common: dict[str, Any] = {"model": "m", "base_url": "http://x.invalid/v1", "api_key": "k", "streaming": True,
                              "max_retries": 0, "stream_usage": True, "temperature": 0.2}
    stock = ChatOpenAI(**common, http_async_client=client("stock")).bind_tools([lookup])
    raw = raw_streams(ChatOpenAI(**common, http_async_client=client("raw"))).bind_tools([lookup])
    ours = openai_chat_model(**common, http_async_client=client("ours")).bind_tools([lookup])
    history, cache, system = _long_history(1000), HistoryCache(), SystemMessage("you are terse ü")
    for turn in range(4):
        for llm, messages in ((stock, to_lc_messages(history)), (raw, to_lc_messages(history)),
                              (ours, cache.messages(history))):
            async for _ in llm.astream([system, *messages]):
                pass
        assert sent["ours"][-1] == sent["raw"][-1], turn
        assert json.loads(sent["ours"][-1]) == json.loads(sent["stock"][-1]), turn
        assert len(json.loads(sent["ours"][-1])["messages"]) == len(history) + 1
        history += [{"role": "user", "content": f"turn {turn}"}, {"role": "assistant", "content": "ok"}]
        history[turn]["content"] = f"edited {turn}"  # in place, the value replaced
        history[-5] = {**history[-5], "content": "replaced"}
        if turn == 2:
            history[:] = history[-300:]  # trimmed


class _Body(httpx2.AsyncByteStream):
    def __init__(self, pieces: list[bytes]):
        self.pieces, self.read = pieces, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            self.read += 1
            yield piece


async def _chunks(pieces: list[bytes]) -> tuple[list[Any], _Body]:
    body = _Body(pieces)
    response = httpx2.Response(200, stream=body, request=httpx2.Request("POST", "http://x/v1/chat/completions"))
    stream = chunk_stream()(cast_to=object, response=response, client=openai.AsyncOpenAI(api_key="k"))
    return [chunk async for chunk in stream], body


def _event(content: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": content}}]}).encode() + b"\n\n"


async def test_the_stream_reads_what_the_sdks_decoder_reads() -> None:
    """Events split anywhere, CRLF and CR line ends, comments, fields other than data, data over several lines."""
    wire = (_event("a") + b": keepalive\n\n" + _event("b").replace(b"\n", b"\r\n") + b"event: message\nid: 7\n"
            + b'data: {"choices": [{"index": 0,\ndata:  "delta": {"content": "c"}}]}\n\n'
            + _event("d").replace(b"\n", b"\r") + b"data: [DONE]\n\n")
    for size in (1, 2, 7, len(wire)):
        got, _ = await _chunks([wire[i:i + size] for i in range(0, len(wire), size)])
        assert "".join(c["choices"][0]["delta"]["content"] for c in got) == "abcd", size
        if size == 1:  # each event complete in a read of its own: nothing waits to be joined
            assert len(got) == 4
    got, _ = await _chunks([wire])
    assert [c["choices"][0]["delta"]["content"] for c in got] == ["abcd"]  # arrived together: one chunk


def _piece(**fields: Any) -> bytes:
    chunk = {"id": "r1", "model": "m", "created": 1, "choices": [{"index": 0, "delta": {"content": "x"}}]}
    choice = chunk["choices"][0]
    for key, value in fields.items():
        target = chunk if key in ("id", "usage") else choice["delta"] if key in ("role", "tool_calls") else choice
        target[key] = value
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest.mark.parametrize("fields", [{"finish_reason": "stop"}, {"usage": {"total_tokens": 3}}, {"id": "r2"},
                                    {"role": "tool"}, {"logprobs": {"content": []}}, {"index": 1},
                                    {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f"}}]}])
async def test_only_text_of_the_same_response_and_choice_is_joined(fields: dict[str, Any]) -> None:
    got, _ = await _chunks([_piece(role="assistant") + _piece() + _piece(**fields) + b"data: [DONE]\n\n"])
    assert [c["choices"][0]["delta"].get("content") for c in got] == ["xx", "x"], fields


async def test_done_ends_the_stream_after_the_body_is_read() -> None:
    got, body = await _chunks([_event("a"), b"data: [DONE]\n\n", _event("after"), b"trailing"])
    assert [c["choices"][0]["delta"]["content"] for c in got] == ["a"] and body.read == 4  # drained: reusable


async def test_an_error_object_in_the_stream_is_an_api_error() -> None:
    with pytest.raises(openai.APIError, match="the model crashed"):
        await _chunks([_event("a"), b'data: {"error": {"message": "the model crashed", "code": 500}}\n\n'])


async def _merged(chunks: AsyncIterator[Any]) -> Any:
    return add_ai_message_chunks(*[chunk async for chunk in chunks])


@pytest.mark.parametrize("reply", [TextReply(("It ", "will ", "rain.")),
                                   ToolCallsReply((ToolCall("lookup", {"city": "Oslo", "days": 2}, "call_1"),),
                                                  "Checking.")])
async def test_the_models_own_stream_yields_what_astream_yields(backend: FakeOpenAI, reply: Any) -> None:
    """models._chunks reads the model's `_astream` when nothing listens to `astream`'s callbacks: the merged answer
    is the same (text, tool calls, usage, finish reason, model name), and so is the last chunk's position."""
    _, raw = models(backend)
    llm = raw.bind_tools([lookup])
    assert model_module._own_stream(llm) is not None
    answers = []
    for chunks in (lambda: llm.astream(MESSAGES), lambda: model_module._chunks(llm, MESSAGES)):
        backend.script(reply)
        answers.append(await _merged(chunks()))
    assert backend.requests[-1].json == backend.requests[-2].json
    stock, own = answers
    assert (own.content, own.tool_calls, own.usage_metadata) == (stock.content, stock.tool_calls, stock.usage_metadata)
    assert own.response_metadata == stock.response_metadata and own.chunk_position == stock.chunk_position == "last"
    assert own.response_metadata["finish_reason"] in ("stop", "tool_calls")


async def test_a_model_with_callbacks_streams_through_astream(backend: FakeOpenAI) -> None:
    """A callback on the model (or LangSmith tracing) is heard: then the chunks come from `astream` itself."""
    heard: list[str] = []

    class Listener(AsyncCallbackHandler):
        async def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            heard.append(token)

    _, raw = models(backend, callbacks=[Listener()])
    assert model_module._own_stream(raw) is None
    backend.script(TextReply(("a", "b")))
    assert (await _merged(model_module._chunks(raw, MESSAGES))).content == "ab"
    assert "".join(heard) == "ab"


@TRANSPORTS
async def test_the_kept_request_follows_a_new_api_key(backend: FakeOpenAI, transport: str) -> None:
    _, raw = models(backend, transport)
    for key in ("k", "rotated"):
        raw.root_async_client.api_key = key
        backend.script(TextReply(("ok",)))
        await collect(raw)
        assert backend.requests[-1].headers["authorization"] == f"Bearer {key}"


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"])
async def test_a_backend_that_closes_the_connection_is_unreachable_not_slow(answer: bytes) -> None:
    """The SDK's aiohttp transport names every failed connection a connect timeout; the chain says what it was,
    so the turn is told the backend cut the connection (and may try again), not that it was waited on."""
    async def close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(answer)
        writer.close()

    server = await asyncio.start_server(close, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    llm = openai_chat_model(model="m", base_url=f"http://127.0.0.1:{port}/v1", api_key="k", streaming=True,
                            max_retries=0, http_async_client=openai.DefaultAioHttpClient())
    try:
        with pytest.raises(Exception) as caught:
            await collect(llm)
    finally:
        server.close()
        await llm.http_async_client.aclose()
    assert failures.failure(caught.value).kind == "unreachable", repr(caught.value)
    assert llm_errors.llm_error_kind(caught.value) == "backend" and llm_errors.retryable(caught.value)


def test_every_kind_of_message_becomes_the_dict_langchain_makes_of_it() -> None:
    """Plain text messages are converted by `_convert`'s own path, the rest by LangChain's: the same dicts,
    in the same key order, whatever the mix."""
    from langchain_core.messages import AIMessage, AIMessageChunk, ChatMessage, HumanMessage, ToolMessage

    messages = [
        HumanMessage("plain"), AIMessage("plain answer ü"), HumanMessage(""), AIMessage(""),
        HumanMessage("named", name="alice"), AIMessage("named", name="bot"),
        HumanMessage([{"type": "text", "text": "blocks"}]), AIMessage([{"type": "text", "text": "blocks"}]),
        AIMessage("", tool_calls=[{"name": "lookup", "args": {"city": "Bern"}, "id": "c1", "type": "tool_call"}]),
        AIMessage("x", invalid_tool_calls=[{"name": "lookup", "args": "{", "id": "c2", "error": "bad",
                                             "type": "invalid_tool_call"}]),
        AIMessage("kw", additional_kwargs={"function_call": {"name": "f", "arguments": "{}"}}),
        AIMessage("audio", additional_kwargs={"audio": {"id": "a1"}}),
        AIMessageChunk("a chunk"), SystemMessage("system"), ChatMessage("custom", role="critic"),
        ToolMessage("result", tool_call_id="c1", name="lookup"),
    ]
    common: dict[str, Any] = {"model": "m", "base_url": "http://x.invalid/v1", "api_key": "k"}
    expected = ChatOpenAI(**common)._get_request_payload(messages)["messages"]
    for order in (messages, messages[::-1]):
        ours = openai_chat_model(**common)._get_request_payload(order)["messages"]
        wanted = expected if order is messages else expected[::-1]
        assert [list(d.items()) for d in ours] == [list(d.items()) for d in wanted]
