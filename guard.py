"""The HTTP guard in front of every listener: who may reach a port at all, before any route runs.

Loopback is not a trust boundary: any web page the user opens can send requests to 127.0.0.1
(cross-site "simple requests", DNS rebinding) and so can every local user. `Guard` wraps each
listener's app once (agent-mcp.py `build_app`) and checks, in this order:

1. `Host` must be a name the listener is reachable as → else 421 (defeats DNS rebinding);
2. a request carrying `Origin` must come from an allowed origin → else 403; CORS preflights are
   answered (204) for allowed origins only;
3. the listener's bearer token, when it has one → else 401;
4. a request with a body, and every POST/PUT/PATCH, must be `Content-Type: application/json`
   → else 415 (a browser sends text/plain, form and multipart bodies cross-site unasked).

This module also owns the generated token files of the shell endpoint and the API
(`ensure_token_file`, `read_token_file`) and `hide_locations`, which takes where things are (paths, hosts, DSNs) out of
text for readers nobody vouched for. It imports nothing of ours.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel, field_validator
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: Names every listener answers to, on any port (a browser sends one only when it really connected
#: to loopback; a rebinding page always sends its own name).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
#: Methods whose requests must be JSON even without a body (the ones a form or fetch can send data with).
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
SHELL_TOKEN_FILE = "shell-token"
#: The API endpoint's key, generated like the shell token when `API_KEY` is not set.
API_KEY_FILE = "api-key"
_HOST_ENTRY = re.compile(r"^(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(:(\d{1,5}|\*))?$")
_ORIGIN_ENTRY = re.compile(r"^[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(:(\d{1,5}|\*))?$")
_PREFLIGHT_MAX_AGE = "600"
logger = logging.getLogger("agent_mcp.guard")


class TokenFileError(Exception):
    """The token file cannot be created, read or trusted; the message names the path and the fix."""


class ListenerSettings(BaseModel):
    """The guard's settings every client plugin's `plugin_config` block takes (mixed into its model)."""

    #: More `Host` values to accept: `name` (any port), `name:port`, `name:*`; loopback names always pass.
    allowed_hosts: list[str] = []
    #: Browser origins allowed to call this listener: `scheme://host[:port|:*]`, or `*` for any but `null`.
    allowed_origins: list[str] = []

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        out = [h.strip().lower() for h in v]
        bad = [h for h in out if not _HOST_ENTRY.match(h)]
        if bad:
            raise ValueError(f"not a host name: {', '.join(map(repr, bad))}; write `name`, `name:port` or "
                             "`name:*` (no scheme, no path)")
        return out

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        out = [o.strip().lower() for o in v]
        if "null" in out:
            raise ValueError("'null' cannot be allowed: sandboxed frames and local files send it, so anyone could")
        bad = [o for o in out if o != "*" and not _ORIGIN_ENTRY.match(o)]
        if bad:
            raise ValueError(f"not an origin: {', '.join(map(repr, bad))}; write `scheme://host[:port]` "
                             "(no path, no trailing slash), `scheme://host:*`, or `*`")
        return out


def split_host(value: str) -> tuple[str, str | None]:
    """`host[:port]` (IPv6 in brackets) → (lower-case host, port or None)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return value, None
        host, rest = value[:end + 1], value[end + 1:]
        return host, rest[1:] if rest.startswith(":") else None
    host, sep, port = value.partition(":")
    return host, port if sep else None


def _bind_name(bind: str) -> str | None:
    """The Host name of a bind address, or None for a wildcard bind (0.0.0.0, ::)."""
    try:
        ip = ipaddress.ip_address(bind)
    except ValueError:
        return bind.lower()
    if ip.is_unspecified:
        return None
    return f"[{ip}]" if ip.version == 6 else str(ip)


def _matches(entries: Iterable[tuple[str, str | None]], host: str, port: str | None) -> bool:
    """Whether (host, port) matches an entry; an entry's None or `*` port means any port."""
    return any(h == host and (p in (None, "*") or p == port) for h, p in entries)


