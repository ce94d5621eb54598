"""Fake Gemini Developer API server (for `ChatGoogleGenerativeAI(base_url=backend.base_url)` / google-genai).

Run `python -m tests.fakes.gemini_backend --port 9101` for a foreground echo server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

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

_STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "NOT_IMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def _function_call(call: ToolCall) -> dict[str, Any]:
    body: dict[str, Any] = {"name": call.name, "args": call.args}
    if call.id is not None:
        body["id"] = call.id
    return {"functionCall": body}


class FakeGemini(FakeBackend):
    """Fake Gemini server: `POST /v1beta/models/<model>:generateContent` and `:streamGenerateContent?alt=sse`.

    Give ChatGoogleGenerativeAI `base_url=backend.base_url` (the bare server URL).
    """

    def routes(self) -> Sequence[BaseRoute]:
        """Both generate methods share one route; the method is the suffix after the model name."""
        return [Route("/v1beta/models/{rest:path}", self.handle, methods=["POST"])]

    def wants_stream(self, request: RecordedRequest) -> bool:
        """Gemini streams on the `:streamGenerateContent` method."""
        return request.path.endswith(":streamGenerateContent")

    def extract_last_user_text(self, body: Any) -> str:
        """The last `text` part of a `user` turn in `contents`."""
        for content in reversed(body.get("contents") or []):
            if content.get("role", "user") != "user":
                continue
            texts = [part["text"] for part in content.get("parts") or [] if "text" in part]
            if texts:
                return texts[-1]
        return ""

    def finishes(self, payload: str) -> bool:
        """A response whose candidate has a `finishReason`."""
        return any(c.get("finishReason") for c in json.loads(payload).get("candidates") or [])

    def error_body(self, reply: ErrorReply) -> dict[str, Any]:
        """`{"error": {"code", "message", "status"}}` as Google APIs send it."""
        status = _STATUS_NAMES.get(reply.status, "INTERNAL" if reply.status >= 500 else "FAILED_PRECONDITION")
        return {"error": {"code": reply.status, "message": reply.message, "status": status}}

    def render_json(self, reply: TextReply | ToolCallsReply, request: RecordedRequest) -> dict[str, Any]:
        """One complete `GenerateContentResponse` (a single text part for text answers)."""
        if isinstance(reply, TextReply):
            return self._response([{"text": reply.content}], request, len(reply.chunks), final=True)
        parts = [{"text": reply.text_before}] if reply.text_before else []
        parts += [_function_call(call) for call in reply.calls]
        return self._response(parts, request, 5 * len(reply.calls), final=True)

    async def render_stream(
        self, reply: TextReply | ToolCallsReply, request: RecordedRequest, end: bool = True
    ) -> AsyncIterator[str]:
        """One `GenerateContentResponse` per chunk; the last carries finishReason and usage (with `end`). No
        [DONE]."""
        if isinstance(reply, TextReply):
            last = len(reply.chunks) - 1 if end else -1
            for i, piece in enumerate(reply.chunks):
                await self.pace(reply, i)
                yield json.dumps(self._response([{"text": piece}], request, i + 1, final=i == last))
            return
        if reply.text_before:
            yield json.dumps(self._response([{"text": reply.text_before}], request, 1, final=False))
        calls = [_function_call(call) for call in reply.calls]
        yield json.dumps(self._response(calls, request, 5 * len(reply.calls), final=end))

    def _response(
        self, parts: list[dict[str, Any]], request: RecordedRequest, output_tokens: int, *, final: bool
    ) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
        response: dict[str, Any] = {"candidates": [candidate], "modelVersion": self._model(request)}
        if final:
            prompt_tokens = len(json.dumps((request.json or {}).get("contents", [])).split())
            candidate["finishReason"] = "STOP"
            response["usageMetadata"] = {
                "promptTokenCount": prompt_tokens,
                "candidatesTokenCount": output_tokens,
                "totalTokenCount": prompt_tokens + output_tokens,
            }
            response["responseId"] = new_id("resp-")
        return response

    @staticmethod
    def _model(request: RecordedRequest) -> str:
        return request.path.rsplit("/", 1)[-1].split(":", 1)[0]


if __name__ == "__main__":
    run_cli(FakeGemini)
