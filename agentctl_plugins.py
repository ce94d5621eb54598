"""agentctl's plugin commands: which plugins start with the server, what each needs, and the ports of the
client interfaces (`plugins-enabled.json`; the manifest is only read)."""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import socket
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from rich.markup import escape
from rich.table import Table

from agentctl_base import CommandBase
from agentctl_files import InputError
from config import ENABLED_FILE, SECRET_NAME, AppConfig
from plugin_checks import check_plugin, is_enabled

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


class PluginCommands(CommandBase):
    """list, info, enable, disable, port-list, port-set."""

    def _plugin(self, name: str) -> str:
        manifest = self.files.manifest.plugins
        if name not in manifest:
            raise self._unknown("plugin", name, list(manifest))
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

    def cmd_list(self, args: list[str]) -> None:
        """list: every plugin: ✓ enabled and ready, – configured but off, ✗ enabled with problems, ○ available."""
        self._args(args, self.cmd_list, 0)
        cfg = self.files.app_config()
        manifest = cfg.manifest.plugins
        names = sorted(dict.fromkeys([*manifest, *cfg.enabled.enabled_plugins]),
                       key=lambda n: (manifest[n].priority, n) if n in manifest else (10**9, n))
        rows: list[dict[str, Any]] = []  # JSON rows (--json prints them as they are)
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
        rows: list[dict[str, Any]] = []  # JSON rows (--json prints them as they are)
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