class Guard:
    """ASGI middleware in front of one listener: Host → 421, Origin → 403, token → 401, JSON → 415."""

    def __init__(self, app: ASGIApp, *, plugin: str, bind: str, port: int, token: str | None = None,
                 allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = (),
                 unavailable: Callable[[], str | None] | None = None, token_hint: str | None = None):
        self.app = app
        #: Where a caller finds the token (said in every 401), e.g. the API's generated key file.
        self.token_hint = token_hint
        #: Why the server cannot serve now (its shared store is unreachable): then 503 with that message.
        self.unavailable = unavailable
        self.plugin = plugin
        names = [*LOOPBACK_NAMES, *([b] if (b := _bind_name(bind)) else [])]
        self.hosts = [(n, None) for n in names] + [split_host(h) for h in allowed_hosts]
        origins = [o.lower() for o in allowed_origins]
        self.any_origin = "*" in origins
        self.origins = {f"http://{n}:{port}" for n in names} | {o for o in origins if not o.endswith(":*")}
        self.origin_prefixes = tuple(o[:-1] for o in origins if o.endswith(":*"))
        self.expected = f"Bearer {token}".encode() if token else None

    def host_allowed(self, host: str) -> bool:
        """Whether `host` (a Host header value) names this listener."""
        return _matches(self.hosts, *split_host(host))

    def origin_allowed(self, origin: str, host: str) -> bool:
        """Whether a request from `origin` may reach this listener, reached as `host` (already allowed)."""
        origin = origin.strip().lower()
        if origin == "null" or "://" not in origin:
            return False
        if self.any_origin or origin in self.origins:
            return True
        if any(origin.startswith(p) and origin[len(p):].isdigit() for p in self.origin_prefixes):
            return True
        scheme, _, authority = origin.partition("://")
        return scheme in ("http", "https") and authority == host.strip().lower()  # same origin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refusal, origin = self._check(scope, Headers(scope=scope))
        if origin is not None:
            send = _with_cors(send, origin)
        if refusal is None and self.unavailable is not None and (down := self.unavailable()):
            refusal = JSONResponse({"error": down}, status_code=503, headers={"Retry-After": "1"})
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            if refusal.status_code >= 400:  # one line per refused request, never a traceback
                client = (scope.get("client") or ("?",))[0]
                logger.info("refused %s %s from %s: %d %s", scope.get("method", "WEBSOCKET"), scope.get("path", ""),
                            client, refusal.status_code, bytes(refusal.body).decode(errors="replace")[:300])
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            else:
                await refusal(scope, receive, send)

    def _check(self, scope: Scope, headers: Headers) -> tuple[Response | None, str | None]:
        """(the refusal or None, the allowed cross-site Origin whose responses carry CORS headers, or None)."""
        where = f"plugin_config.{self.plugin} in plugins-enabled.json"
        host = headers.get("host", "")
        if not self.host_allowed(host):
            return _refuse(421, f"this server is not reachable as Host '{host[:100]}' (DNS rebinding protection); "
                                f"if you reach it by that name, add it to allowed_hosts of {where}"), None
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, host):
            return _refuse(403, f"requests from origin '{origin[:100]}' are not allowed; to let that web app call "
                                f"this server, add it to allowed_origins of {where}"), None
        method = scope.get("method", "GET")
        if origin is not None and method == "OPTIONS" and "access-control-request-method" in headers:
            return _preflight(origin, headers), None  # browsers send no credentials on a preflight
        if self.expected is not None:
            given = headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                hint = f"; {self.token_hint}" if self.token_hint else ""
                return _refuse(401, f"unauthorized: send Authorization: Bearer <token>{hint}"), origin
        if scope["type"] == "http" and (method in BODY_METHODS or _has_body(headers)):
            media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media_type != "application/json":
                return _refuse(415, f"{method} needs Content-Type: application/json (got "
                                    f"'{media_type[:60] or 'none'}'; with curl add -H 'Content-Type: "
                                    "application/json')"), origin
        return None, origin


def _with_cors(send: Send, origin: str) -> Send:
    """`send` that adds the CORS headers of an allowed origin to the response."""
    extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
             (b"access-control-expose-headers", b"Mcp-Session-Id")]

    async def send_with_cors(message: Message) -> None:
        if message["type"] == "http.response.start":  # ours replace the app's own (the MCP SDK sends `*`)
            kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"access-control-allow-origin"]
            message = {**message, "headers": [*kept, *extra]}
        await send(message)

    return send_with_cors


def _has_body(headers: Headers) -> bool:
    return "transfer-encoding" in headers or headers.get("content-length", "0").strip() not in ("", "0")


def _refuse(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status)


def _preflight(origin: str, headers: Headers) -> Response:
    """A CORS preflight answer for an allowed origin: any method, the headers it asked for plus ours."""
    asked = [h.strip() for h in headers.get("access-control-request-headers", "").split(",") if h.strip()]
    allow = ", ".join(dict.fromkeys(["Authorization", "Content-Type", *asked]))
    return Response(status_code=204, headers={
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": "GET, POST, PUT, PATCH, DELETE, OPTIONS",
        "Access-Control-Allow-Headers": allow,
        "Access-Control-Max-Age": _PREFLIGHT_MAX_AGE,
        "Vary": "Origin",
    })


