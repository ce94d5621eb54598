"""A failed call to a backend (a model API, a search service, Drive), told in one line that says what to do.

`failure(exc)` reads any client library's exception the same way, through the chain of causes SDKs
wrap around the transport's error: the backend did not answer in time, could not be reached, or
answered an HTTP error status with a message. `describe(service, exc)` writes the sentence, with the
service's own words and advice for each status (which setting holds its key, what to change on a
404, ...). Every plugin that calls a backend, and the model loop, read failures through here.
A backend's own words are never passed on whole: `summary(text)` keeps the first line, without
credentials (`sk-…` keys, `Bearer …`, `key=…`/`api_key=…`/`token=…`, URL passwords), and short.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

#: Exception classes (by name, so no client library is imported here) that mean "no answer in time".
_TIMEOUTS = frozenset({"TimeoutError", "TimeoutException", "APITimeoutError", "ModelTimeoutError"})
#: … and "could not reach it": refused or reset connections, DNS and TLS failures.
_UNREACHABLE = frozenset({"ConnectionError", "ConnectError", "APIConnectionError", "TransportError",
                          "ModelConnectionError", "HttpLib2Error", "OSError"})

#: … and what was refused, reset or closed, not slow, even when a timeout wraps it (aiohttp's connection errors
#: that are not its timeouts: the OpenAI SDK's aiohttp transport names them all a connect timeout).
_REFUSED = frozenset({"ConnectionError", "ClientConnectionError"})


#: Credentials as backends echo them in error bodies (a key in a URL, a header, a JSON field).
_SECRETS = re.compile(
    r"(?i)\b(?:sk|pk|rk)-[A-Za-z0-9_\-]{6,}"                       # OpenAI-style keys (sk-…, sk-proj-…)
    r"|\bAIza[0-9A-Za-z_\-]{20,}"                                  # Google API keys
    r"|\bxox[abprs]-[A-Za-z0-9\-]+"                                 # Slack tokens
    r"|\b(?:bearer|basic|token)\s+[A-Za-z0-9._~+/=\-]{6,}"          # Authorization: Bearer …
    r"|(?<=://)[^/\s:@]*:[^/\s@]*(?=@)"                              # user:password@ in a URL
)
_SECRET_FIELDS = re.compile(
    r"(?i)\b((?:x-)?(?:api[_-]?key|access[_-]?token|refresh[_-]?token|id[_-]?token|token|secret|client[_-]?secret"
    r"|password|passwd|pwd|key|auth|authorization|signature|sig|credentials?))(\s*[\"']?\s*[=:]\s*[\"']?)"
    r"[^\s\"'&,;}]+")
#: The longest backend message passed on, in characters.
SUMMARY_LIMIT = 300
REDACTED = "<redacted>"


def summary(text: str, limit: int = SUMMARY_LIMIT) -> str:
    """A backend's message as clients may see it: its first non-empty line, credentials replaced by
    `<redacted>`, whitespace collapsed, at most `limit` characters."""
    first = next((line for line in str(text).splitlines() if line.strip()), "")
    clean = _SECRETS.sub(REDACTED, first)  # first: `Authorization: Bearer <token>` loses the token whole
    clean = " ".join(_SECRET_FIELDS.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", clean).split())
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


@dataclass(frozen=True)
class Failure:
    """What a backend call's exception says: `kind`, the HTTP `status` when it answered one, its `message`."""

    kind: Literal["timeout", "unreachable", "status", "other"]
    error: BaseException
    status: int | None = None
    message: str = ""


def chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from (SDKs and LangChain wrap the transport's errors)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _said(exc: BaseException) -> str:
    """What a connection error says: the operating system's error for aiohttp's, whose own text names its TLS
    context object ("Cannot connect to host … ssl:<ssl.SSLContext object at 0x…> [Connect call failed …]")."""
    cause = getattr(exc, "os_error", None)
    exc = cause if isinstance(cause, OSError) else exc
    return f"{type(exc).__name__}: {exc}"


def _is(exc: BaseException, names: frozenset[str]) -> bool:
    return any(cls.__name__ in names for cls in type(exc).__mro__)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status a backend answered with, if `exc` carries one (openai, httpx, google-genai, googleapiclient)."""
    response = getattr(exc, "response", None)
    for value in (getattr(exc, "status_code", None), getattr(exc, "code", None),
                  getattr(response, "status_code", None)):
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def _message(exc: BaseException) -> str:
    """The backend's own words: an error body's message, else the exception's, without the status repeated."""
    body = getattr(exc, "body", None)
    inner = body.get("error", body.get("message")) if isinstance(body, dict) else body
    if isinstance(inner, dict):
        inner = inner.get("message")
    text = inner if isinstance(inner, str) and inner.strip() else getattr(exc, "message", None)
    if not isinstance(text, str):
        response = getattr(exc, "response", None)
        phrase = getattr(response, "reason_phrase", None)  # httpx: its own text repeats the URL
        text = phrase if isinstance(phrase, str) else str(getattr(exc, "reason", None) or exc)
    # openai: "Error code: 429 - {…}" repeats the status before the body.
    return summary(re.sub(r"^Error code: \d+(?: - )?", "", text)).rstrip(".")


def failure(exc: BaseException) -> Failure:
    """How the call failed, read from `exc` and its causes (a timeout wins over what wraps it)."""
    errors = list(chain(exc))
    for e in errors:
        if _is(e, _TIMEOUTS):
            refused = next((c for c in chain(e) if _is(c, _REFUSED) and not _is(c, _TIMEOUTS)), None)
            if refused is not None:  # a transport that names every failed connect a timeout (the OpenAI SDK's aiohttp)
                return Failure("unreachable", refused, message=_said(refused))
            return Failure("timeout", e)
    for e in errors:
        status = status_of(e)
        if status is not None:
            return Failure("status", e, status, _message(e))
    for e in errors:
        if _is(e, _UNREACHABLE):
            return Failure("unreachable", e, message=_said(e))
    return Failure("other", exc, message=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


@dataclass(frozen=True)
class Service:
    """A backend as its error messages name it, and what to advise for each way it fails."""

    name: str
    #: Its address, named when it cannot be reached.
    where: str = ""
    #: The setting that holds its key, named when it rejects the key (HTTP 401).
    key: str = ""
    timeout: float | None = None
    #: Instead of "<name> answered HTTP <status>", by status: what that answer means here.
    says: Mapping[int, str] = field(default_factory=dict)
    #: What to do, by status (5xx default: try again later).
    advice: Mapping[int, str] = field(default_factory=dict)


def describe(service: Service, exc: BaseException, *, status: int | None = None, message: str | None = None,
             key_rejected: bool = False) -> str:
    """One line: what went wrong talking to `service` and what to do. `status` / `message` override what
    `exc` says (for libraries that raise one class per status without carrying it); `key_rejected` says
    the answer, whatever its status, means the key is wrong."""
    found = failure(exc)
    if status is not None:
        found = Failure("status", exc, status, found.message if message is None else message)
    elif message is not None:
        found = Failure(found.kind, found.error, found.status, message)
    name = service.name
    if found.kind == "timeout":
        within = f" within {service.timeout:g} s" if service.timeout else ""
        return f"no answer from {name}{within}; try again later"
    if found.kind == "unreachable":
        where = f" at {service.where}" if service.where else ""
        return f"cannot reach {name}{where} ({found.message}); check the network"
    if found.kind == "other":
        return found.message
    code = found.status
    assert code is not None
    http = f"HTTP {code}" + (f": {found.message}" if found.message else "")
    advice = service.advice.get(code) or ("try again later" if code >= 500 else "")
    if code in service.says:
        line = f"{service.says[code]} ({http})"
    elif code == 401 or key_rejected:
        line = f"{name} rejected the API key ({http})"
        advice = advice or (f"check {service.key} in .env" if service.key else "check its credentials")
    elif code == 429:
        line = f"{name} rate limit reached ({http})"
        advice = advice or "wait a while"
    else:
        line = f"{name} answered {http}"
    return f"{line}; {advice}" if advice else line

