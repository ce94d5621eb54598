"""The OpenAI-type chat model's streams: LangChain's ChatOpenAI on the `openai` SDK's own raw path.

LangChain's `ChatOpenAI._astream` calls `chat.completions.create(stream=True)`, and the SDK then
(1) walks the whole request body against the params' TypedDicts (`async_maybe_transform`, which
does nothing for chat bodies — they have no aliases or formats — but costs 0.18 ms per history
message: 78% of a turn's server CPU at 1,000 messages) and (2) builds a pydantic
`ChatCompletionChunk` from every streamed chunk, which LangChain at once turns back into the dict it
started from (`chunk.model_dump()`): about half of the server's CPU per streamed token. Both are
skipped with the SDK's own means: its low-level `post()` (the way it sends requests to endpoints it
has no method for) with the body as LangChain built it, and `cast_to=object`, for which the SDK's
own stream class (its SSE decoder, error events, connection draining) yields each chunk as the
parsed dict. LangChain's loop, message chunks, callbacks and retries run unchanged.

`openai_chat_model()` builds that ChatOpenAI with one more saving: what each message becomes in the
request body is LangChain's own conversion, remembered while the message object lives, so a history
whose LangChain messages are kept across turns (models.HistoryCache) is converted once, not every call.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from openai import AsyncStream

#: `create()` keyword arguments that are request options, not body fields, and the option each becomes
#: (as the SDK's `make_request_options` maps them).
_OPTIONS = {"extra_headers": "headers", "extra_query": "params", "extra_body": "extra_json", "timeout": "timeout"}


class RawCompletions:
    """The SDK client's `chat.completions` with one change: a streamed `create()` without
    `response_format` posts its body as given and streams plain dicts. Everything else is the SDK's."""

    #: The stream class the chunks are read with.
    stream_cls: type[AsyncStream[object]]

    def __init__(self, completions: Any, client: Any):
        self._completions = completions
        self._client = client
        self.stream_cls = chunk_stream()
        #: The request the SDK builds for a streamed call, and the API key it was built with (`_template`).
        self._built: tuple[Any, Any] | None = None
        #: `_direct`'s answer for the kept request: (the request, the answer).
        self._direct_for: tuple[Any, tuple[Any, list[tuple[str, str]]] | None] | None = None

    def __getattr__(self, name: str) -> Any:  # with_raw_response, parse, …: the SDK's own
        return getattr(self._completions, name)

    async def create(self, **params: Any) -> Any:
        if not params.get("stream") or "response_format" in params:
            return await self._completions.create(**params)
        # As `create()` sends it: bearer auth only, the extra_* arguments as options.
        options: dict[str, Any] = {"security": {"bearer_auth": True}}
        for argument, option in _OPTIONS.items():
            value = params.pop(argument, None)
            if value is not None:
                options[option] = value
        content = _encoded(params, options)
        template = self._template() if content is not None and len(options) == 1 else None
        if template is not None and content is not None:  # (a template only comes with content)
            return await self._send(template, content)
        return await self._client.post("/chat/completions", body=params if content is None else None, content=content,
                                       cast_to=object, options=options, stream=True, stream_cls=self.stream_cls)

    def _template(self) -> Any:
        """The request the SDK's `post()` builds for a streamed call of this client (URL, headers, timeout), built
        by the SDK once and kept while the API key stays; None for a client whose requests the SDK builds
        differently each time (retries, a key or token provider, custom auth, a provider's transform, cookies).

        Hand-written on purpose (issue 31): with the chunks cheap, the SDK's `request()` became the largest cost of
        a model call left (options copied twice, the headers merged, validated and normalised, the URL parsed and
        merged again: 15% of a shell turn's CPU in cProfile); sending the kept request with a new body takes a
        tenth of that. What `request()` does around the send is kept in `_send`."""
        client = self._client
        if (client.max_retries or client.custom_auth is not None or client._client.cookies  # (added at build)
                or any(getattr(client, name, None) is not None
                       for name in ("_provider_runtime", "_api_key_provider", "_workload_identity_auth"))):
            return None
        if self._built is None or self._built[1] != client.api_key:
            from openai._models import FinalRequestOptions

            built = client._build_request(FinalRequestOptions.construct(
                method="post", url="/chat/completions", content=b"", security={"bearer_auth": True}))
            built.headers.pop("content-length", None)
            self._built = (built, client.api_key)
        return self._built[0]

    async def _send(self, template: Any, content: bytes) -> Any:
        """Send `template` with `content` as its body, and read the answer as `post()` does: a timeout or a failed
        connection as the SDK's exceptions, a 4xx/5xx answer as the SDK's error for its status, else the stream."""
        from openai import APIConnectionError, APITimeoutError, OpenAIError
        from openai._httpx2 import request_exceptions, timeout_exceptions

        client = self._client
        direct = self._direct(template)
        if direct is not None:
            return await self._send_direct(*direct, template, content)
        request = _request(template, content)  # httpx2's, or httpx's for a legacy client
        try:
            response = await client._send_request(request, stream=True)
        except timeout_exceptions() as exc:
            raise APITimeoutError(request=request) from exc
        except OpenAIError:
            raise
        except request_exceptions() as exc:
            raise APIConnectionError(request=request) from exc
        if response.is_error:
            await response.aread()
            raise client._make_status_error_from_response(response) from None
        return self.stream_cls(cast_to=object, response=response, client=client)

    def _direct(self, template: Any) -> tuple[Any, list[tuple[str, str]]] | None:
        """The SDK's aiohttp transport and the request's headers as aiohttp takes them, when the kept request can go
        to it without httpx2 in between (`_send_direct`): the httpx2 client has no auth or event hooks, the URL's
        transport is the plain aiohttp one (no proxy, no Unix socket), and the answer's encodings are ones aiohttp
        decodes itself. None otherwise. Kept with the request."""
        if self._direct_for is None or self._direct_for[0] is not template:
            from openai._vendor.httpx_aiohttp.transport import AiohttpTransport

            http = self._client._client
            transport = http._transport_for_url(template.url) if hasattr(http, "_transport_for_url") else None
            encodings = {e.strip() for e in template.headers.get("accept-encoding", "").split(",")} - {""}
            if (not isinstance(transport, AiohttpTransport) or transport.proxy is not None or transport.uds
                    or http.auth is not None or any(http.event_hooks.values()) or not encodings <= _DECODED):
                transport = None
            headers = [(k, v) for k, v in template.headers.multi_items() if k.lower() != "content-length"]
            self._direct_for = (template, None if transport is None else (transport, headers))
        return self._direct_for[1]

    async def _send_direct(self, transport: Any, headers: list[tuple[str, str]], template: Any, content: bytes) -> Any:
        """`_send` through the SDK's aiohttp transport's session as the transport sends (its timeouts, its errors
        mapped to httpx2's, then to the SDK's), without the httpx2 request, client and response around it.

        Hand-written on purpose (issue 31): those layers (the request rebuilt with its headers, httpx2's send with
        its auth, redirect and hook steps, the SDK's auth retry, a response whose bytes pass three iterators) were
        about a seventh of a shell turn's CPU in cProfile; without them a turn took 7–13% less server CPU, same
        run. The stream class (ChunkStream) reads the answer as before; an error answer becomes the SDK's error
        for its status from an httpx2 response made of it."""
        import aiohttp
        from openai import APIConnectionError, APITimeoutError
        from openai._httpx2 import request_exceptions, timeout_exceptions
        from openai._vendor.httpx_aiohttp.transport import map_aiohttp_exceptions

        if not isinstance(transport.client, aiohttp.ClientSession):
            transport.client = transport.get_client()
        timeout = template.extensions.get("timeout", {})
        try:
            with map_aiohttp_exceptions():
                resp = await transport.client.request(
                    "POST", str(template.url), headers=headers, data=content,
                    allow_redirects=False, compress=False, server_hostname=template.extensions.get("sni_hostname"),
                    timeout=aiohttp.ClientTimeout(sock_connect=timeout.get("connect"), sock_read=timeout.get("read"),
                                                  connect=timeout.get("pool")))
        except timeout_exceptions() as exc:
            raise APITimeoutError(request=_request(template, content)) from exc
        except request_exceptions() as exc:
            raise APIConnectionError(request=_request(template, content)) from exc
        if resp.status >= 400:
            import httpx2

            try:
                with map_aiohttp_exceptions():
                    body = await resp.read()
            finally:
                resp.release()
            raise self._client._make_status_error_from_response(httpx2.Response(
                resp.status, headers=resp.raw_headers, content=body, request=_request(template, content))) from None
        return self.stream_cls(cast_to=object, response=_AiohttpAnswer(resp, template, content),  # type: ignore[arg-type]  # duck-types httpx.Response
                               client=self._client)