# ── Generated token files (the shell endpoint's token, the API key) ─────────────────────────────


def read_token_file(path: Path, env: str = "AGENT_SHELL_TOKEN") -> str:
    """The token in `path`; TokenFileError when it is missing, unreadable, empty or not private to us.
    `env` is the variable that would set the token instead (named in the messages)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise TokenFileError(f"{path} does not exist: start agent-mcp once (it writes the token there), "
                             f"or set {env}") from None
    except OSError as exc:
        raise TokenFileError(f"cannot read {path} ({exc.strerror}): run as the user who runs the server, "
                             f"or set {env}") from None
    with os.fdopen(fd, encoding="utf-8") as fh:
        info = os.fstat(fh.fileno())
        if info.st_uid != os.getuid():
            raise TokenFileError(f"{path} belongs to another user (uid {info.st_uid}), so it may have been planted: "
                                 f"delete it, or run as its owner")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise TokenFileError(f"{path} is readable by other users, so they could drive the agent: "
                                 f"run chmod 600 {path}")
        token = fh.read().strip()
    if not token:
        raise TokenFileError(f"{path} is empty: delete it and restart agent-mcp to get a new token")
    return token


def ensure_token_file(path: Path, env: str = "AGENT_SHELL_TOKEN") -> str:
    """The token in `path`, written first (random, mode 0600, created exclusively) when the file is missing."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as exc:
        if isinstance(exc, FileExistsError) and path.parent.is_dir():
            return read_token_file(path, env)  # written by an earlier start
        raise TokenFileError(f"cannot create {path} ({exc.strerror}): make {path.parent} a directory this user "
                             f"can write, set AGENT_DATA_DIR to one, or set {env}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(secrets.token_hex(32) + "\n")  # hex: never starts with "-", so `--token <it>` parses
    return read_token_file(path, env)


# ── What a reader nobody vouched for may see ───────────────────────────────────────────────────

#: Addresses, most specific first: a URL with a host (`agentmcp://` names a resource, not a place),
#: `user@host:port[/db]` (database.DatabaseSettings.where), `host:port`, a bare IPv4 address, and an
#: absolute path under a system root. An address glued to a name (`llama-10.0.0.1`, a client id the
#: client knows) and a time (`12:30`) are not locations. Punctuation after a location (`…/v1: the backend`,
#: `…/x.json.`) is the sentence's, and stays.
_LOCATIONS = re.compile(
    r"\b(?!agentmcp://)[a-z][a-z0-9+.-]*://[^\s'\"<>)]*[^\s'\"<>).,:;]"
    r"|[\w.+-]+@[\w.-]+:\d{1,5}(?:/[\w$.-]*)?"
    r"|(?:\[[0-9a-f:.]+\]|(?<![\w.-])[a-z][\w-]*(?:\.[\w-]+)*|(?<![\w.-])\d{1,3}(?:\.\d{1,3}){3}):\d{2,5}\b"
    r"|(?<![\w.-])\d{1,3}(?:\.\d{1,3}){3}(?![\w.-])"
    r"|(?<![\w./~-])(?:/(?:home|Users|root|etc|var|tmp|opt|srv|usr|mnt|media|run|private|Volumes|data|work)"
    r"|[A-Za-z]:\\)(?:[^\s'\"<>),;]*[^\s'\"<>),;.:])?",
    re.IGNORECASE,
)
HIDDEN = "<hidden>"
#: The user:password part of a URL (`http://u:p@host`, `redis://:pw@host`, `mysql://u:p@host/db`).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"<>]*@")


def hide_userinfo(text: str) -> str:
    """`text` with the user and password of every URL in it replaced by `***` (what every log line gets)."""
    return _USERINFO.sub(r"\1***@", text)


def hide_locations(text: str, places: Mapping[str, str | Path] = {}) -> str:
    """`text` without the file paths, hostnames, addresses and DSNs in it.

    `places` names known directories (label → path, e.g. "<data dir>" → the data dir): each is
    replaced by its label first, longest first, so a reader still learns which file is meant.
    Anything else that looks like a location becomes `<hidden>`.
    """
    for label, path in sorted(places.items(), key=lambda item: -len(str(item[1]))):
        if len(str(path)) > 1:
            text = text.replace(str(path), label)
    return _LOCATIONS.sub(HIDDEN, text)
