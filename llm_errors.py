"""What a failed model call means: the error kinds, whether to retry, and one line for the user.

The loop (agents.py), the model calls (models.py) and the delegation tools (tools.py) all describe a
backend's failure the same way; `failures.py` digs the cause out of the SDKs' exception chains.
"""

from __future__ import annotations

import json
import sys
from typing import Literal

import httpx
from langchain_core.exceptions import ModelConnectionError, ModelError, ModelRateLimitError

import budget
import failures
from config import ModelConfig


class LLMError(Exception):
    """A model call failed; the message names the model, the cause and what to do."""


class ContextFull(LLMError):
    """The next request does not fit the model's context window, even with the history trimmed."""


class StreamCut(LLMError):
    """The model's stream ended before the model finished (no finish reason came: the backend stopped sending or
    the connection broke); `partial` is the answer text that came before."""

    def __init__(self, how: str, partial: str):
        super().__init__(f"the answer was cut off: {how}")
        self.how, self.partial = how, partial


#: Exception classes (by name) that mean a connection broke mid-answer: the body ended before its end.
_BROKEN_OFF = frozenset({"ClientPayloadError", "RemoteProtocolError", "ReadError", "IncompleteRead",
                         "ServerDisconnectedError", "ConnectionResetError"})


#: HTTP statuses of a backend that may answer a second attempt (overloaded, restarting, rate-limited).
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


def _openai(name: str) -> tuple[type[BaseException], ...]:
    """The `openai` SDK's exception class `name`, when the SDK is loaded (none otherwise). It is imported
    with the first OpenAI-type model built (models.chat_model) or a plugin that uses it, not here: until
    then, no error of its can have happened."""
    sdk = sys.modules.get("openai")
    found = getattr(sdk, name, None)
    return (found,) if isinstance(found, type) and issubclass(found, BaseException) else ()


def llm_error_kind(exc: BaseException) -> Literal["timeout", "cut", "backend"]:
    """"timeout" when the model did not answer within llm_call_timeout, "cut" when its stream ended before its
    finish reason (StreamCut), else "backend" (any other failure)."""
    if isinstance(exc, StreamCut):
        return "cut"
    return "timeout" if failures.failure(exc).kind == "timeout" else "backend"


def broke_off(exc: BaseException, began: bool) -> str | None:
    """What broke, when `exc` (raised while a stream was being read) says the connection closed or broke before the
    body's end, not that the backend was slow or reported an error of its own; else None. `began`: chunks of the
    stream had come (then any lost connection counts; before, only a body that broke off, not a refused connect)."""
    found = failures.failure(exc)
    if found.kind == "timeout" or (isinstance(exc, _openai("APIError"))
                                   and not isinstance(exc, _openai("APIConnectionError"))):  # the backend's error event
        return None
    for e in failures.chain(exc):  # (aiohttp's names the body's end missing with a status 400: first)
        if any(cls.__name__ in _BROKEN_OFF for cls in type(e).__mro__):
            return f"{type(e).__name__}: {_words(str(e))}" if str(e) else type(e).__name__
    return found.message if began and found.kind == "unreachable" else None


def retryable(exc: BaseException) -> bool:
    """Whether a model call that failed this way, before any output, may be tried again: a refused
    connection or a 429/5xx answer, never a timeout (a hanging backend would be waited on again)."""
    if llm_error_kind(exc) == "timeout":
        return False
    connection = (*_openai("APIConnectionError"), httpx.ConnectError, ConnectionError, ModelConnectionError,
                  ModelRateLimitError)
    return any(isinstance(e, connection) or failures.status_of(e) in _RETRY_STATUSES for e in failures.chain(exc))


def from_backend(exc: BaseException) -> bool:
    """Whether `exc` reports a failure of the model backend (as opposed to a bug on this side)."""
    reported: tuple[type[BaseException], ...] = (LLMError, *_openai("APIError"), httpx.HTTPError, TimeoutError,
                                                 ConnectionError, ModelError, json.JSONDecodeError)
    return any(isinstance(e, reported) or failures.status_of(e) is not None for e in failures.chain(exc))


def describe_llm_error(exc: BaseException, key: str, cfg: ModelConfig | None) -> str:
    """One line for the user: which model failed, why, and what to do."""
    where = f"model '{key}'" + (f" at {cfg.host}" if cfg and cfg.host else "")
    if isinstance(exc, StreamCut):
        kept = f"the {len(exc.partial):,} characters that came are kept, marked as cut off" if exc.partial \
            else "no answer text had come"
        return f"{where}: {exc} ({kept}); ask again, or say 'continue'"
    if isinstance(exc, LLMError):
        return str(exc)
    if llm_error_kind(exc) == "timeout":
        timeout = f"{cfg.llm_call_timeout:g}" if cfg else "?"
        return (f"{where}: no answer within {timeout} s (llm_call_timeout), not retried. Check that the model "
                f"server runs and is not overloaded, or raise the limit with !llm_timeout {key} <seconds>")
    found = failures.failure(exc)
    if found.kind == "unreachable":
        cause = found.error.__cause__ or found.error
        return f"{where}: cannot connect ({cause}); is the server running and the host right?"
    if found.status == 401:
        if cfg is not None and not cfg.env_key:  # a keyless model (a local server) sent no key at all
            return (f"{where}: the backend wants an API key (HTTP 401) and this model sends none: put the key in "
                    f".env and name its variable as env_key of '{key}' in llm-models.json")
        variable = cfg.env_key if cfg else "the model's API key variable"
        return f"{where}: the backend refused the API key (HTTP 401); check {variable} in .env (or the environment)"
    if found.kind == "status":
        return f"{where}: the backend answered HTTP {found.status}: {_words(found.message)}"
    if isinstance(exc, _openai("APIError")):
        return f"{where}: the backend reported an error: {_words(exc.message)}"  # type: ignore[attr-defined]  # APIError
    if isinstance(exc, json.JSONDecodeError | ValueError | httpx.HTTPError):
        return f"{where}: malformed response from the backend ({type(exc).__name__}: {_words(str(exc))})"
    return f"{where}: {type(exc).__name__}: {_words(str(exc))}"


def _words(text: str) -> str:
    """A backend's words as a user may read them: first line, no credentials, short (failures.summary)."""
    return failures.summary(text)


def failure_kind(exc: BaseException) -> str:
    """How a model call failed, for metrics: context_overflow, stream_cut, timeout, unreachable, http_<status> or
    other."""
    if overflowed(exc):
        return "context_overflow"
    if isinstance(exc, StreamCut):
        return "stream_cut"
    found = failures.failure(exc)
    if found.kind == "status" and found.status:
        return f"http_{found.status}"
    return found.kind if found.kind in ("timeout", "unreachable") else "other"


def overflowed(exc: BaseException) -> bool:
    """Whether the backend said the request exceeds its context window."""
    return any(budget.is_overflow(failures.status_of(e), str(e)) for e in failures.chain(exc))

