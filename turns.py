"""A turn: one request as it runs (who, which session, what it may do), and the `!command` it may call.

Built once where a request enters and passed down; tools reach the running one through
`current_turn()`, and every event published meanwhile carries its id (events.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stores import Session


@dataclass
class Turn:
    """One request as it runs: who sent it, on which session, and what it may do.

    Built once where a request enters (`routes.process_request`, the MCP server's tool calls)
    and passed down explicitly; tools, which the model calls with their own arguments only,
    reach it through `current_turn()`. Privileges come from here, never from the client id.
    """

    client_id: str
    #: Every event published while this turn runs carries this id.
    id: str
    #: The client class (client_classes.CLASSES) the request is treated as.
    kind: str
    #: The client plugin authenticated an administrator (the API's admin token).
    admin: bool = False
    #: The token-authenticated shell endpoint vouched for the request.
    interactive: bool = False
    #: The model of this turn's LLM call; None: the session's own.
    model: str | None = None
    #: Tool calls of this turn skip the human gate (an `@model` turn from the interactive shell).
    bypass_gates: bool = False
    #: The session, once the turn holds it (then the turn is a HeldTurn: see `holding`).
    session: Session | None = None
    #: The request deletes its own session (`!session <own id> delete`): done once it has answered.
    ends_session: bool = False
    #: What the gate decision of the tool call running now covers (a `db` tool's; see DbAccess), set
    #: by the gate and cleared before each call's checks, so it never outlives its call.
    db_access: DbAccess | None = None
    #: Who the client plugin proved the caller to be (its token, key or user: `shell`, `api:key`,
    #: `proxy:alice`, `mcp:worker`, `slack:U123`); None: nothing proven beyond the session.
    identity: str | None = None

    @property
    def rate_key(self) -> str:
        """What rate limits count by: the proven identity within its client class, so new session ids
        under one token share its windows; the session id only when nothing is proven."""
        return f"{self.kind}|{self.identity}" if self.identity else self.client_id

    @property
    def may_administer(self) -> bool:
        """Whether this request may change gates and run privileged (★) commands."""
        return self.interactive or self.admin

    def holding(self, session: Session) -> HeldTurn:
        """This turn (its fields as they are now) on `session`: the turn `!commands`, the agent loop and the
        tool pipeline run once the request holds its session; it replaces this one from then on."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "session"}
        return HeldTurn(**fields, session=session)


@dataclass
class HeldTurn(Turn):
    """A turn that holds its session: what `!commands` (CommandHandler) and the agent loop receive."""

    #: Narrows Turn.session: never None here.
    session: Session = field(kw_only=True)


#: DbAccess.source of `!db`.
ADMIN = "admin"


@dataclass(frozen=True)
class DbAccess:
    """What the gate decision of one `db` tool call covers, for the database to enforce (db_roles.py).

    `source`: "policy" (ran unasked: `allows(key, op)` says what this session's gates open),
    "grant" (a grant's keys × operation), "approval" (exactly what a person approved for this
    call, or an `@model` turn's classified keys) or ADMIN (`!db`: SQL an administrator typed, ALL on
    the agent database); `pairs` are the (gate key, operation) covered.
    """

    source: str
    pairs: frozenset[tuple[str, str]] = frozenset()
    allows: Callable[[str, str], bool] | None = field(default=None, compare=False)


_turn: contextvars.ContextVar[Turn | None] = contextvars.ContextVar("agent_mcp_turn", default=None)


def current_turn() -> Turn | None:
    """The turn whose code is running (for tools, which get only their own arguments), or None."""
    return _turn.get()


@contextlib.contextmanager
def running(turn: Turn | None) -> Iterator[Turn | None]:
    """Make `turn` the current one inside the block (events published meanwhile carry its id)."""
    token = _turn.set(turn)
    try:
        yield turn
    finally:
        _turn.reset(token)


#: A `!command` handler: async (turn, args) → the text the client is shown; a command runs in a request that holds
#: its session.
CommandHandler = Callable[[HeldTurn, str], Awaitable[Any]]


@dataclass
class Command:
    """A `!command`: its handler, who provided it ("core": the server), and its line in `!help`."""

    handler: CommandHandler
    owner: str = "core"
    #: `!name [args] — what it does`: the first line of the handler's docstring (see usage_of).
    usage: str = ""


def usage_of(handler: Callable[..., Any]) -> str:
    """The first line of a command handler's docstring: its `!help` line."""
    return (inspect.getdoc(handler) or "").partition("\n")[0].strip()
