"""failures.py: one reading of every client library's exceptions, one sentence per way a backend fails."""

from __future__ import annotations

import httpx
import openai
import pytest

from failures import Service, describe, failure

REQUEST = httpx.Request("POST", "http://127.0.0.1:9/v1/chat")
SERVICE = Service("Search", where="http://127.0.0.1:9", key="SEARCH_KEY", timeout=5,
                  says={404: "Search does not know that index"}, advice={404: "set index", 429: "buy more"})


def _openai_status(status: int, body: object) -> openai.APIStatusError:
    response = httpx.Response(status, request=REQUEST, json={"error": body})
    return openai.APIStatusError(f"Error code: {status} - {body}", response=response, body=body)


def _wrapped(inner: BaseException) -> RuntimeError:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise RuntimeError("the SDK's own wrapper") from exc
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(("exc", "kind", "status", "message"), [
    (httpx.ReadTimeout("timed out", request=REQUEST), "timeout", None, ""),
    (openai.APITimeoutError(request=REQUEST), "timeout", None, ""),
    (_wrapped(TimeoutError()), "timeout", None, ""),  # found through the chain of causes
    (httpx.ConnectError("All connection attempts failed", request=REQUEST), "unreachable", None,
     "ConnectError: All connection attempts failed"),
    (_wrapped(ConnectionRefusedError(111, "Connection refused")), "unreachable", None,
     "ConnectionRefusedError: [Errno 111] Connection refused"),
    (_openai_status(429, {"message": "slow down."}), "status", 429, "slow down"),
    (_openai_status(500, "boom"), "status", 500, "boom"),
    (httpx.HTTPStatusError("Server error '502 Bad Gateway' for url …", request=REQUEST,
                           response=httpx.Response(502, request=REQUEST)), "status", 502, "Bad Gateway"),
    (ValueError("not JSON"), "other", None, "ValueError: not JSON"),
])
def test_every_library_reads_the_same(exc, kind, status, message) -> None:
    found = failure(exc)
    assert (found.kind, found.status, found.message) == (kind, status, message)


@pytest.mark.parametrize(("exc", "kwargs", "line"), [
    (httpx.ReadTimeout("t", request=REQUEST), {}, "no answer from Search within 5 s; try again later"),
    (httpx.ConnectError("refused", request=REQUEST), {},
     "cannot reach Search at http://127.0.0.1:9 (ConnectError: refused); check the network"),
    (_openai_status(401, "bad key"), {}, "Search rejected the API key (HTTP 401: bad key); check SEARCH_KEY in .env"),
    (_openai_status(400, "API key not valid"), {"key_rejected": True},
     "Search rejected the API key (HTTP 400: API key not valid); check SEARCH_KEY in .env"),
    (_openai_status(404, "no index"), {}, "Search does not know that index (HTTP 404: no index); set index"),
    (_openai_status(429, "slow"), {}, "Search rate limit reached (HTTP 429: slow); buy more"),
    (_openai_status(503, "down"), {}, "Search answered HTTP 503: down; try again later"),
    (_openai_status(418, "teapot"), {}, "Search answered HTTP 418: teapot"),
    (RuntimeError("one class per status"), {"status": 429, "message": "quota"},
     "Search rate limit reached (HTTP 429: quota); buy more"),
])
def test_one_sentence_per_failure(exc, kwargs, line) -> None:
    assert describe(SERVICE, exc, **kwargs) == line
