"""Client classes: who a request is, what it may administer and what it may read.

A client plugin declares which client-id namespace belongs to which class
(`BasePlugin.CLIENT_NAMESPACES`); a request's class comes from there, or from the shell endpoint
vouching for it, never from the id alone. Privileges (`may_administer`) come from the request; the
class says how a gate of its clients is answered (`ClientClass.gate_wait`) and how it is named.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import guard
import sessions
import stores
import turns
from config import CODE_DIR, AppConfig, secret_values

SHELL, API, SWARM, PROXY, SLACK, MCP, UNKNOWN = "shell", "api", "swarm", "proxy", "slack", "mcp", "unknown"
#: How a gate of a client class is answered: a person waits for it ("human", GATE_TIMEOUT), a program
#: may answer within the API window ("window", API_GATE_TIMEOUT), or nobody can ("reject", at once).
HUMAN_WAIT, WINDOW_WAIT, NO_WAIT = "human", "window", "reject"


@dataclass(frozen=True)
class ClientClass:
    """What the clients of one class are; privileges come from the request (see `may_administer`)."""

    name: str
    label: str
    gate_wait: str = NO_WAIT


#: Every client class. Plugins declare which client-id namespace belongs to which class
#: (`BasePlugin.CLIENT_NAMESPACES`); an id no loaded plugin owns is UNKNOWN: the least privilege.
CLASSES = {c.name: c for c in (
    ClientClass(SHELL, "the shell", HUMAN_WAIT),
    ClientClass(API, "an API client", WINDOW_WAIT),
    ClientClass(SWARM, "another agent (swarm call)"),
    ClientClass(PROXY, "the chat proxy"),
    ClientClass(SLACK, "Slack"),
    ClientClass(MCP, "an MCP client", HUMAN_WAIT),  # answered by a person holding a human MCP token
    ClientClass(UNKNOWN, "a client no plugin vouches for"),
)}
CLIENT_LABELS = {name: c.label for name, c in CLASSES.items()}


def client_class(client_id: str | None, namespaces: dict[str, tuple[str, str]]) -> str:
    """The class of the loaded plugin's namespace that owns `client_id` (the longest prefix), else UNKNOWN.
    `namespaces`: prefix → (class, plugin) of the loaded client plugins (the runtime's client_namespaces)."""
    return _owner_class(namespaces, client_id or "")


def _owner_class(namespaces: dict[str, tuple[str, str]], client_id: str) -> str:
    best, kind = -1, UNKNOWN
    for prefix, (declared, _plugin) in namespaces.items():
        if client_id.startswith(prefix) and len(prefix) > best:
            best, kind = len(prefix), declared
    return kind


def session_class(namespaces: dict[str, tuple[str, str]], session: stores.Session) -> str:
    """The class a session is bounded and listed as: the class of the client that created it.

    Sessions stored before classes were recorded: their id's namespace, and bare ids are the
    shell's (the only client that created them). Never a source of privilege.
    """
    recorded = session.settings.get(sessions.CLIENT_CLASS)
    if recorded in CLASSES:
        return str(recorded)
    kind = _owner_class(namespaces, session.client_id)
    return SHELL if kind == UNKNOWN and sessions.CLIENT_CLASS not in session.settings else kind


def may_administer(turn: turns.Turn | None) -> bool:
    """Whether `turn` may change gates or run privileged (★) commands such as `!db`.

    Accepted: a request the token-authenticated shell endpoint vouched for (payload
    `"interactive": True`), or one whose client plugin vouched for an administrator (payload
    `"admin": True`: the API plugin when the caller holds the admin token). Nothing else, whatever
    its client id; outside a request, nobody.
    """
    return turn is not None and turn.may_administer


def without_locations(config: AppConfig, text: str) -> str:
    """`text` with no secret, file path, hostname, address, URL (userinfo included) or DSN in it: the one
    redaction of every surface a non-admin reads (command output, errors, the model's tool results).
    Configured secrets become `***`, known directories their name, any other location `<hidden>`."""
    for secret in secret_values(config.env, config.enabled.plugin_config):
        text = text.replace(secret, "***")
    return guard.hide_locations(text, {"<config dir>": config.config_dir, "<data dir>": config.data_dir(),
                                       "<install dir>": CODE_DIR, "~": Path.home()})


def refusal(command: str, turn: turns.Turn | None) -> str:
    """The message a client gets for a privileged command it may not run."""
    kind = turn.kind if turn is not None else UNKNOWN
    return (f"ERROR: {command} is accepted only from the interactive shell (shell.py) or an API client "
            f"holding the admin token; this request comes from {CLIENT_LABELS[kind]}.")

def actor(turn: turns.Turn) -> str:
    """Who a request is, for the audit log: its client class and id."""
    return f"{turn.kind}:{turn.client_id}"
