#!/usr/bin/env python3
"""agentctl: the operator's control panel for plugins, models, ports, rate limits and gate defaults.

`python agentctl.py <command> [args]` runs one command; without a command it opens a prompt.
It edits `plugins-enabled.json`, `llm-models.json` and `gate-defaults.json` of the config
directory (never `plugin-manifest.json`, which belongs to plugin authors). Every write is
checked with the pydantic models the server loads, lands through a temporary file and a rename,
keeps fields agentctl does not know, and is refused when it would stop the server from starting.

Exit codes: 0 done, 1 invalid input (nothing was changed), 2 a config file is missing, malformed
or cannot be written (nothing was changed).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.metadata
import json
import logging
import os
import re
import shlex
import socket
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from rich.markup import escape
from rich.table import Table

import agentctl_remote
import grants
from agentctl_db import DbCommands
from agentctl_files import (
    ALL_GATED,
    FILE_MODELS,
    ConfigFiles,
    CtlError,
    FileProblem,
    InputError,
    field_value,
    model_value,
)
from agentctl_term import RESTART, ArgParser, Terminal
from config import (
    CODE_DIR,
    CORE_GATES,
    ENABLED_FILE,
    GATE_DEFAULTS_FILE,
    MODELS_FILE,
    SECRET_NAME,
    AppConfig,
    ConfigError,
    GateDefaults,
    ModelConfig,
    RateLimit,
    atomic_write,
    load_env,
    read_json,
    shipped_path,
    validate_data,
)
from plugin_checks import check_plugin, is_enabled

#: Rate-limit types of the spec; plugins may add their own (the type of a tool is its gate type).
RATE_TYPES = ("llm_call", "search", "extract", "drive", "db", "system", "agent_call", "mcp")
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RATE_TYPE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
SYMBOLS = {"ready": "✓", "disabled": "–", "problems": "✗", "available": "○"}
STYLES = {"ready": "green", "disabled": "yellow", "problems": "red", "available": "dim"}


def port_in_use(host: str, port: int) -> bool:
    """Whether binding host:port fails right now (the server binds the same way, SO_REUSEADDR set)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _redact(config: dict[str, Any]) -> dict[str, Any]:
    return {k: "***" if SECRET_NAME.search(k) and v else v for k, v in config.items()}


def _installed(requirement: str) -> str:
    try:
        return importlib.metadata.version(Requirement(requirement).name)
    except (InvalidRequirement, importlib.metadata.PackageNotFoundError):
        return ""


# --------------------------------------------------------------------------- terminal


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _bool(text: str) -> bool:
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise InputError(f"{text} is not true/false")
    return word in _TRUE


# --------------------------------------------------------------------------- commands


