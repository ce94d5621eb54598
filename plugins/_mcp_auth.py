"""Who an MCP request is: the SDK's token verifier over the token table (`_mcp_tokens.py`), and the
principal of the request being handled."""

from __future__ import annotations

import hmac
from typing import Any

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError

from plugins._mcp_tokens import AGENT, HUMAN, Principal, digest

#: JSON-RPC error of a request outside the token's role (implementation-defined range of 2026-07-28).
FORBIDDEN = -32001


class TokenTable:
    """The SDK's TokenVerifier over the token file: constant-time comparison of SHA-256 digests."""

    def __init__(self, entries: list[tuple[bytes, Principal]], resource: str):
        self.entries = entries
        self.resource = resource

    async def verify_token(self, token: str) -> AccessToken | None:
        hashed = digest(token)
        found: Principal | None = None
        for known, principal in self.entries:  # no early exit: the time does not depend on which matched
            if hmac.compare_digest(known, hashed):
                found = principal
        if found is None:
            return None
        # `token` holds the digest prefix: the secret itself is never kept past this call.
        return AccessToken(token=hashed.hex()[:12], client_id=found.label, scopes=[found.role], subject=found.name,
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