#: The answer encodings aiohttp decodes without optional packages (`RawCompletions._direct`).
_DECODED = {"gzip", "deflate", "identity"}


def _forget(memo: dict[int, Any], key: int, _: object) -> None:
    """A remembered message is gone (its weak reference's callback): drop its request dict."""
    memo.pop(key, None)


def _request(template: Any, content: bytes) -> Any:
    """`template` with `content` as an httpx2 request, for what the SDK's exceptions carry."""
    return type(template)(template.method, template.url, headers=template.headers, content=content,
                          extensions=dict(template.extensions))


class _AiohttpAnswer:
    """What ChunkStream reads of an answer sent by `RawCompletions._send_direct`: aiohttp's bytes, its errors as
    httpx2's (as the SDK's transport raises them), and the request for the SDK's exceptions."""

    __slots__ = ("_content", "_resp", "_template")

    def __init__(self, resp: Any, template: Any, content: bytes):
        self._resp, self._template, self._content = resp, template, content

    @property
    def request(self) -> Any:
        return _request(self._template, self._content)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body in reads of at most 16 KB, as the SDK's transport reads it (a turn's events stay that small)."""
        from openai._vendor.httpx_aiohttp.transport import AiohttpResponseStream, map_aiohttp_exceptions

        with map_aiohttp_exceptions():
            async for chunk in self._resp.content.iter_chunked(AiohttpResponseStream.CHUNK_SIZE):
                yield chunk

    async def aclose(self) -> None:
        from openai._vendor.httpx_aiohttp.transport import map_aiohttp_exceptions

        with map_aiohttp_exceptions():  # as the SDK's transport ends it (a connection not read to its end closes)
            await self._resp.__aexit__(None, None, None)


def _encoded(params: dict[str, Any], options: dict[str, Any]) -> bytes | None:
    """The body as the JSON bytes the SDK would send (compact, UTF-8), written by orjson with `extra_body`
    merged in as the SDK merges it: 0.03 ms instead of the SDK's `json.dumps`' 0.7 ms for a body with 1,000
    history messages (issue 31). None for what orjson cannot write (an integer beyond 64 bits, an SDK
    object): the SDK writes that body itself."""
    extra = options.get("extra_json")
    try:
        content = orjson.dumps({**params, **extra} if extra else params)
    except TypeError:
        return None
    options.pop("extra_json", None)
    return content


@functools.cache
def chunk_stream() -> type[AsyncStream[object]]:
    """`ChunkStream`, made at the first OpenAI-type model built (`RawCompletions`): it subclasses the SDK's
    stream class, and the SDK (about 15 MiB) is imported with that model, not with this module."""
    from openai import APIConnectionError, APIError, APITimeoutError, AsyncStream
    from openai._httpx2 import request_exceptions, timeout_exceptions

    class ChunkStream(AsyncStream[object]):
        """The SDK's stream class with its SSE decoding written out here, chunks parsed with orjson.

        Hand-written on purpose (issue 31): with the pydantic models gone, the SDK's decoder was the largest
        cost per streamed token left in the server (it feeds every line through a generic SSE state machine,
        then `json.loads`); this splits the received bytes at blank lines and parses each `data:` payload
        once: 4.4× cheaper (a 32-chunk stream decoded in 0.25 ms instead of 1.07 ms, docs/benchmarks.md).
        Text chunks that arrived together (in one read of the socket) are joined into one (`_joined`): LangChain
        then builds one message chunk instead of one per token; nothing waits for more.
        What the SDK's `__stream__` does besides is kept: `[DONE]` ends the stream after the rest of the body
        is read (the connection is reused), an `error` object becomes `APIError`, timeouts and transport
        failures the SDK's exceptions.
        """

        async def __stream__(self) -> AsyncIterator[object]:
            response = self.response
            pending = b""
            done = False
            try:
                async for received in response.aiter_bytes():
                    if done:
                        continue  # the rest of a finished stream, read so the connection can be reused
                    pending += received
                    if b"\r" in pending:  # CRLF or CR line ends; a CR last may be half of a CRLF
                        last_cr = pending.endswith(b"\r")
                        pending = pending[:-1] if last_cr else pending
                        pending = pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if last_cr else b"")
                    *events, pending = pending.split(b"\n\n")
                    text: tuple[dict[str, Any], dict[str, Any]] | None = None  # a text chunk others may join
                    for event in events:
                        data = _data(event)
                        if data is None:
                            continue
                        if data.startswith(b"[DONE]"):
                            done = True
                            break
                        try:
                            chunk = orjson.loads(data)
                        except orjson.JSONDecodeError:
                            if text is not None:  # the text before a malformed event is still the answer's
                                yield text[0]
                            raise
                        choice = _text_only(chunk)
                        if text is not None and choice is not None and _joined(text, chunk, choice):
                            continue
                        if text is not None:
                            yield text[0]
                        if isinstance(chunk, dict) and chunk.get("error"):
                            error = chunk["error"]
                            message = error.get("message") if isinstance(error, dict) else None
                            raise APIError(message=message if isinstance(message, str) and message
                                           else "An error occurred during streaming", request=response.request,
                                           body=error)
                        text = None if choice is None else (chunk, choice)
                        if text is None:
                            yield chunk
                    if text is not None:
                        yield text[0]
            except timeout_exceptions() as exc:
                raise APITimeoutError(request=response.request) from exc
            except request_exceptions() as exc:
                raise APIConnectionError(request=response.request) from exc
            finally:
                await response.aclose()

    return ChunkStream


def _text_only(chunk: Any) -> dict[str, Any] | None:
    """The one choice of a chunk that carries text and nothing else (no tool call, finish reason, usage, log
    probabilities or other delta field that is set), else None. (Loops, not any(): this runs for every chunk.)"""
    if type(chunk) is not dict or chunk.get("usage") is not None:
        return None
    choices = chunk.get("choices")
    if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if type(delta) is not dict or type(delta.get("content")) is not str:
        return None
    for key, value in choice.items():
        if value is not None and key != "delta" and key != "index":
            return None
    for key, value in delta.items():
        if value is not None and key != "content" and key != "role":
            return None
    return choice


def _joined(text: tuple[dict[str, Any], dict[str, Any]], chunk: dict[str, Any], other: dict[str, Any]) -> bool:
    """Append the text of `chunk` (a text-only chunk, `other` its choice: `_text_only`) to the text chunk `text`
    (the chunk and its choice) when it is of the same choice, role and response (its other fields equal): what
    LangChain's merge of the two message chunks would make of them. False (nothing changed) otherwise."""
    first, choice = text
    if other.get("index") != choice.get("index") or len(chunk) != len(first):
        return False
    role = other["delta"].get("role")
    if role is not None and role != choice["delta"].get("role"):
        return False
    for key, value in first.items():
        if key != "choices" and chunk.get(key) != value:
            return False
    choice["delta"]["content"] += other["delta"]["content"]
    return True


