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
"""

from __future__ import annotations

from typing import Any

from openai import AsyncStream

#: `create()` keyword arguments that are request options, not body fields, and the option each becomes
#: (as the SDK's `make_request_options` maps them).
_OPTIONS = {"extra_headers": "headers", "extra_query": "params", "extra_body": "extra_json", "timeout": "timeout"}


class RawCompletions:
    """The SDK client's `chat.completions` with one change: a streamed `create()` without
    `response_format` posts its body as given and streams plain dicts. Everything else is the SDK's."""

    def __init__(self, completions: Any, client: Any):
        self._completions = completions
        self._client = client

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
        return await self._client.post("/chat/completions", body=params, cast_to=object, options=options,
                                       stream=True, stream_cls=AsyncStream[object])


def raw_streams(llm: Any) -> Any:
    """`llm` (a ChatOpenAI) with its streamed Chat Completions calls going through `RawCompletions`.

    A function, not a subclass: langchain_openai stays imported only where an OpenAI-type model is
    built (the warm-up does it before serving)."""
    if not isinstance(llm.async_client, RawCompletions):
        llm.async_client = RawCompletions(llm.async_client, llm.root_async_client)
    return llm
