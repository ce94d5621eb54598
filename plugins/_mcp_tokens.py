"""The MCP server's bearer tokens and what they may reach: the token file (`mcp-tokens.json`), its roles
(human, agent), the principal a token stands for, and the resource URIs (agentmcp://…) they read.

Free of the MCP SDK: plugin_client_mcp reads its tokens at start, and the SDK (`_mcp_app.py`) is
imported only at the first request to its port. What a request carries is `_mcp_auth.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from config import field_problems
from plugin_api import PluginConfigError
from plugins import _http
from secret_files import SecretFileError, read_secret_file

#: The resources' URI scheme: agentmcp://sessions, agentmcp://sessions/{id}/state, …
SCHEME = "agentmcp://"
#: Client ids of the sessions MCP clients create start with this (the plugin's client-id namespace).
PREFIX = "mcp-"
HUMAN, AGENT = "human", "agent"


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


def digest(token: str) -> bytes:
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
        hashed = digest(entry.token) if entry.token else bytes.fromhex(entry.token_sha256 or "")
        if hashed in seen:
            raise PluginConfigError(f"{path}: field 'tokens.{name}': same token as 'tokens.{seen[hashed]}'; "
                                    "give every holder a token of its own")
        seen[hashed] = name
        session = None
        if entry.session:
            try:
                session = mcp_client_id(entry.session)
            except ValueError as exc:
                raise PluginConfigError(f"{path}: field 'tokens.{name}.session': {exc}") from None
        table.append((hashed, Principal(name, entry.role, session)))
    return table


def create_token_file(path: Path) -> None:
    """Write a token file with one new human token (`owner`), readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"tokens": {"owner": {"role": HUMAN, "token": secrets.token_hex(32)}}}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(body, indent=2) + "\n")
