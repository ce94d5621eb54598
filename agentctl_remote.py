"""agentctl and a running server: find it, and send it the writes to what it owns.

A running server owns its audit log and grants (`<data dir>/audit.sqlite3`), `gate-defaults.json` and
`llm-models.json` (it writes them itself: `!grants revoke`, MCP policy tools, `!model` commands). While
it runs, agentctl never writes them: it sends the change to the shell endpoint's `POST /admin` with the
endpoint's token, and the server applies it at once, writes the file and audits it (actor `agentctl`).
A server is running when its shell endpoint answers `/health` with the token, or when it holds the audit
log's lock (then, without a reachable endpoint, those writes are refused rather than raced).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

import audit_log
import grants
from agentctl_files import FileProblem, InputError
from config import GATE_DEFAULTS_FILE, MODELS_FILE, AppConfig
from guard import SHELL_TOKEN_FILE
from secret_files import SecretFileError, read_secret_file

SHELL = "plugin_client_shellpy"
#: The files a running server writes itself; agentctl sends changes of these to it.
SERVER_OWNED = (GATE_DEFAULTS_FILE, MODELS_FILE)
TIMEOUT = 10.0


class Server:
    """A running server's shell endpoint, reached with its token."""

    def __init__(self, url: str, token: str):
        self.url, self.token = url, token

    def admin(self, action: str, **fields: Any) -> dict[str, Any]:
        """Do one admin action on the server; InputError with the server's reason when it refuses."""
        try:
            response = httpx.post(f"{self.url}/admin", json={"action": action, **fields}, timeout=TIMEOUT,
                                  headers={"Authorization": f"Bearer {self.token}"})
        except httpx.HTTPError as exc:
            raise FileProblem(f"the running server at {self.url} did not answer ({type(exc).__name__}); nothing "
                              "was changed: try again, or stop the server and run the command again") from None
        try:
            body = response.json()
        except ValueError:
            body = {}
        if response.status_code != 200 or not isinstance(body, dict):
            why = body.get("error") if isinstance(body, dict) else None
            raise InputError(f"the running server refused: {why or f'HTTP {response.status_code}'}")
        return body