class AgentCtl(DbCommands):
    """The commands: `cmd_<name>` (dashes in the command become underscores) takes the words after it.

    Each docstring is the help text; its first line is `usage: what it does`.
    """

    def __init__(self, config_dir: Path, term: Terminal, in_prompt: bool = False):
        self.config_dir = config_dir
        self.term = term
        self.in_prompt = in_prompt
        self._files: ConfigFiles | None = None

    @property
    def files(self) -> ConfigFiles:
        if self._files is None:
            if not self.config_dir.is_dir():
                raise FileProblem(f"{self.config_dir}: config directory does not exist")
            self._files = ConfigFiles(self.config_dir)
            self._files.via_server = agentctl_remote.OwnedWriter(self._files.app_config(), self.term)
        return self._files

    def commands(self) -> dict[str, Callable[[list[str]], None]]:
        return {name[4:].replace("_", "-"): getattr(self, name) for name in dir(self) if name.startswith("cmd_")}

    def run(self, words: list[str]) -> int:
        """Run one command line; return its exit code, reporting any failure on stderr."""
        name, args = words[0].lower(), words[1:]
        handler = self.commands().get(name)
        self._files = None  # read the files afresh: someone may have edited them since the last command
        try:
            if handler is None:
                close = _suggest(name, list(self.commands()))
                hint = f" (did you mean {' or '.join(close)}?)" if close else ""
                raise InputError(f"unknown command '{name}'{hint}; 'help' lists the commands")
            handler(args)
        except CtlError as exc:
            return self._failed(str(exc), exc.exit_code)
        except grants.AuditError as exc:
            return self._failed(str(exc), FileProblem.exit_code)
        except (KeyboardInterrupt, EOFError):
            return self._failed("cancelled; nothing was changed", 1)
        return 0

    def _failed(self, message: str, code: int) -> int:
        """Say why a command failed; with --json also as its one JSON document on stdout."""
        self.term.error(message)
        if self.term.json_output:
            self.term.json({"error": message, "exit_code": code})
        return code

    def prompt(self) -> int:
        """The interactive prompt: one command per line until quit, exit or end of input."""
        if self.term.tty:  # piped commands get no banner and no prompt: only each command's output
            self.term.say("agentctl: type help for the commands, quit to leave.", style="bold")
        worst = 0
        while True:
            try:
                line = self.term.ask("agentctl> " if self.term.tty else "", [*self.commands(), "quit", "exit"])
            except EOFError:
                break
            except KeyboardInterrupt:
                continue
            try:
                words = shlex.split(line)
            except ValueError as exc:
                self.term.error(f"cannot read that line: {exc}")
                worst = max(worst, 1)
                continue
            if not words:
                continue
            if words[0].lower() in ("quit", "exit"):
                break
            worst = max(worst, self.run(words))
        # On a terminal the operator saw every error; piped commands report the worst one.
        return 0 if self.term.tty else worst

    # ── helpers ──

    def _usage(self, handler: Callable[..., Any]) -> str:
        return (handler.__doc__ or "").strip().splitlines()[0].split(": ", 1)[0]

    def _args(self, args: list[str], handler: Callable[..., Any], low: int, high: int | None = None) -> list[str]:
        if not low <= len(args) <= (low if high is None else high):
            raise InputError(f"usage: agentctl {self._usage(handler)}")
        return args

    def _unknown(self, kind: str, name: str, known: list[str]) -> InputError:
        close = _suggest(name, known)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        return InputError(f"unknown {kind} '{name}'; {hint}known: {', '.join(known) or '(none)'}")

    def _plugin(self, name: str) -> str:
        manifest = self.files.manifest.plugins
        if name not in manifest:
            raise self._unknown("plugin", name, list(manifest))
        return name

    def _model(self, name: str) -> str:
        if name not in self.files.models:
            raise self._unknown("model", name, list(self.files.models))
        return name

    def _client_port(self, name: str) -> tuple[str, int | None]:
        """(host, port) a client interface plugin would listen on: its plugin_config, else the manifest default."""
        entry = self.files.manifest.plugins[name]
        conf = self.files.enabled.plugin_config.get(name, {})
        return str(conf.get("host", "127.0.0.1")), conf.get("port", entry.default_port)

    def _port_users(self, port: int, exclude: str) -> list[str]:
        """Other client plugins of `enabled_plugins` (started or `enabled: false`) configured on `port`."""
        manifest = self.files.manifest.plugins
        return [n for n in dict.fromkeys(self.files.enabled.enabled_plugins)
                if n != exclude and n in manifest and manifest[n].type == "client_interface"
                and self._client_port(n)[1] == port]

    def _status(self, cfg: AppConfig, name: str) -> tuple[str, list[str]]:
        """`ready`, `disabled`, `problems` or `available`, and every problem the plugin has."""
        problems = [c.problem for c in check_plugin(cfg, name) if c.problem]
        entry = cfg.manifest.plugins.get(name)
        if entry is not None and entry.type == "client_interface":
            port = self._client_port(name)[1]
            if port is None:
                problems.append(f"no port: agentctl port-set {name} <port>")
            elif name in cfg.enabled.enabled_plugins and (others := self._port_users(port, name)):
                problems.append(f"port {port} is also configured for {', '.join(others)}")
        if name not in cfg.enabled.enabled_plugins:
            return "available", problems
        if not is_enabled(cfg.enabled, name):
            return "disabled", problems
        return ("problems" if problems else "ready"), problems

    def _warn_if_bound(self, name: str) -> None:
        host, port = self._client_port(name)
        if port is not None and port_in_use(host, port):
            self.term.warn(f"{host}:{port} is in use on this machine right now (a running agent-mcp or another "
                           f"program); {name} cannot start there until it is free")

    def _set_plugin_flag(self, name: str, enabled: bool) -> None:
        raw = self.files.raw(ENABLED_FILE)
        if name not in raw.setdefault("enabled_plugins", []):
            raw["enabled_plugins"].append(name)
        conf = raw.setdefault("plugin_config", {}).setdefault(name, {})
        conf["enabled"] = enabled
        self.files.save(ENABLED_FILE, raw)

    def _model_setter(self, args: list[str], handler: Callable[..., Any], field: str) -> None:
        """`<command> <name> <value>`: one field of one model, checked by ModelConfig."""
        name, text = self._args(args, handler, 2)
        self._set_model_field(name, field, model_value(field, text))

    def _set_model_field(self, name: str, field: str, value: Any) -> None:
        raw = self.files.raw(MODELS_FILE)
        raw["models"][self._model(name)][field] = value
        self.files.save(MODELS_FILE, raw)
        self.term.done(f"{name}: {field} = {json.dumps(value)}")

    # ── general ──

    def cmd_help(self, args: list[str]) -> None:
        """help [command]: list the commands, or show one command's help."""
        commands = self.commands()
        if args:
            handler = commands.get(args[0].lower())
            if handler is None:
                raise self._unknown("command", args[0], list(commands))
            self.term.say(_dedent(handler.__doc__ or ""))
            return
        rows = [(handler.__doc__ or "").strip().splitlines()[0].partition(": ")[::2] for handler in commands.values()]
        width = max(len(usage) for usage, _ in rows)
        for usage, what in rows:  # plain lines: no padding after the text
            self.term.say(f"{usage:<{width}}  {what}".rstrip())
        extra = "quit or exit leaves the prompt. " if self.in_prompt else ""
        self.term.say(f"{extra}Global options: --config-dir DIR, --json (every listing as JSON).", style="dim")

    def _audit_file(self) -> Path:
        return self.files.app_config().data_dir() / grants.AUDIT_FILE

    def cmd_grants(self, args: list[str]) -> None:
        """grants [revoke <id>|all]: the active grants of every session, or end them.

        Grants are answers to gates that reach beyond one call. While the server runs, both go through
        it (its shell endpoint): a revoke is in force at once and audited by the server.
        """
        self._args(args, self.cmd_grants, 0, 2)
        cfg = self.files.app_config()
        if args:
            if len(args) != 2 or args[0] != "revoke":
                raise InputError(f"usage: agentctl {self._usage(self.cmd_grants)}")
            ended, how = agentctl_remote.revoke(cfg, args[1])
            if not ended:
                raise InputError(f"no active grant '{args[1]}'; agentctl grants lists them")
            self.term.applied = how
            self.term.done(f"revoked {', '.join(ended)}")
            return
        active = agentctl_remote.active_grants(cfg)
        if self.term.json_output:
            self.term.json({"grants": [dataclasses.asdict(g) for g in active]})
            return
        now = time.time()
        for grant in active:
            self.term.say(f"{grant.session}: {grant.describe(now)}")
        if not active:
            self.term.say("No active grants.")

    def cmd_audit(self, args: list[str]) -> None:
        """audit [--since <ISO time|hours>] [--session <id>]: gate decisions, grants and revocations, oldest first.

        Also every use of a grant and every gate-policy change; each record is chained to the one before.
        """
        parser = ArgParser(prog="agentctl audit", add_help=False, allow_abbrev=False)
        parser.add_argument("--since")
        parser.add_argument("--session")
        opts = parser.parse_args(args)
        since = _since(opts.since) if opts.since else None
        records = list(grants.read_audit(self._audit_file(), since, opts.session)) \
            if self._audit_file().exists() else []
        if self.term.json_output:
            self.term.json({"records": records})
            return
        table = Table("#", "time", "event", "session", "who", "what", "outcome")
        for r in records:
            what = " ".join(filter(None, [r["tool"], r["op"], ",".join(r["tables"]), r["grant_id"]]))
            table.add_row(str(r["seq"]), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ts"])), r["event"],
                          *(escape(v) for v in (r["session"] or "", r["actor"] or "", what, grants.shown(r))))
        self.term.table(table)

    def cmd_audit_verify(self, args: list[str]) -> None:
        """audit-verify: check the audit log's keyed chain and its checkpointed head; says what does not hold.

        Finds changed, deleted, inserted or reordered records, a chain recomputed without the key, a cut
        tail, an emptied or replaced file (exit code 2, one line saying which).
        """
        self._args(args, self.cmd_audit_verify, 0)
        cfg = self.files.app_config()
        path = cfg.data_dir() / grants.AUDIT_FILE
        try:
            found = agentctl_remote.verify(cfg)
        except grants.AuditError as exc:
            if self.term.json_output:
                self.term.json({"ok": False, "why": str(exc)})
            raise FileProblem(f"audit log {path}: {exc}") from None
        later = f", {found.after_checkpoint} after the last checkpoint" if found.after_checkpoint else ""
        unkeyed = f" (the first {found.unkeyed} written before the audit key)" if found.unkeyed else ""
        if self.term.json_output:
            self.term.json({"ok": True, "checked": found.head.count, "unkeyed": found.unkeyed})
        else:
            self.term.say(f"audit log {path}: {found.head.count} records{unkeyed}{later}, chain intact and "
                          "matches its head")

    def cmd_repair(self, args: list[str]) -> None:
        """repair [file…]: re-create each broken or missing config file from the shipped defaults, the broken
        one saved aside.

        A file that is not JSON, or not valid for the server, is renamed to `<file>.broken-<time>`
        and replaced by the shipped copy (`defaults/`).
        Valid files are left alone. Without arguments every config file agentctl manages is checked.
        """
        names = args or list(FILE_MODELS)
        unknown = [n for n in names if n not in FILE_MODELS]
        if unknown:
            raise self._unknown("config file", unknown[0], list(FILE_MODELS))
        if not self.config_dir.is_dir():
            raise FileProblem(f"{self.config_dir}: config directory does not exist")
        report = [self._repair(name) for name in names]
        if self.term.json_output:
            self.term.json({"repair": report})
            return
        for row in report:
            self.term.say(f"{'✓' if row['action'] != 'failed' else '✗'} {row['file']}: {row['detail']}")
        if any(r["action"] in ("repaired", "created") for r in report):
            self.term.say(RESTART, style="dim")

    def _data_dir(self) -> Path:
        """The data dir, read from the environment and `.env` only (repair runs when config files do not load)."""
        return Path(load_env(self.config_dir).get("AGENT_DATA_DIR") or self.config_dir / "data")

    def _repair(self, name: str) -> dict[str, Any]:
        target = self.config_dir / name
        own = target.exists()
        if own:
            try:
                validate_data(FILE_MODELS[name], read_json(target), target)
                return {"file": name, "action": "ok", "detail": "valid, left alone"}
            except ConfigError as exc:  # every bad field, not only the first
                lines = str(exc).splitlines()
                problem = "; ".join([lines[0], *(line.strip() for line in lines[1:])])
        else:
            return {"file": name, "action": "ok", "detail": "not here: the shipped copy is used"}
        default = _shipped_default(name)
        if default is None:
            return {"file": name, "action": "failed", "detail": f"{problem}; no valid default to restore it from "
                    f"({shipped_path(name)}: restore it with git checkout or reinstall)"}
        if name in agentctl_remote.SERVER_OWNED and agentctl_remote.server_holds_log(self._data_dir()):
            return {"file": name, "action": "failed", "detail": f"{problem}; the running server owns this file "
                    "and writes it: stop the server, then repair it (nothing was changed)"}
        saved = None
        if own:
            saved = target.with_name(f"{name}.broken-{time.strftime('%Y%m%dT%H%M%S')}")
            target.rename(saved)
        atomic_write(target, default)
        return {"file": name, "action": "repaired" if own else "created", "saved_as": str(saved) if saved else None,
                "detail": f"{problem}; " + (f"saved as {saved.name}, " if saved else "") +
                          "re-created from the shipped defaults"}

    # ── plugins ──

    def cmd_list(self, args: list[str]) -> None:
        """list: every plugin: ✓ enabled and ready, – configured but off, ✗ enabled with problems, ○ available."""
        self._args(args, self.cmd_list, 0)
        cfg = self.files.app_config()
        manifest = cfg.manifest.plugins
        names = sorted(dict.fromkeys([*manifest, *cfg.enabled.enabled_plugins]),
                       key=lambda n: (manifest[n].priority, n) if n in manifest else (10**9, n))
        rows = []
        for name in names:
            status, problems = self._status(cfg, name)
            entry = manifest.get(name)
            rows.append({"name": name, "status": status, "symbol": SYMBOLS[status],
                         "type": entry.type if entry else None, "priority": entry.priority if entry else None,
                         "port": self._client_port(name)[1] if entry and entry.type == "client_interface" else None,
                         "description": entry.description if entry else "", "problems": problems})
        if self.term.json_output:
            self.term.json({"default_model": cfg.default_model, "plugins": rows})
            return
        counts = {s: sum(r["status"] == s for r in rows) for s in SYMBOLS}
        self.term.say(f"Default model: {cfg.default_model}    {counts['ready']} ready, {counts['problems']} with "
                      f"problems, {counts['disabled']} configured but off, {counts['available']} available")
        table = Table("", "plugin", "type", "port", "description / problems")
        for r in rows:
            why = "; ".join(r["problems"]) if r["status"] == "problems" else r["description"]
            table.add_row(
                r["symbol"],
                escape(r["name"]),
                r["type"] or "?",
                str(r["port"] or ""),
                escape(why),
                style=STYLES[r["status"]],
            )
        self.term.table(table)
        missing = sorted({c.item for r in rows if r["status"] in ("ready", "problems")
                          for c in check_plugin(cfg, r["name"]) if c.kind == "dependency" and c.problem})
        if missing:
            install = " ".join(shlex.quote(m) for m in missing)
            self.term.say(f"Missing dependencies: pip install {install}", style="yellow")

    def cmd_info(self, args: list[str]) -> None:
        """info <plugin>: one plugin's dependencies, env vars and config files, each checked, and what to do."""
        name = self._plugin(self._args(args, self.cmd_info, 1)[0])
        cfg = self.files.app_config()
        entry = cfg.manifest.plugins[name]
        status, problems = self._status(cfg, name)
        checks = check_plugin(cfg, name)
        todo = list(problems)
        if status in ("available", "disabled"):
            todo.append(f"agentctl enable {name}, then restart agent-mcp.py")
        info: dict[str, Any] = {
            "name": name, "status": status, "symbol": SYMBOLS[status], "type": entry.type,
            "description": entry.description, "file": f"plugins/{entry.file}", "priority": entry.priority,
            "tools": entry.tools, "plugin_config": _redact(cfg.plugin_config(name)),
            "checks": [{"kind": c.kind, "item": c.item, "ok": c.problem is None, "problem": c.problem,
                        **({"installed": _installed(c.item)} if c.kind == "dependency" else {})} for c in checks],
            "todo": todo,
        }
        if entry.type == "client_interface":
            info["host"], info["port"] = self._client_port(name)
        if self.term.json_output:
            self.term.json(info)
            return
        self.term.say(f"{SYMBOLS[status]} {name} ({entry.type}): {status}", style=STYLES[status])
        table = Table(box=None, show_header=False, padding=(0, 2, 0, 0))
        for key in ("description", "file", "priority", "host", "port", "tools", "plugin_config"):
            if key in info:
                value = info[key]
                table.add_row(key, escape(", ".join(value) if isinstance(value, list) else
                                          json.dumps(value) if isinstance(value, dict) else str(value)))
        self.term.table(table)
        checks_table = Table("", "requirement", "", "detail")
        for c in info["checks"]:
            detail = c["problem"] or (f"installed {c['installed']}" if c.get("installed") else "ok")
            checks_table.add_row(c["kind"].replace("_", " "), escape(c["item"]), "✓" if c["ok"] else "✗",
                                 escape(detail), style=None if c["ok"] else "red")
        self.term.table(checks_table)
        if todo:
            self.term.say("What to do:")
            for step in todo:
                self.term.say(f"  • {step}")

    def cmd_enable(self, args: list[str]) -> None:
        """enable <plugin>: start the plugin with the server (adds it to enabled_plugins, sets enabled: true)."""
        name = self._plugin(self._args(args, self.cmd_enable, 1)[0])
        files = self.files
        if is_enabled(files.enabled, name):
            self.term.say(f"{name} is already enabled.")
            return
        if files.manifest.plugins[name].type == "client_interface":
            port = self._client_port(name)[1]
            if port is None:
                raise InputError(f"{name} has no port; set one first: agentctl port-set {name} <port>")
            if others := self._port_users(port, name):
                raise InputError(f"{name} would listen on port {port}, which {', '.join(others)} also uses; "
                                 f"choose another first: agentctl port-set {name} <port>")
        self._set_plugin_flag(name, True)
        problems = self._status(files.app_config(), name)[1]
        if problems:
            self.term.warn(f"{name} is enabled but will not start until you fix: " + "; ".join(problems))
        self.term.done(f"enabled {name}")
        if files.manifest.plugins[name].type == "client_interface":
            self._warn_if_bound(name)

    def cmd_disable(self, args: list[str]) -> None:
        """disable <plugin>: do not start the plugin; it stays in enabled_plugins with its settings (enabled: false)."""
        name = self._args(args, self.cmd_disable, 1)[0]
        files = self.files
        if name not in files.enabled.enabled_plugins:
            self._plugin(name)
            self.term.say(f"{name} is not in enabled_plugins, so it does not start; nothing to do.")
            return
        if not is_enabled(files.enabled, name):
            self.term.say(f"{name} is already disabled.")
            return
        manifest, cfg = files.manifest.plugins, files.app_config()
        clients = [n for n in files.enabled.enabled_plugins if n != name and n in manifest
                   and manifest[n].type == "client_interface" and self._status(cfg, n)[0] == "ready"]
        if name in manifest and manifest[name].type == "client_interface" and not clients:
            raise InputError(f"{name} is the last client interface that can start: the server would have nothing "
                             "to serve; enable another one first (agentctl enable <plugin>)")
        self._set_plugin_flag(name, False)
        self.term.done(f"disabled {name} (kept in enabled_plugins with its settings)")

    def cmd_port_list(self, args: list[str]) -> None:
        """port-list: the host and port of every client interface plugin, and whether the port is taken now."""
        self._args(args, self.cmd_port_list, 0)
        cfg = self.files.app_config()
        rows = []
        for name, entry in sorted(cfg.manifest.plugins.items(), key=lambda kv: kv[1].priority):
            if entry.type != "client_interface":
                continue
            host, port = self._client_port(name)
            configured = "port" in cfg.plugin_config(name)
            rows.append({"name": name, "status": self._status(cfg, name)[0], "host": host, "port": port,
                         "source": "plugin_config" if configured else "manifest default",
                         "in_use_now": port_in_use(host, port) if port else False})
        if self.term.json_output:
            self.term.json({"ports": rows})
            return
        table = Table("", "plugin", "host", "port", "from", "in use now")
        for r in rows:
            table.add_row(
                SYMBOLS[r["status"]],
                escape(r["name"]),
                escape(r["host"]),
                str(r["port"] or "-"),
                r["source"],
                "yes" if r["in_use_now"] else "",
                style=STYLES[r["status"]],
            )
        self.term.table(table)

    def cmd_port_set(self, args: list[str]) -> None:
        """port-set <plugin> <port>: set the TCP port (1-65535) a client interface plugin listens on."""
        name, text = self._args(args, self.cmd_port_set, 2)
        entry = self.files.manifest.plugins[self._plugin(name)]
        if entry.type != "client_interface":
            raise InputError(f"{name} is a {entry.type} plugin; only client interfaces listen on a port")
        if not text.isdigit() or not 1 <= int(text) <= 65535:
            raise InputError(f"invalid port '{text}': give a number from 1 to 65535")
        port = int(text)
        if others := self._port_users(port, name):
            raise InputError(f"port {port} is already configured for {', '.join(others)}; choose another port")
        if self._client_port(name)[1] == port and "port" in self.files.enabled.plugin_config.get(name, {}):
            self.term.say(f"{name} already uses port {port}.")
            return
        raw = self.files.raw(ENABLED_FILE)
        raw.setdefault("plugin_config", {}).setdefault(name, {})["port"] = port
        self.files.save(ENABLED_FILE, raw)
        self.term.done(f"{name} will listen on port {port}")
        self._warn_if_bound(name)

    # ── models ──

    def _model_row(self, key: str, m: ModelConfig, default: str) -> dict[str, Any]:
        if not m.env_key:
            api_key = "not needed"
        else:
            api_key = "set" if self.files.env.get(m.env_key) else f"missing: set {m.env_key} in .env"
        return {"name": key, **m.model_dump(), "default": key == default, "api_key": api_key}

    def cmd_models(self, args: list[str]) -> None:
        """models: every model of llm-models.json (✓ enabled, – disabled; * default, ⚠ API key missing)."""
        self._args(args, self.cmd_models, 0)
        default = self.files.enabled.default_model
        rows = [self._model_row(k, m, default) for k, m in self.files.models.items()]
        if self.term.json_output:
            self.term.json({"default_model": default, "models": rows})
            return
        table = Table("", "model", "type", "model_id", "host", "API key", "context", "timeout", "tools", "description")
        for r in rows:
            mark = ("✓" if r["enabled"] else "–") + ("*" if r["default"] else "") + \
                   ("⚠" if r["api_key"].startswith("missing") else "")
            tools = r["llm_tools"] if isinstance(r["llm_tools"], str) else ",".join(r["llm_tools"])
            flags = (" [TC]" if r["tool_call_available"] else "") + (" [router]" if r["router"] else "")
            table.add_row(mark, escape(r["name"]), r["type"], escape(r["model_id"]), escape(r["host"] or "-"),
                          escape(r["api_key"]), str(r["max_context"]), f"{r['llm_call_timeout']:g}s", escape(tools),
                          escape(r["description"] + flags), style=None if r["enabled"] else "dim")
        self.term.table(table)
        self.term.say(f"* default model: {default}", style="dim")

    def cmd_model_info(self, args: list[str]) -> None:
        """model-info <name>: every field of one model, with defaults filled in, and whether its API key is set."""
        name = self._model(self._args(args, self.cmd_model_info, 1)[0])
        row = self._model_row(name, self.files.models[name], self.files.enabled.default_model)
        if self.term.json_output:
            self.term.json(row)
            return
        table = Table(box=None, show_header=False, padding=(0, 2, 0, 0))
        for key, value in row.items():
            table.add_row(key, escape(json.dumps(value) if not isinstance(value, str) else value))
        self.term.table(table)

    def cmd_model_add(self, args: list[str]) -> None:
        """model-add <name> --model-id ID --type OPENAI|GEMINI [options]: add a model (a wizard without options).

        Options: --host URL, --env-key VAR (the .env variable holding the API key), --max-context N
        (messages kept), --timeout SECONDS, --description TEXT, --tools all|tool1,tool2,
        --tool-calls (tool_call_available), --router, --disabled.
        Without options on a terminal (or at the agentctl prompt) it asks for each field.
        """
        fields: dict[str, Any]
        if len(args) <= 1 and (self.in_prompt or self.term.tty):
            name, fields = self._model_wizard(args[0] if args else None)
        else:
            parser = ArgParser(prog="agentctl model-add", add_help=False, allow_abbrev=False)
            parser.add_argument("name")
            parser.add_argument("--model-id", dest="model_id")
            parser.add_argument("--type", type=str.upper)
            for flag in ("host", "env-key", "max-context", "description", "tools"):
                parser.add_argument(f"--{flag}")
            parser.add_argument("--timeout", dest="llm_call_timeout")
            parser.add_argument("--tool-calls", dest="tool_call_available", action="store_true")
            parser.add_argument("--router", action="store_true")
            parser.add_argument("--disabled", action="store_true")
            opts = parser.parse_args(args)
            name = self._new_model_name(opts.name)
            given = {"model_id": opts.model_id, "type": opts.type, "host": opts.host, "env_key": opts.env_key,
                     "max_context": opts.max_context, "llm_call_timeout": opts.llm_call_timeout,
                     "description": opts.description, "llm_tools": opts.tools}
            fields = {k: model_value(k, v) for k, v in given.items() if v is not None}
            fields.update(tool_call_available=opts.tool_call_available, router=opts.router, enabled=not opts.disabled)
        required = [f for f, info in ModelConfig.model_fields.items() if info.is_required() and f not in fields]
        if required:
            raise InputError(f"model-add needs {', '.join('--' + f.replace('_', '-') for f in required)} "
                             "(or run it at the agentctl prompt, which asks for each field)")
        entry = {f: fields.get(f, ModelConfig.model_fields[f].default) for f in (
            "model_id", "type", "host", "env_key", "max_context", "enabled", "tool_call_available",
            "llm_call_timeout", "description", "llm_tools")}
        entry.update({k: v for k, v in fields.items() if k not in entry})
        raw = self.files.raw(MODELS_FILE)
        raw["models"][name] = entry
        self.files.save(MODELS_FILE, raw)
        self.term.done(f"added model {name} ({entry['type']} {entry['model_id']})")
        if entry["env_key"] and not self.files.env.get(entry["env_key"]):
            self.term.warn(f"{entry['env_key']} is not set: add {entry['env_key']}=... to .env in {self.config_dir}")

    def _new_model_name(self, name: str) -> str:
        if not MODEL_NAME.match(name):
            raise InputError(f"invalid model name '{name}': use letters, digits, '.', '_' or '-' (at most 64)")
        if name in self.files.models:
            raise InputError(f"model '{name}' already exists; change it with the model-* commands or remove it first")
        return name

    def _model_wizard(self, name: str | None) -> tuple[str, dict[str, Any]]:
        """Ask for each field, re-asking until the model's own validation accepts the answer."""
        self.term.say("New model (Ctrl-C cancels; Enter keeps the value in brackets).", style="bold")

        def ask(question: str, check: Callable[[str], Any], default: str = "") -> Any:
            while True:
                text = self.term.ask(f"{question}{f' [{default}]' if default else ''}: ").strip() or default
                try:
                    return check(text)
                except InputError as exc:
                    self.term.error(str(exc))

        name = ask("name (used in !model and @model)", self._new_model_name, name or "")
        fields: dict[str, Any] = {
            "model_id": ask("model_id (the backend's model name)", lambda t: model_value("model_id", t))
        }
        kind = ask("type: 1 = OPENAI (any OpenAI-compatible server), 2 = GEMINI",
                   lambda t: model_value("type", {"1": "OPENAI", "2": "GEMINI"}.get(t, t.upper())), "1")
        fields["type"] = kind
        fields["host"] = ask("host (base URL such as http://127.0.0.1:8080/v1; null for Gemini's own)",
                             lambda t: model_value("host", t), "null")
        fields["env_key"] = ask("env_key (.env variable with the API key; null for keyless local servers)",
                                lambda t: model_value("env_key", t), "null")
        for field, question in (("max_context", "max_context (messages kept)"),
                                ("llm_call_timeout", "llm_call_timeout (seconds)"),
                                ("description", "description"), ("llm_tools", "llm_tools (all, or tool1,tool2)")):
            default = ModelConfig.model_fields[field].default
            fields[field] = ask(question, lambda t, f=field: model_value(f, t), str(default) if default != "" else "")
        return name, fields

    def cmd_model_remove(self, args: list[str]) -> None:
        """model-remove <name>: delete a model from llm-models.json (never the default model)."""
        name = self._model(self._args(args, self.cmd_model_remove, 1)[0])
        if name == self.files.enabled.default_model:
            raise InputError(f"{name} is the default model; choose another first: agentctl model <name>")
        raw = self.files.raw(MODELS_FILE)
        del raw["models"][name]
        self.files.save(MODELS_FILE, raw)
        self.term.done(f"removed model {name}")

    def cmd_model_enable(self, args: list[str]) -> None:
        """model-enable <name>: load the model at start (enabled: true)."""
        self._set_model_field(self._args(args, self.cmd_model_enable, 1)[0], "enabled", True)

    def cmd_model_disable(self, args: list[str]) -> None:
        """model-disable <name>: leave the model out of the registry (enabled: false; never the default model)."""
        name = self._model(self._args(args, self.cmd_model_disable, 1)[0])
        if name == self.files.enabled.default_model:
            raise InputError(f"{name} is the default model; choose another first: agentctl model <name>")
        self._set_model_field(name, "enabled", False)

    def cmd_model(self, args: list[str]) -> None:
        """model [name]: show the default model, or make an enabled model the default for new sessions."""
        if not self._args(args, self.cmd_model, 0, 1):
            default = self.files.enabled.default_model
            if self.term.json_output:
                self.term.json({"default_model": default})
            else:
                self.term.say(default)
            return
        name = self._model(args[0])
        if not self.files.models[name].enabled:
            raise InputError(f"{name} is disabled; enable it first: agentctl model-enable {name}")
        raw = self.files.raw(ENABLED_FILE)
        raw["default_model"] = name
        self.files.save(ENABLED_FILE, raw)
        self.term.done(f"default model: {name}")

    def cmd_model_context(self, args: list[str]) -> None:
        """model-context <name> <n>: how many history messages the model is sent (max_context)."""
        self._model_setter(args, self.cmd_model_context, "max_context")

    def cmd_model_desc(self, args: list[str]) -> None:
        """model-desc <name> <text...>: set the model's description (shown by !model and models)."""
        if len(args) < 2:
            raise InputError(f"usage: agentctl {self._usage(self.cmd_model_desc)}")
        self._set_model_field(args[0], "description", model_value("description", " ".join(args[1:])))

    def cmd_model_host(self, args: list[str]) -> None:
        """model-host <name> <url|null>: the API base URL (http:// or https://; null = the type's own endpoint)."""
        self._model_setter(args, self.cmd_model_host, "host")

    def cmd_model_llmcall(self, args: list[str]) -> None:
        """model-llmcall <name> <true|false>: whether the model may be called as a tool (tool_call_available)."""
        self._model_setter(args, self.cmd_model_llmcall, "tool_call_available")

    def cmd_model_timeout(self, args: list[str]) -> None:
        """model-timeout <name> <seconds>: the time limit of one call to the model (llm_call_timeout)."""
        self._model_setter(args, self.cmd_model_timeout, "llm_call_timeout")

    def cmd_model_tools(self, args: list[str]) -> None:
        """model-tools <name> <all|tool1,tool2> [--force]: the tools the model may call (llm_tools).

        Names no plugin or core module declares are refused unless --force is given (tools of MCP servers).
        """
        force = "--force" in args
        name, text = self._args([a for a in args if a != "--force"], self.cmd_model_tools, 2)
        value = model_value("llm_tools", text)
        if isinstance(value, list):
            self._check_tools(value, force)
        self._set_model_field(name, "llm_tools", value)

    def cmd_model_router(self, args: list[str]) -> None:
        """model-router <name> <true|false>: ask the model first whether this turn needs tools (router step)."""
        self._model_setter(args, self.cmd_model_router, "router")

    # ── rate limits ──

    def cmd_ratelimit_list(self, args: list[str]) -> None:
        """ratelimit-list: calls allowed per window for each tool type, and which types auto-disable."""
        self._args(args, self.cmd_ratelimit_list, 0)
        limits = {k: v.model_dump() for k, v in self.files.enabled.rate_limits.items()}
        if self.term.json_output:
            self.term.json({"rate_limits": limits})
            return
        table = Table("type", "calls", "window (s)", "auto_disable")
        for kind, limit in limits.items():
            table.add_row(
                escape(kind),
                str(limit["calls"]),
                f"{limit['window_seconds']:g}",
                "yes" if limit["auto_disable"] else "no",
            )
        self.term.table(table)

    def cmd_ratelimit_set(self, args: list[str]) -> None:
        """ratelimit-set <type> <calls> <window_seconds>: allow that many calls of a tool type per window."""
        kind, calls, window = self._args(args, self.cmd_ratelimit_set, 3)
        if not RATE_TYPE.match(kind):
            raise InputError(
                f"invalid type '{kind}': lower-case letters, digits and '_' (such as {', '.join(RATE_TYPES)})"
            )
        base = {"calls": 0, "window_seconds": 0}
        values = {"calls": field_value(RateLimit, "calls", calls, base),
                  "window_seconds": field_value(RateLimit, "window_seconds", window, base)}
        raw = self.files.raw(ENABLED_FILE)
        limits = raw.setdefault("rate_limits", {})
        if kind not in limits and kind not in RATE_TYPES:
            self.term.warn(f"'{kind}' is not a type of the spec ({', '.join(RATE_TYPES)}); it only applies if a "
                           "plugin's tools use that gate type")
        limits.setdefault(kind, {"auto_disable": False}).update(values)
        self.files.save(ENABLED_FILE, raw)
        unlimited = not values["calls"] or not values["window_seconds"]
        self.term.done(f"rate limit {kind}: unlimited (0 means no limit)" if unlimited
                       else f"rate limit {kind}: {values['calls']} calls per {values['window_seconds']}s")

    def cmd_ratelimit_autodisable(self, args: list[str]) -> None:
        """ratelimit-autodisable <type> <true|false>: whether hitting the limit switches the tool type off."""
        kind, text = self._args(args, self.cmd_ratelimit_autodisable, 2)
        limits = self.files.enabled.rate_limits
        if kind not in limits:
            raise self._unknown("rate-limit type", kind, list(limits))
        raw = self.files.raw(ENABLED_FILE)
        raw["rate_limits"][kind]["auto_disable"] = value = _bool(text)
        self.files.save(ENABLED_FILE, raw)
        self.term.done(f"rate limit {kind}: auto_disable = {json.dumps(value)}")

    # ── gate defaults ──

    def cmd_gate_list(self, args: list[str]) -> None:
        """gate-list: the gate defaults every session starts from (auto-allow = no approval asked)."""
        self._args(args, self.cmd_gate_list, 0)
        gates: GateDefaults = self.files.parsed(GATE_DEFAULTS_FILE)
        if self.term.json_output:
            self.term.json({"db": {k: v.model_dump() for k, v in gates.db.items()},
                            "tools": {k: v.model_dump() for k, v in gates.tools.items()}})
            return
        table = Table("scope", "name", "read", "write", "ddl")
        for scope, entries in (("db", gates.db), ("tools", gates.tools)):
            for key, perm in entries.items():
                values = (perm.read, perm.write, perm.ddl) if scope == "db" else (perm.read, perm.write)
                table.add_row(scope, escape(key), *("auto-allow" if v else "gated" for v in values),
                              *(("—",) if scope == "tools" else ()), style="yellow" if any(values) else None)
        self.term.table(table)
        self.term.say("db keys: a table, * (every other table), __meta__ (SHOW, DESCRIBE, …); tools: a tool or *. "
                      "ddl (CREATE, DROP, ALTER, RENAME, TRUNCATE) is never covered by write. "
                      "Anything absent is gated.", style="dim")

    def _gate_target(self, args: list[str], handler: Callable[..., Any], extra: int) -> tuple[str, str, list[str]]:
        """(section, key, remaining words) from `db <table> …` or `<tool> …`."""
        section = "db" if args and args[0] == "db" else "tools"
        words = self._args(args[1:] if section == "db" else args, handler, extra + 1)
        if not words[0] or any(c.isspace() for c in words[0]):
            raise InputError(f"invalid {'table' if section == 'db' else 'tool'} name {words[0]!r}")
        return section, words[0], words[1:]

    def _known_tools(self) -> list[str]:
        """Tools the core and the manifest's plugins declare (an MCP server's tools are known only when it runs)."""
        plugins = [t for entry in self.files.manifest.plugins.values() for t in entry.tools]
        return sorted({*CORE_GATES, *plugins})

    def _check_tools(self, names: list[str], force: bool) -> None:
        """Refuse tool names nobody declares (a typo would silently gate or open nothing), unless forced."""
        known = self._known_tools()
        for name in names:
            if name == "*" or name in known:
                continue
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            message = (f"no plugin or core module declares a tool '{name}'; {hint}known: {', '.join(known)}. "
                       "Tools of MCP servers (<server>_<tool>) are known only while they run")
            if not force:
                raise InputError(f"{message}; add --force to use the name anyway")
            self.term.warn(message)

    def cmd_gate_set(self, args: list[str]) -> None:
        """gate-set [db] <table|tool|*|__meta__> <read|write|ddl> <true|false> [--force]: true = auto-allow.

        `gate-set db users write false` gates writes to the table users; `gate-set db logs ddl true`
        lets CREATE/DROP/ALTER/RENAME/TRUNCATE of logs run unasked (write never covers them; db only);
        `gate-set db * read true`
        lets reads of every other table run unasked; `gate-set ddgs_search read true` lets that tool
        run unasked; `gate-set * write false` gates writes of every tool without its own entry.
        A tool name that no plugin or core module declares is refused (a typo would change nothing)
        unless --force is given (tools of MCP servers).
        """
        force = "--force" in args
        section, key, (operation, text) = self._gate_target([a for a in args if a != "--force"],
                                                            self.cmd_gate_set, 2)
        if section == "tools":
            self._check_tools([key], force)
        operations = ("read", "write", "ddl") if section == "db" else ("read", "write")
        if operation not in operations:
            hint = " (ddl is for database tables: gate-set db <table> ddl …)" if operation == "ddl" else ""
            raise InputError(f"invalid operation '{operation}': {', '.join(operations)}{hint}")
        value = _bool(text)
        raw = self.files.raw(GATE_DEFAULTS_FILE)
        blank = dict.fromkeys(operations, False)
        raw.setdefault(section, {}).setdefault(key, blank)[operation] = value
        self.files.save(GATE_DEFAULTS_FILE, raw)
        what = f"{section} {key}" if section == "db" else f"tool {key}"
        self.term.done(f"{what}: {operation} {'auto-allowed' if value else 'gated'}")

    def cmd_gate_reset(self, args: list[str]) -> None:
        """gate-reset [db <table> | <tool>]: gate everything again, or drop one entry (it falls back to *)."""
        raw = self.files.raw(GATE_DEFAULTS_FILE)
        if not args:
            raw.update(copy.deepcopy(ALL_GATED))
            self.files.save(GATE_DEFAULTS_FILE, raw)
            self.term.done("every gate is on again (db and tools)")
            return
        section, key, _ = self._gate_target(args, self.cmd_gate_reset, 0)
        if key not in raw.get(section, {}):
            self.term.say(f"{section} has no entry '{key}'; nothing to do.")
            return
        del raw[section][key]
        self.files.save(GATE_DEFAULTS_FILE, raw)
        self.term.done(f"removed the {section} entry '{key}'")


