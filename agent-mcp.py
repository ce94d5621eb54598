#!/usr/bin/env python3
"""agent-mcp: one persistent, tool-using LLM agent behind many front doors.

Loads the configuration and plugins, then serves every client_interface plugin on its own port
(its own Starlette app and uvicorn server), all in one event loop, until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import ipaddress
import logging
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

# httpx's package imports its command line (`httpx._main`: click, rich and pygments, about 5 MiB) when it
# can; the server never runs it. A None entry makes that import fail, and httpx goes without its CLI.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]  # None blocks the import, as Python documents

import uvicorn
from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

import build
import models
import routes
import sessions
import shared_link
import shared_values
import state
import stores
from audit_chain import AuditError
from config import CODE_DIR, AppConfig, ConfigError, env_seconds, load_config, own_copies, secret_values
from guard import Guard, hide_userinfo
from plugin_api import BasePlugin
from prompt import PROMPT_DIR

logger = logging.getLogger("agent_mcp")

#: How long a stopping instance of several lets its running turns finish, unless AGENT_DRAIN_SECONDS says.
DRAIN_SECONDS = 30.0


class StartupError(Exception):
    """The server cannot start; the message names the plugin, the address and what to change."""


class _RedactSecrets(logging.Filter):
    """Take secrets out of every log record, its exception text included: the values of secret-looking
    settings become `***`, and so does the user:password part of any URL (guard.hide_userinfo)."""

    def __init__(self, secrets: list[str]):
        super().__init__()
        self.secrets = sorted((s for s in secrets if len(s) >= 6), key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return hide_userinfo(text)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = self.redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = _FORMATTER.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


_FORMATTER = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def _setup_logging(level: str, env: dict[str, str], config: AppConfig | None = None) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(_FORMATTER)
    secrets = secret_values(env, config.enabled.plugin_config if config else {})
    handler.addFilter(_RedactSecrets(secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpx2", "httpcore", "google_genai.models"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    logging.getLogger("uvicorn.error").addFilter(_OncePerProcess())


class _OncePerProcess(logging.Filter):
    """uvicorn's lifecycle lines once, not once per listener (every plugin port is a uvicorn server)."""

    LINES = ("Started server process", "Waiting for application", "Application startup complete",
             "Shutting down", "Waiting for connections to close", "Finished server process")

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        line = next((start for start in self.LINES if message.startswith(start)), None)
        if line is None:
            return True
        if line in self.seen:
            return False
        self.seen.add(line)
        return True


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to agent-mcp (one handler stops them all)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def check_data_dir(path: Path) -> None:
    """Create the data directory if needed and prove it writable; StartupError names it and the fix.

    Checked before anything starts: the session store, the MCP approval store and the token files
    live there, and a failure halfway through start-up would leave a traceback, not an answer.
    A new directory is private (0700): it holds every conversation. An existing one that other
    users can read is kept as it is, with a warning.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        raise StartupError(
            f"data directory {path} is not writable ({exc.strerror or type(exc).__name__}): set AGENT_DATA_DIR "
            "to a writable directory or fix its permissions"
        ) from None
    if mode & 0o077:
        logger.warning("data directory %s can be read by other users of this machine, and it holds every "
                       "session's history: run chmod 700 %s", path, path)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(name: str, host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and without
    # it every response on a kept-alive connection waits ~40 ms for a delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(
            f"plugin {name} cannot listen on {host}:{port}: {exc.strerror}. Another program or plugin uses "
            f"that port: change plugin_config.{name}.port in plugins-enabled.json"
        ) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def _unavailable(request: Request, exc: Exception) -> Response:
    """A request that needed the shared store while Redis is unreachable, or a turn asked of a stopping
    server: 503 with what to do (nothing was done, so it may be sent again)."""
    return JSONResponse({"error": str(exc)}, status_code=503, headers={"Retry-After": "1"})


def build_app(rt: state.Runtime, plugin: BasePlugin, cfg: dict[str, Any]) -> ASGIApp:
    """One Starlette app holding only this plugin's routes, behind the guard (Host, Origin, token, JSON).

    `cfg` is the plugin's `get_config()`: host, port, token, allowed_hosts, allowed_origins, token_hint.
    """
    app = Starlette(routes=plugin.get_routes(), exception_handlers={shared_link.StoreUnavailable: _unavailable,
                                                                            sessions.Stopping: _unavailable})
    return Guard(app, plugin=plugin.PLUGIN_NAME, bind=str(cfg.get("host", "127.0.0.1")), port=int(cfg["port"]),
                 token=cfg.get("token"), token_hint=cfg.get("token_hint"), allowed_hosts=cfg.get("allowed_hosts", ()),
                 allowed_origins=cfg.get("allowed_origins", ()), unavailable=rt.unavailable)


def _prepare_servers(rt: build.Server, drain: float) -> list[tuple[_Server, socket.socket, str]]:
    assert rt.plugins is not None
    prepared: list[tuple[_Server, socket.socket, str]] = []
    try:
        for plugin in rt.plugins.client_plugins():
            cfg: dict[str, Any] = plugin.get_config()
            name, host, port, token = (
                plugin.PLUGIN_NAME,
                str(cfg.get("host", "127.0.0.1")),
                cfg.get("port"),
                cfg.get("token"),
            )
            if not isinstance(port, int) or not 0 < port < 65536:
                raise StartupError(f"plugin {name}: port {port!r} is not valid; set plugin_config.{name}.port")
            # A plugin that checks a credential on every request itself (plugin_client_mcp) needs no port token.
            if not _is_loopback(host) and not token and cfg.get("authenticates_requests") is not True:
                raise StartupError(
                    f"plugin {name} would listen on {host}:{port} without a token. Configure its bearer token "
                    f"(see README) or bind it to 127.0.0.1 (plugin_config.{name}.host)"
                )
            sock = _bind(name, host, port)
            config = uvicorn.Config(
                build_app(rt, plugin, cfg), log_config=None, access_log=False, lifespan="off",
                # The client address is the TCP peer: uvicorn would take X-Forwarded-For from any local
                # caller. Forwarded identity counts only from a configured forwarder (plugin_proxy_llama).
                proxy_headers=False, forwarded_allow_ips="",
                # No front door speaks WebSocket: uvicorn need not import a WebSocket library.
                ws="none",
                # Open requests (event streams of draining turns among them) may finish; then they are ended.
                # Seconds as a float: uvicorn passes it to asyncio.wait_for (its annotation says int).
                timeout_graceful_shutdown=drain + routes.CANCEL_GRACE_SECONDS + 3,  # type: ignore[arg-type]  # float
            )
            prepared.append((_Server(config), sock, f"{cfg.get('name', name)} ({name}) on http://{host}:{port}"))
    except BaseException:
        for _, sock, _ in prepared:
            sock.close()
        raise
    return prepared


#: How long a stopping server waits for its ended event streams to send their last bytes.
STREAMS_GRACE_SECONDS = 2.0
#: How long the system prompt an instance started with is remembered in Redis for the next ones to compare.
PROMPT_SEEN_SECONDS = 7 * 24 * 3600


async def _compare_prompts(rt: state.Runtime, values: shared_values.SharedValues) -> None:
    """Instances on one Redis share sessions but each reads its own `.system_prompt/` tree: say at start
    when this one's differs from what the last instance to start had (then one conversation would get two
    prompts, depending on which instance runs a turn)."""
    mine = hashlib.sha256(rt.prompt.assemble().encode()).hexdigest()[:16]
    seen = await values.get("system-prompt")
    if seen is not None and seen.partition(" ")[0] != mine:
        logger.warning("this instance's system prompt (%s, %s) differs from the one %s started with: give "
                       "every instance on this Redis the same .system_prompt/ tree (copy it, then !sysprompt "
                       "reload)", mine, rt.config.path(PROMPT_DIR), seen.partition(" ")[2] or "another instance")
    instance = getattr(getattr(rt.sessions.store, "link", None), "instance", "")
    await values.put("system-prompt", f"{mine} instance {instance}".strip(), PROMPT_SEEN_SECONDS)


async def serve(config: AppConfig) -> int:
    """Run until a signal arrives or a server stops; returns the process exit code."""
    rt = await build.build_runtime(config)
    try:
        assert rt.plugins is not None
        store = rt.sessions.store
        sharing = f"; other instances sharing them now: {await store.instances() - 1}" if store.shared else ""
        logger.info("sessions: %s%s", store.describe(), sharing)
        if store.shared and rt.values is not None:  # shared sessions come with shared values (build.py)
            await _compare_prompts(rt, rt.values)
        reports = await rt.plugins.load_all()
        problems = [r for r in reports if r.status in ("invalid", "failed")]
        # Before any port listens, the default model is built (in a worker thread: `Agent.warm`), so "ready"
        # means its first turn waits for no import; other models are built at their first use.
        started = time.monotonic()
        async def probe_windows() -> list[tuple[int, str]]:
            return await asyncio.gather(*(models.model_window(rt.windows, key, cfg)
                                          for key, cfg in config.models.items()))
        _, windows = await asyncio.gather(rt.agent.warm(config.default_model), probe_windows())
        logger.info(
            "default model ready in %.2f s; context windows: %s",
            time.monotonic() - started,
            ", ".join(
                f"{key} {tokens:,} ({source})" for key, (tokens, source) in zip(config.models, windows, strict=True)
            ),
        )
        problem = await models.unreachable(config.models[config.default_model], config.env)
        if problem:
            logger.warning("the default model '%s' cannot answer yet: %s. Or use another model: !model <name> in "
                           "shell.py, or default_model in plugins-enabled.json", config.default_model, problem)
        drain = drain_seconds(config.env, rt.sessions.store.shared)
        prepared = _prepare_servers(rt, drain)
        if not prepared:
            failed = "; ".join(r.line() for r in problems)
            raise StartupError("no client interface plugin is running, so there is nothing to serve; " + (
                f"fix these plugins: {failed}" if failed else "enable plugin_client_shellpy in plugins-enabled.json"))
        servers = [s for s, _, _ in prepared]
        loop = asyncio.get_running_loop()

        hurry = asyncio.Event()

        async def end() -> None:
            running = routes.running(rt.active_tasks)
            if drain and running:
                # Several instances: this one takes no new connections (the others do) while its turns finish.
                for s in servers:
                    s.should_exit = True
                logger.warning("stopping: waiting up to %g s for %d running request(s) to finish "
                               "(AGENT_DRAIN_SECONDS); stop again to end them now", drain, len(running))
                await _drained(rt, drain, hurry)
            # Running turns end first, each telling its clients (error + done) while their streams are open.
            await routes.end_all(rt)
            for s in servers:
                s.should_exit = True
            # Open event streams end now, each with a complete response, so a stop with shell windows attached
            # is quick and clean; only then sse-starlette's own shutdown watcher may cut what is left.
            rt.hub.close()
            if rt.open_streams:
                rt.streams_done = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STREAMS_GRACE_SECONDS):
                        await rt.streams_done.wait()
            rt.stopping.set()
            AppStatus.should_exit = True

        ending: list[asyncio.Task[None]] = []

        def stop(signalled: bool = False) -> None:
            if not ending:
                ending.append(asyncio.create_task(end(), name="stop"))
            elif signalled:
                hurry.set()  # a second signal: no more waiting

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, True)
        tasks = [asyncio.create_task(s.serve(sockets=[sock])) for s, sock, _ in prepared]
        for _, _, where in prepared:
            logger.info("listening: %s", where)
        logger.info("agent-mcp ready: %d plugin(s) loaded, %d with problems, default model %s",
                    len(rt.plugins.loaded), len(problems), config.default_model)
        # What start-up made (modules, plugins, clients) lives as long as the process: the collector need not
        # walk it again at every full collection while serving, nor at exit (half a second at every stop).
        gc.freeze()
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        stop()  # one server stopped (or a signal came): stop the rest
        await asyncio.gather(*tasks, *ending, return_exceptions=True)
        return 0
    finally:
        await build.close_runtime(rt)
        logger.info("agent-mcp stopped")


def drain_seconds(env: dict[str, str], shared: bool) -> float:
    """AGENT_DRAIN_SECONDS: how long a stopping server lets its running turns finish. Default: 30 s with
    several instances on one store (the others take new requests meanwhile), else 0 (they end at once)."""
    return env_seconds(env, "AGENT_DRAIN_SECONDS", DRAIN_SECONDS if shared else 0.0,
                       meaning="end running turns at once")


async def _drained(rt: state.Runtime, seconds: float, hurry: asyncio.Event) -> None:
    """Return when no request runs, `seconds` passed, or `hurry` is set."""
    deadline = asyncio.get_running_loop().time() + seconds
    while routes.running(rt.active_tasks) and not hurry.is_set():
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(left, 0.1)):
                await hurry.wait()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agent-mcp.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Config files (read from --config-dir, falling back to the shipped copies in defaults/):\n"
            "  .env  llm-models.json  plugin-manifest.json  plugins-enabled.json  gate-defaults.json\n"
            "  agents.json  mcp-servers.json  .system_prompt/\n"
            "  mcp-tokens.json: bearer tokens (human / agent) of the MCP server plugin_client_mcp;\n"
            "    read from --config-dir only, created there with one human token when missing.\n"
            "Environment: SESSION_STORE (sqlite | sqlite:///path | memory |\n"
            "  redis://host:port/db[?prefix=name:] for several instances), AGENT_DATA_DIR,\n"
            "  bearer tokens AGENT_SHELL_TOKEN (shell.py endpoint; unset: generated into\n"
            "  <data dir>/shell-token), API_KEY (unset: generated into <data dir>/api-key) and\n"
            "  API_ADMIN_KEY (API), AGENT_PROXY_TOKEN (proxy); GATE_TIMEOUT, API_GATE_TIMEOUT\n"
            "  (seconds a gate waits); AGENT_DRAIN_SECONDS (how long a stopping server lets running\n"
            "  turns finish); AGENT_EVENT_BUFFER (events kept per session for slow readers).\n"
            "  the API keys named in llm-models.json. docs/configuration.md documents every setting."
        ),
    )
    p.add_argument("--config-dir", default=None,
                   help="directory with the config files (default: the checkout, whose copies are git-ignored)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _run(main: Coroutine[Any, Any, int]) -> int:
    """Run the server on uvloop where it exists (a faster event loop: every turn is many small I/O
    callbacks), else on asyncio's own loop. uvicorn parses HTTP with httptools when it is installed."""
    try:
        import uvloop
    except ImportError:  # Windows
        return asyncio.run(main)
    return uvloop.run(main)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        # The config dir holds its own copy of everything this instance writes (prompt edits, models, gates);
        # the shipped defaults/ are never written, so the checkout stays clean (its copies are git-ignored).
        created = own_copies(Path(args.config_dir) if args.config_dir else CODE_DIR)
    except OSError as exc:
        print(f"agent-mcp: cannot start: cannot copy the default config files into {args.config_dir} "
              f"({exc.strerror}): make that directory writable", file=sys.stderr)
        return 1
    try:
        config = load_config(args.config_dir)
    except ConfigError as exc:
        print(f"agent-mcp: configuration error: {exc}", file=sys.stderr)
        return 2
    _setup_logging(args.log_level, config.env, config)
    try:
        check_data_dir(config.data_dir())
        if created:
            logger.info("created in %s from the shipped defaults: %s", config.config_dir, ", ".join(created))
        return _run(serve(config))
    except (StartupError, ConfigError, stores.SessionError, AuditError) as exc:
        # One line on stderr, not a log record as well: the log handler writes to stderr too.
        print(f"agent-mcp: cannot start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
