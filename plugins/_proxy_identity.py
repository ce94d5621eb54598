"""Who a proxy request comes from, proven: per-user keys, and forwarded headers only from a trusted forwarder.

A chat app in front of the proxy (open-webui) can say which of its users and chats a request is
for (`X-OpenWebUI-User-Id`, `X-OpenWebUI-Chat-Id`) and from which address (`X-Forwarded-For`).
Anyone can send those headers, so they count only when the request carries a key configured as a
forwarder's (`forwarders`) AND comes from an address in `trusted_proxies`; otherwise they are
ignored, and that is logged once per source address. Per-user keys (`user_keys`: the SHA-256 of a
key → a user name, in the spirit of LiteLLM's virtual keys) tell the users of one proxy apart
without trusting any header; keys are stored only as digests and compared in constant time.

The proven identity (`Caller.identity`) names the caller's sessions, scopes the conversation
fingerprints (a replayed transcript never continues another identity's session) and keys the
rate limits. Not a plugin itself; `plugin_proxy_llama` imports it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator
from starlette.requests import Request

logger = logging.getLogger("agent_mcp.proxy")

USER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
#: open-webui's forwarded headers (ENABLE_FORWARD_USER_INFO_HEADERS).
FORWARDED_HEADERS = ("x-openwebui-user-id", "x-openwebui-chat-id", "x-openwebui-user-name",
                     "x-openwebui-user-email", "x-openwebui-user-role", "x-forwarded-for")
#: Sources whose ignored headers were logged; beyond this many, nothing more is logged.
MAX_LOGGED_SOURCES = 1024


class IdentityError(Exception):
    """A request whose credential is refused (401); the message says what to send."""


def key_digest(key: str) -> str:
    """The `user_keys` entry of a key: `sha256:<hex>` (what `agentctl proxy-key` prints)."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class IdentitySettings(BaseModel):
    """The identity part of `plugin_config.plugin_proxy_llama` (mixed into its settings model)."""

    model_config = ConfigDict(extra="forbid")

    #: Addresses or networks (`127.0.0.1`, `10.0.0.0/8`) of forwarders whose headers may count.
    trusted_proxies: list[str] = []
    #: `sha256:<hex of the key>` → user name. With any entry, every request needs one of these keys
    #: (or the port token `token_env`, if set) as `Authorization: Bearer <key>`.
    user_keys: dict[str, str] = {}
    #: User names (of `user_keys`) that are forwarders: their requests from `trusted_proxies` may say
    #: which user, chat and address they are for.
    forwarders: list[str] = []
    #: With `user_keys`: refuse requests without one of them (401). False lets keyless requests in as
    #: anonymous callers, told apart only by their address (as without any keys), unless the port
    #: token (`token_env`) is set.
    keys_required: bool = True

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        bad = []
        for entry in v:
            try:
                ipaddress.ip_network(entry.strip(), strict=False)
            except ValueError:
                bad.append(entry)
        if bad:
            raise ValueError(f"not an address or network: {', '.join(map(repr, bad))}; write e.g. 127.0.0.1 or "
                             "10.0.0.0/8")
        return [e.strip() for e in v]

    @field_validator("user_keys")
    @classmethod
    def _keys(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not _DIGEST.match(k)]
        if bad:
            raise ValueError(f"a key must be given as its digest, 'sha256:' + 64 hex digits (got {bad[0][:20]!r}…); "
                             "print it with: python -c \"import hashlib,sys;print('sha256:'+hashlib.sha256("
                             "sys.argv[1].encode()).hexdigest())\" <key>")
        names = [n for n in v.values() if not USER_NAME.match(n)]
        if names:
            raise ValueError(f"user name {names[0][:70]!r} may have only letters, digits and . _ - (1-64)")
        return v

    @model_validator(mode="after")
    def _forwarders_known(self) -> IdentitySettings:
        unknown = sorted(set(self.forwarders) - set(self.user_keys.values()))
        if unknown:
            raise ValueError(f"forwarders {', '.join(unknown)} have no key in user_keys; add "
                             "\"sha256:<digest of its key>\": \"<name>\" there")
        if self.forwarders and not self.trusted_proxies:
            raise ValueError("forwarders need trusted_proxies: the addresses they connect from")
        return self