def _shipped_default(name: str) -> str | None:
    """The shipped copy of a config file (`defaults/`) when it is valid; None when there is none."""
    source = shipped_path(name)
    try:
        text = source.read_text(encoding="utf-8")
        validate_data(FILE_MODELS[name], json.loads(text), source)
    except (OSError, ValueError, ConfigError):
        return None
    return text


def _suggest(name: str, known: list[str]) -> list[str]:
    """What the operator probably meant: the names `name` begins (all of them, up to 3), else the closest one."""
    starting = [k for k in known if k.startswith(name.lower())] if name else []
    return starting[:3] if starting else difflib.get_close_matches(name, known, n=1)


def _since(text: str) -> float:
    """`--since`: an ISO date/time, or a number of hours ago."""
    try:
        return time.time() - float(text) * 3600
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise InputError(f"--since {text!r}: give an ISO date/time (2026-11-25T08:00) or hours ago (24)") from None


def _dedent(doc: str) -> str:
    lines = doc.strip().splitlines()
    return "\n".join([lines[0], *(line.strip() for line in lines[1:])])


class _OnceHandler(logging.Handler):
    """Shows config warnings (unknown fields) once each, as agentctl warnings."""

    def __init__(self, term: Terminal):
        super().__init__(logging.WARNING)
        self.term = term
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().replace(" ignored", " (kept)")
        if message not in self.seen:
            self.seen.add(message)
            self.term.warn(message)


def main(argv: list[str] | None = None) -> int:
    """Run one command, or the prompt without one; return the exit code (0 ok, 1 bad input, 2 file problem)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgParser(prog="agentctl.py", add_help=False, allow_abbrev=False)
    parser.add_argument("--config-dir", default=None)
    parser.add_argument("--json", action="store_true")
    term = Terminal()
    try:
        opts, words = parser.parse_known_args(argv)
    except InputError as exc:
        term.error(str(exc))
        return 1
    term.json_output = opts.json
    if words[:1] in (["-h"], ["--help"]):
        words = ["help", *words[1:]]
    logger = logging.getLogger("agent_mcp")
    logger.addHandler(_OnceHandler(term))
    logger.propagate = False
    config_dir = Path(opts.config_dir).resolve() if opts.config_dir else CODE_DIR
    ctl = AgentCtl(config_dir, term, in_prompt=not words)
    if not words:
        return ctl.prompt()
    return ctl.run(words)


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # `agentctl --json … | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        code = 0
    sys.exit(code)
