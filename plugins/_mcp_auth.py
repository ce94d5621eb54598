"""The MCP server's bearer tokens: the token file, its roles (human, agent), and who a request is."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Literal

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from config import field_problems
from plugin_api import PluginConfigError
from plugins import _http
from secret_files import SecretFileError, read_secret_file

#: Client ids of the sessions MCP clients create start with this (the plugin's client-id namespace).
PREFIX = "mcp-"
HUMAN, AGENT = "human", "agent"
#: JSON-RPC error of a request outside the token's role (implementation-defined range of 2026-07-28).
FORBIDDEN = -32001


class TokenEntry(BaseModel):
    """One entry of `mcp-tokens.json`: a role, the token (or its SHA-256), and an agent's session."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["human", "agent"]
    token: str | None = Field(default=None, min_length=16)
    token_sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    session: str | None = Field(default=None, pattern=_http.CLIENT_ID_PATTERN)

    @model_validator(mode="after")
    def _consistent(self) -> TokenEntry:
        if (self.token is None) == (self.token_sha256 is None):
            raise ValueError("give exactly one of 'token' (at least 16 characters) or 'token_sha256'")
        if self.role == AGENT and not self.session:
            raise ValueError("an agent token needs 'session' (the session it is bound to, e.g. \"worker\")")
        if self.role == HUMAN and self.session:
            raise ValueError("a human token reaches every session: remove 'session'")
        return self


class TokenFile(BaseModel):
    """`mcp-tokens.json`: `{"tokens": {"<name>": {...}}}`; names appear in logs and approval records."""

    model_config = ConfigDict(extra="forbid")

    tokens: dict[str, TokenEntry] = Field(min_length=1)


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who holds a token: its name, role and (agents) the client id of its session."""

    name: str
    role: str
    session: str | None = None

    @property
    def label(self) -> str:
        return f"{self.role}:{self.name}"

    def may_read(self, client_id: str) -> bool:
        return self.role == HUMAN or client_id == self.session


def mcp_client_id(name: str) -> str:
    """The MCP-namespace session id of a name: unchanged when it starts with `mcp-`, else prefixed."""
    client_id = name if name.startswith(PREFIX) else PREFIX + name
    if not re.match(_http.CLIENT_ID_PATTERN, client_id):
        raise ValueError(f"invalid session name {name[:140]!r}: use 1-124 letters, digits and . _ : @ -")
    return client_id


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def load_tokens(path: Path) -> list[tuple[bytes, Principal]]:
    """The token table of a token file; PluginConfigError names the file and the field that is wrong."""
    try:  # it holds bearer tokens in clear: refused when others may read it
        raw = json.loads(read_secret_file(path, "the MCP token file").decode("utf-8"))
    except SecretFileError as exc:
        raise PluginConfigError(str(exc)) from None
    except ValueError as exc:
        raise PluginConfigError(f"{path}: not valid JSON ({exc})") from None
    try:
        parsed = TokenFile.model_validate(raw)
    except ValidationError as exc:
        problems = field_problems(exc, "(top level)", "field '{where}': {msg}")
        raise PluginConfigError(f"{path}: {problems}") from None
    table: list[tuple[bytes, Principal]] = []
    seen: dict[bytes, str] = {}
    for name, entry in parsed.tokens.items():
        if not re.match(r"^[A-Za-z0-9._-]{1,64}$", name):
            raise PluginConfigError(
                f"{path}: field 'tokens.{name[:70]}': a token name uses 1-64 letters, digits, . _ -"
            )
        digest = _digest(entry.token) if entry.token else bytes.fromhex(entry.token_sha256 or "")
        if digest in seen:
            raise PluginConfigError(f"{path}: field 'tokens.{name}': same token as 'tokens.{seen[digest]}'; "
                                    "give every holder a token of its own")
        seen[digest] = name
        session = None
        if entry.session:
            try:
                session = mcp_client_id(entry.session)
            except ValueError as exc:
                raise PluginConfigError(f"{path}: field 'tokens.{name}.session': {exc}") from None
        table.append((digest, Principal(name, entry.role, session)))
    return table


def create_token_file(path: Path) -> None:
    """Write a token file with one new human token (`owner`), readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"tokens": {"owner": {"role": HUMAN, "token": secrets.token_hex(32)}}}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(body, indent=2) + "\n")


class TokenTable:
    """The SDK's TokenVerifier over the token file: constant-time comparison of SHA-256 digests."""

    def __init__(self, entries: list[tuple[bytes, Principal]], resource: str):
        self.entries = entries
        self.resource = resource

    async def verify_token(self, token: str) -> AccessToken | None:
        digest = _digest(token)
        found: Principal | None = None
        for known, principal in self.entries:  # no early exit: the time does not depend on which matched
            if hmac.compare_digest(known, digest):
                found = principal
        if found is None:
            return None
        # `token` holds the digest prefix: the secret itself is never kept past this call.
        return AccessToken(token=digest.hex()[:12], client_id=found.label, scopes=[found.role], subject=found.name,
                           resource=self.resource, claims={"role": found.role, "session": found.session})


def principal_of(token: AccessToken | None) -> Principal:
    """The principal of the request being handled; MCPError when there is none (fail closed)."""
    claims = (token.claims or {}) if token else {}
    role = claims.get("role")
    if token is None or role not in (HUMAN, AGENT) or not token.subject:
        raise MCPError(FORBIDDEN, "forbidden: this request carries no agent-mcp token")
    return Principal(token.subject, role, claims.get("session"))


def request_principal(ctx: ServerRequestContext[Any, Any] | None = None) -> Principal:
    token = get_access_token()
    if token is None and ctx is not None and ctx.request is not None:
        user = getattr(ctx.request, "scope", {}).get("user")
        token = user.access_token if isinstance(user, AuthenticatedUser) else None
    return principal_of(token)


def forbidden(what: str) -> MCPError:
    return MCPError(FORBIDDEN, f"forbidden: {what}")