@dataclass(frozen=True)
class Caller:
    """Who a proxy request is from, as far as it is proven."""

    #: The TCP peer, or the client address a trusted forwarder named.
    address: str
    #: The key holder's user name; "token" for the shared port token; None without a key.
    user: str | None = None
    #: The user a trusted forwarder named (open-webui's user id), made safe for an id.
    forwarded_user: str | None = None
    #: The chat a trusted forwarder named, made safe for an id.
    chat: str | None = None
    #: A digest of an unverified bearer (anonymous proxies): narrows fingerprints, proves nothing.
    bearer: str = ""

    @property
    def identity(self) -> str:
        """The proven identity: rate limits and sessions follow it, never a client id."""
        if self.user is not None:
            return f"{self.user}/{self.forwarded_user}" if self.forwarded_user else self.user
        return f"address:{self.address}"

    @property
    def scope(self) -> str:
        """What a conversation fingerprint is bound to: the identity (and, anonymous, the bearer sent)."""
        return f"{self.identity}\x00{self.bearer}"

    @property
    def slug(self) -> str:
        """The identity as a piece of a client id: `<address>` anonymous, else `<user>[-user-<id>]`."""
        if self.user is None:
            return self.address
        return f"{self.user}-user-{self.forwarded_user}" if self.forwarded_user else self.user


def _safe(value: str) -> str:
    return value if _SAFE_ID.match(value) else hashlib.sha256(value.encode()).hexdigest()[:16]


class Identities:
    """Tells callers apart by their key and, for forwarders from a trusted address, their headers."""

    def __init__(self, settings: IdentitySettings, token: str | None):
        self.digests = dict(settings.user_keys)
        self.forwarders = frozenset(settings.forwarders)
        self.networks = [ipaddress.ip_network(e, strict=False) for e in settings.trusted_proxies]
        #: The shared port token, checked here when per-user keys are configured (else the guard does).
        self.token = token
        #: A set port token always demands a credential, whatever `keys_required` says.
        self.required = settings.keys_required or token is not None
        self._logged: set[tuple[str, str]] = set()

    @property
    def checks_keys(self) -> bool:
        """Whether this plugin checks every request's key (per-user keys configured)."""
        return bool(self.digests)

    def trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self.networks)

    def _user_of(self, bearer: str) -> str | None:
        """The user whose key `bearer` is ("token" for the port token), comparing every digest in constant time."""
        digest = key_digest(bearer).encode()
        found = None
        for known, user in self.digests.items():
            if hmac.compare_digest(digest, known.encode()):
                found = user
        if self.token is not None and hmac.compare_digest(bearer.encode(), self.token.encode()):
            found = found or "token"
        return found

    def caller(self, request: Request) -> Caller:
        """The request's caller; IdentityError when keys are required and it has none of them."""
        peer = request.client.host if request.client else "unknown"
        auth = request.headers.get("authorization", "")
        bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        user = self._user_of(bearer) if bearer and self.digests else None
        if self.digests and user is None and self.required:
            raise IdentityError("unauthorized: send Authorization: Bearer <your proxy key> (a key listed in "
                                "plugin_config.plugin_proxy_llama.user_keys)")
        if self.token is not None and not self.digests:
            user = "token"  # the guard already checked the port token
        sent = [h for h in FORWARDED_HEADERS if h in request.headers]
        if user is not None and user in self.forwarders and self.trusted(peer):
            return Caller(self._forwarded_address(request, peer), user,
                          _safe(fu) if (fu := request.headers.get("x-openwebui-user-id", "").strip()) else None,
                          _safe(c) if (c := request.headers.get("x-openwebui-chat-id", "").strip()) else None)
        if sent:
            why = ("no forwarder key" if user is None or user not in self.forwarders
                   else "an address not in trusted_proxies")
            self._log_ignored(peer, why, sent)
        unproven = "" if user is not None or not bearer else hashlib.sha256(bearer.encode()).hexdigest()
        return Caller(peer, user, bearer=unproven)

    def _forwarded_address(self, request: Request, peer: str) -> str:
        """The client address a trusted forwarder names: the right-most X-Forwarded-For entry that is not
        itself a trusted proxy (entries left of it could be made up by the client), else the peer."""
        entries = [e.strip() for e in request.headers.get("x-forwarded-for", "").split(",") if e.strip()]
        for entry in reversed(entries):
            try:
                address = str(ipaddress.ip_address(entry))
            except ValueError:
                return peer  # a malformed chain proves nothing past the forwarder itself
            if not self.trusted(address):
                return address
        return peer

    def _log_ignored(self, source: str, why: str, headers: list[str]) -> None:
        if (source, why) in self._logged or len(self._logged) >= MAX_LOGGED_SOURCES:
            return
        self._logged.add((source, why))
        logger.warning("ignored forwarded headers (%s) from %s: %s; they count only with a forwarder's key from "
                       "trusted_proxies (plugin_config.plugin_proxy_llama); logged once per source",
                       ", ".join(headers), source, why)


def config_extra(identities: Identities) -> dict[str, Any]:
    """What the proxy's `get_config` says about authentication when it checks keys itself."""
    if not identities.checks_keys:
        return {}
    return {"authenticates_requests": identities.required, "token": None}