def _data(event: bytes) -> bytes | None:
    """The `data:` payload of one SSE event (its lines joined by newlines), None when it has none."""
    if event.startswith(b"data: ") and b"\n" not in event:  # the common case: one data line
        return event[6:]
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def openai_chat_model(**settings: Any) -> Any:
    """A ChatOpenAI with these settings, streaming through `RawCompletions`, that converts each message
    object into its request-body dict once (`_remembering_class`)."""
    return raw_streams(_remembering_class()(**settings))


@functools.cache
def _remembering_class() -> type:
    """ChatOpenAI remembering the Chat Completions dict of every message it converted, for as long as the
    message object lives (a weak reference: the memo never keeps a message alive).

    Built at the first use: langchain_openai stays imported only where an OpenAI-type model is built.
    LangChain converts the whole history into OpenAI dicts at every call, and its conversion walks an
    assistant message's text character by character (`for block in message.content`): 27 µs per message,
    5.5 ms of a turn's server CPU at 1,000 messages (issue 31). Each message is still converted by
    LangChain's own `_get_request_payload`, once; only the list it builds is reassembled here. Messages
    are never changed after they are built (LangChain's are not edited in place anywhere in agent-mcp)."""
    from langchain_core.messages import BaseMessage
    from langchain_openai import ChatOpenAI
    from pydantic import PrivateAttr

    class RememberingChatOpenAI(ChatOpenAI):
        _converted: dict[int, tuple[weakref.ref[Any], dict[str, Any]]] = PrivateAttr(default_factory=dict)

        def _get_request_payload(self, input_: Any, *, stop: list[str] | None = None, **kwargs: Any
                                 ) -> dict[str, Any]:
            payload = super()._get_request_payload([], stop=stop, **kwargs)
            if "messages" not in payload:  # the Responses API: its input is built differently, left to LangChain
                return super()._get_request_payload(input_, stop=stop, **kwargs)
            memo = self._converted  # a private attribute: read once, pydantic's lookup of it costs 3 µs
            dicts: list[dict[str, Any] | BaseMessage] = []  # a message until converted below
            # A list of messages (what the agent loop passes) is read as it is: LangChain's conversion would
            # validate each into a prompt value first, a slower pass over the whole history at every call.
            messages = input_ if isinstance(input_, list) and all(isinstance(m, BaseMessage) for m in input_) \
                else self._convert_input(input_).to_messages()
            new = []
            for message in messages:
                known = memo.get(id(message))
                if known is not None and known[0]() is message:
                    dicts.append(known[1])
                else:
                    new.append(len(dicts))
                    dicts.append(message)
            if new:  # converted in one call (a call per message cost a cold 1,000-message turn 11 ms more)
                for at, converted in zip(new, self._convert([dicts[at] for at in new]), strict=True):
                    dicts[at] = converted
            payload["messages"] = dicts
            return payload

        def _convert(self, messages: list[Any]) -> list[dict[str, Any]]:
            """LangChain's request dicts of `messages` (one each, in order), remembered.

            A plain text message (a user's, or an assistant's without tool calls, no name, nothing else set)
            becomes `{"content": text, "role": role}` here, as LangChain makes it: hand-written on purpose (issue
            31), since LangChain walks an assistant's text character by character looking for audio blocks: its
            conversion was half of a turn on a history not yet converted in cProfile, and the first turn on 1,000
            messages after a start took 25 → 21 ms of the main thread. The rest is LangChain's, in one call. A
            test compares the two on every kind of message."""
            plain = [_plain_dict(message) for message in messages]
            others = [message for message, body in zip(messages, plain, strict=True) if body is None]
            rest = iter(super()._get_request_payload(others)["messages"] if others else ())
            converted = [next(rest) if body is None else body for body in plain]
            memo = self._converted
            for message, body in zip(messages, converted, strict=True):
                key = id(message)
                memo[key] = (weakref.ref(message, functools.partial(_forget, memo, key)), body)
            return converted

    return RememberingChatOpenAI


def _plain_dict(message: Any) -> dict[str, Any] | None:
    """The request dict of a plain text user or assistant message (`RememberingChatOpenAI._convert`), else None."""
    role = _plain_roles().get(type(message))
    if (role is None or type(message.content) is not str or message.name is not None or message.additional_kwargs
            or (role == "assistant" and (message.tool_calls or message.invalid_tool_calls))):
        return None
    return {"content": message.content, "role": role}


@functools.cache
def _plain_roles() -> dict[type, str]:
    from langchain_core.messages import AIMessage, HumanMessage

    return {HumanMessage: "user", AIMessage: "assistant"}


def raw_streams(llm: Any) -> Any:
    """`llm` (a ChatOpenAI) with its streamed Chat Completions calls going through `RawCompletions`.

    A function, so that it applies to any ChatOpenAI: `openai_chat_model`'s, or a stock one (the tests and
    benchmarks compare the two)."""
    if not isinstance(llm.async_client, RawCompletions):
        llm.async_client = RawCompletions(llm.async_client, llm.root_async_client)
    return llm