def _endpoint(cfg: AppConfig) -> tuple[str, str] | None:
    """The shell endpoint's URL and token, or None when it is not enabled or has no token yet."""
    if SHELL not in cfg.enabled.enabled_plugins:
        return None
    settings = cfg.plugin_config(SHELL)
    if settings.get("enabled", True) is False:
        return None
    host = str(settings.get("host") or "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    token = cfg.env.get(str(settings.get("token_env") or "AGENT_SHELL_TOKEN"))
    if not token:
        try:
            token = read_secret_file(cfg.data_dir() / SHELL_TOKEN_FILE, "the shell endpoint's token").decode().strip()
        except SecretFileError as exc:
            if not (cfg.data_dir() / SHELL_TOKEN_FILE).exists():
                return None
            raise FileProblem(str(exc)) from None
    return f"http://{host}:{int(settings.get('port') or 8765)}", token


def server_holds_log(data_dir: Path) -> bool:
    """Whether a process (a running server) holds the audit log's lock now."""
    lock = data_dir / (grants.AUDIT_FILE + ".lock")
    if not lock.exists():
        return False
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken here
    return False


def find_server(cfg: AppConfig) -> Server | None:
    """The running server of this config, or None when none runs. FileProblem when it runs (it holds the
    audit log's lock) but its shell endpoint cannot be reached or refuses the token: agentctl must then not
    write what it owns. A server of another config answering on the port is not this one."""
    endpoint = _endpoint(cfg)
    why = "its shell endpoint (plugin_client_shellpy) cannot be reached: enable it"
    if endpoint is not None:
        url, token = endpoint
        try:
            response = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {token}"}, timeout=TIMEOUT)
        except httpx.HTTPError:
            response = None
        if response is not None and response.status_code == 200:
            return Server(url, token)
        if response is not None:
            why = (f"its shell endpoint at {url} refuses agentctl (HTTP {response.status_code}): give agentctl its "
                   "token (AGENT_SHELL_TOKEN or <data dir>/shell-token)")
    if server_holds_log(cfg.data_dir()):
        raise FileProblem(f"the server of this config is running, but {why}, or stop the server; then run the "
                          "command again; nothing was changed")
    return None


class OwnedWriter:
    """ConfigFiles' way to save a file the server owns: through the running server, if one runs."""

    owned = SERVER_OWNED

    def __init__(self, cfg: AppConfig, told: Any = None):
        self.cfg = cfg
        self.told = told  # the Terminal: its next `done` says the server applied it


    def save(self, name: str, raw: Any) -> bool:
        """True when a running server saved `raw` as `name` (and applied it); False: none runs, write it here."""
        server = find_server(self.cfg)
        if server is None:
            return False
        note = str(server.admin("save", file=name, data=raw).get("note", ""))
        if self.told is not None:
            self.told.applied = f"The running server saved and applied it ({note}), and audited it."
        return True


def _key_file(cfg: AppConfig) -> Path:
    from audit_chain import key_path
    return key_path(cfg.data_dir(), cfg.env)


def revoke(cfg: AppConfig, which: str) -> tuple[list[str], str]:
    """Revoke grant `which` (or `all`): through the running server, else in the file (audited as agentctl).
    Returns the ids revoked and how."""
    server = find_server(cfg)
    if server is not None:
        return list(server.admin("revoke", which=which)["revoked"]), ("Revoked by the running server: in force now, "
                                                                      "audited by it.")
    path = cfg.data_dir() / grants.AUDIT_FILE
    if not path.exists():
        return [], ""
    ended = audit_log.revoke_offline(path, which, actor="agentctl", key_file=_key_file(cfg))
    return [g.id for g in ended], "Revoked in the audit log (the server is stopped), audited as agentctl."


def active_grants(cfg: AppConfig) -> list[grants.Grant]:
    """The grants that can still allow: the running server's, else those in the file it would honour."""
    server = find_server(cfg)
    if server is not None:
        return [grants.Grant(**{**g, "keys": tuple(g["keys"])}) for g in server.admin("grants")["grants"]]
    path = cfg.data_dir() / grants.AUDIT_FILE
    return audit_log.read_grants(path, key_file=_key_file(cfg)) if path.exists() else []


def verify(cfg: AppConfig, sources: Sequence[audit_log.HeadSource] = ()) -> grants.audit_chain.Verified:
    """Verify the audit log and its grants table against its key, its head file, the heads of `sources` and,
    with sessions on Redis, the head there; then the grants kept in Redis."""
    path = cfg.data_dir() / grants.AUDIT_FILE
    head, shared = _redis_state(cfg, path)
    found = audit_log.verify_file(path, _key_file(cfg), head, sources)
    if shared is not None:
        audit_log.check_shared_grants(grants.audit_chain.load_key(_key_file(cfg), create=False), *shared)
        found.heads.append(f"{len(shared[1])} grant(s) in Redis")
    return found


def current_head(cfg: AppConfig) -> str:
    """The audit log's head as it is now, sealed (`agentctl audit-head`), once `verify` holds."""
    head = verify(cfg).head
    return head.sealed(grants.audit_chain.load_key(_key_file(cfg), create=False))


def _redis_state(cfg: AppConfig, path: Path) -> tuple[str | None, tuple[str, list[tuple[str, str, str, bool]]] | None]:
    """With sessions on Redis: the audit head checkpointed there, and (the key prefix, every grant kept there as
    (session, grant id, value, tombstoned)). (None, None) otherwise."""
    url = cfg.env.get("SESSION_STORE", "")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None, None
    import redis

    import shared_link
    from audit_chain import open_readonly, read_meta
    with open_readonly(path) as db:
        log_id = read_meta(db).get("log_id", "")
    url, prefix = shared_link.split_prefix(url)
    hashes = prefix + "grants:"
    try:
        client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5)
        with client:
            head: str | None = client.get(prefix + f"audit-head:{log_id}")  # type: ignore[assignment]  # decoded: str
            entries: list[tuple[str, str, str, bool]] = []
            for key in client.scan_iter(match=_glob_escaped(hashes) + "*", count=1000):
                rows: dict[str, str] = client.hgetall(key)  # type: ignore[assignment]  # decoded: str
                tombs = client.hmget(prefix + "grants-revoked", list(rows)) if rows else []
                entries += [(key[len(hashes):], i, v, t is not None)
                            for (i, v), t in zip(rows.items(), tombs, strict=True)]
    except redis.RedisError as exc:
        raise FileProblem(f"the audit head and grants in Redis cannot be read ({type(exc).__name__}): check that "
                          "Redis runs; the file was not checked against them") from None
    return head, (prefix, entries)


def _glob_escaped(text: str) -> str:
    """`text` as a literal in a Redis SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
