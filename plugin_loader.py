"""Plugins: the loader that validates, imports and starts them (their contract, `BasePlugin`, is in plugin_api.py).

Plugins are declared in `plugin-manifest.json` and switched on in `plugins-enabled.json`. The
loader starts them in manifest `priority` order; a plugin that is misconfigured, fails to import
or fails to init is reported with its reason and skipped, and the server starts without it.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import importlib.util
import inspect
import logging
import re
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import client_classes
import state
import turns
from plugin_api import BasePlugin, PluginConfigError, PluginContext
from plugin_checks import PluginReport, check_plugin, is_enabled, plugin_file, requirement_names

logger = logging.getLogger("agent_mcp.plugins")



def _metadata_mismatch(plugin: BasePlugin, entry: Any) -> list[str]:
    """Where the plugin class's own metadata (DESCRIPTION, DEPENDENCIES, ENV_VARS; optional) disagrees
    with its plugin-manifest.json entry: both are shown, so the author can make them one."""
    problems = []
    if plugin.DEPENDENCIES and requirement_names(plugin.DEPENDENCIES) != requirement_names(entry.dependencies):
        problems.append(f"DEPENDENCIES {sorted(plugin.DEPENDENCIES)} disagree with the manifest's dependencies "
                        f"{sorted(entry.dependencies)} (package names must match)")
    if plugin.ENV_VARS and set(plugin.ENV_VARS) != set(entry.env_vars):
        problems.append(
            f"ENV_VARS {sorted(plugin.ENV_VARS)} disagree with the manifest's env_vars {sorted(entry.env_vars)}"
        )
    if plugin.DESCRIPTION and entry.description and plugin.DESCRIPTION != entry.description:
        problems.append(f"DESCRIPTION {plugin.DESCRIPTION!r} disagrees with the manifest's description "
                        f"{entry.description!r}")
    return problems


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _describe_import_error(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({Path(exc.filename or '?').name}, line {exc.lineno})"
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" ({Path(frame.filename).name}, line {frame.lineno})" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"


class PluginLoader:
    """Loads the enabled plugins of one runtime and shuts them down in reverse order."""

    def __init__(self, rt: state.Runtime):
        self.rt = rt
        self.loaded: list[BasePlugin] = []
        self.reports: dict[str, PluginReport] = {}

    # ── discovery and validation ──

    def plugin_file(self, name: str) -> Path | None:
        return plugin_file(self.rt.config, name)

    def is_enabled(self, name: str) -> bool:
        return is_enabled(self.rt.config.enabled, name)

    def validate(self, name: str) -> list[str]:
        """Every reason the plugin cannot start (empty when it can)."""
        return [c.problem for c in check_plugin(self.rt.config, name) if c.problem]

    # ── loading ──

    def _import(self, name: str, path: Path) -> type[BasePlugin]:
        module_name = f"agent_mcp_plugin_{name}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module: ModuleType = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        classes = [
            obj for obj in vars(module).values()
            if isinstance(obj, type) and issubclass(obj, BasePlugin) and obj is not BasePlugin
            and obj.__module__ == module_name and not inspect.isabstract(obj)
        ]
        if not classes:
            raise ImportError(f"{path.name} defines no concrete BasePlugin subclass")
        named = [c for c in classes if c.PLUGIN_NAME == name]
        return (named or classes)[0]

    def _check_interface(self, name: str, plugin: BasePlugin) -> list[str]:
        entry = self.rt.config.manifest.plugins[name]
        expected = entry.type
        problems = _metadata_mismatch(plugin, entry)
        if plugin.PLUGIN_TYPE != expected:
            problems.append(f"PLUGIN_TYPE is {plugin.PLUGIN_TYPE!r} but the manifest says {expected!r}")
        if plugin.PLUGIN_NAME and plugin.PLUGIN_NAME != name:
            problems.append(f"PLUGIN_NAME is {plugin.PLUGIN_NAME!r}, manifest key is {name!r}")
        if expected == "client_interface" and type(plugin).get_routes is BasePlugin.get_routes:
            problems.append("client_interface plugins must implement get_routes()")
        if expected == "data_tool" and type(plugin).get_tools is BasePlugin.get_tools:
            problems.append("data_tool plugins must implement get_tools()")
        return problems

    async def load(self, name: str) -> PluginReport:
        """Validate, import, init and register one plugin; never raises."""
        entry = self.rt.config.manifest.plugins.get(name)
        report = PluginReport(name, "loaded", priority=entry.priority if entry else 0)
        self.reports[name] = report
        if not self.is_enabled(name):
            report.status, report.reasons = "disabled", ["enabled: false in plugins-enabled.json"]
            return report
        problems = self.validate(name)
        if problems:
            report.status, report.reasons = "invalid", problems
            return report
        path = self.plugin_file(name)
        assert path is not None and entry is not None
        try:
            plugin = self._import(name, path)()
        except Exception as exc:
            report.status, report.reasons = (
                "failed",
                [f'Error importing plugin "{name}": {_describe_import_error(exc)}'],
            )
            return report
        problems = self._check_interface(name, plugin)
        if problems:
            report.status, report.reasons = "invalid", problems
            return report
        plugin.PLUGIN_NAME = name  # the manifest's key: what its namespaces, scope and values are recorded under
        try:  # declared before init(): the plugin reaches its own sessions from the start
            if plugin.PLUGIN_TYPE == "client_interface":
                self._declare_namespaces(name, plugin)
        except ValueError as exc:
            report.status, report.reasons = "invalid", [str(exc)]
            return report
        plugin.context = PluginContext(self.rt, plugin, self.reports, grants=entry.grants)
        try:
            ok = await _maybe_await(plugin.init(self.rt.config.plugin_config(name)))
            why = "init returned False (see the log lines above)"
        except PluginConfigError as exc:
            ok, why = False, str(exc)
        except Exception as exc:
            ok, why = False, f"init raised {_describe_import_error(exc)}"
        if ok is False:
            self._forget_namespaces(name)
            report.status, report.reasons = "failed", [why]
            return report
        try:
            self._register(name, plugin)
        except Exception as exc:
            self.rt.tools.unregister_owner(name)
            self._forget_namespaces(name)
            for cmd in [c for c, spec in self.rt.commands.items() if spec.owner == name]:
                del self.rt.commands[cmd]
            await self._shutdown_one(plugin)
            report.status, report.reasons = "failed", [str(exc)]
            return report
        plugin.enabled = True
        self.loaded.append(plugin)
        return report

    def _declare_namespaces(self, name: str, plugin: BasePlugin) -> None:
        """Record the plugin's client-id namespaces; a class that does not exist, an empty prefix or one
        that overlaps another plugin's namespace is refused (it could take over that plugin's sessions)."""
        declared = dict(plugin.CLIENT_NAMESPACES or {})
        for prefix, kind in declared.items():
            if kind not in client_classes.CLASSES or kind == client_classes.UNKNOWN:
                raise ValueError(f"CLIENT_NAMESPACES: '{prefix}' names class {kind!r}; use one of "
                                 f"{', '.join(k for k in client_classes.CLASSES if k != client_classes.UNKNOWN)}")
            if not prefix or not re.fullmatch(r"[A-Za-z0-9._:@-]+", prefix):
                raise ValueError(
                    f"CLIENT_NAMESPACES: {prefix!r} is not a client-id prefix (letters, digits, . _ : @ -)"
                )
            for other, (_, owner) in self.rt.client_namespaces.items():
                if owner != name and (other.startswith(prefix) or prefix.startswith(other)):
                    raise ValueError(f"CLIENT_NAMESPACES: '{prefix}' overlaps '{other}' of {owner}")
        for prefix, kind in declared.items():
            self.rt.client_namespaces[prefix] = (kind, name)

    def _forget_namespaces(self, name: str) -> None:
        for prefix in [p for p, (_, owner) in self.rt.client_namespaces.items() if owner == name]:
            del self.rt.client_namespaces[prefix]

    def _register(self, name: str, plugin: BasePlugin) -> None:
        if plugin.PLUGIN_TYPE == "data_tool":
            self.rt.tools.register_plugin_tools(name, plugin.get_tools())
            self.rt.tools.register_gate_tools(name, plugin.get_gate_tools())
        commands = plugin.get_commands() or {}
        for cmd, handler in commands.items():
            key = str(cmd).lower().lstrip("!")
            if not key.isidentifier() or not inspect.iscoroutinefunction(handler):
                raise TypeError(f"get_commands(): '{cmd}' needs a name like 'mycmd' and an async handler")
            other = self.rt.commands.get(key)
            if other is not None:
                raise ValueError(f"get_commands(): !{key} is already provided by {other.owner}")
        for cmd, handler in commands.items():
            self.rt.commands[str(cmd).lower().lstrip("!")] = as_command(handler, name)

    async def load_all(self) -> list[PluginReport]:
        """Load every plugin named in `enabled_plugins`, lowest manifest priority first."""
        manifest = self.rt.config.manifest.plugins
        names = list(dict.fromkeys(self.rt.config.enabled.enabled_plugins))
        names.sort(key=lambda n: manifest[n].priority if n in manifest else 10**9)
        reports = [await self.load(n) for n in names]
        for r in reports:
            log = logger.info if r.status in ("loaded", "disabled") else logger.error
            log("plugin %s", r.line())
        for name in self.rt.config.enabled.plugin_config:  # settings nobody reads: said, not silently ignored
            if name not in manifest or name not in names:
                close = difflib.get_close_matches(name, list(manifest), n=1)
                why = (f"names no plugin of plugin-manifest.json{f' (did you mean {close[0]}?)' if close else ''}"
                       if name not in manifest else "belongs to a plugin that is not in enabled_plugins")
                logger.warning("plugins-enabled.json: plugin_config.%s %s; its settings are not used", name, why)
        return reports

    def client_plugins(self) -> list[BasePlugin]:
        return [p for p in self.loaded if p.PLUGIN_TYPE == "client_interface"]

    def client_credentials(self) -> set[str]:
        """The port and admin tokens the loaded client plugins accept."""
        return {token for p in self.client_plugins() for k in ("token", "admin_token")
                if (token := p.get_config().get(k))}

    async def _shutdown_one(self, plugin: BasePlugin) -> None:
        self._forget_namespaces(plugin.PLUGIN_NAME)
        try:
            await _maybe_await(plugin.shutdown())
        except Exception:
            logger.exception("plugin %s: shutdown failed", plugin.PLUGIN_NAME)
        plugin.enabled = False

    async def shutdown_all(self) -> None:
        """Call every loaded plugin's `shutdown()`, last loaded first."""
        while self.loaded:
            await self._shutdown_one(self.loaded.pop())


def as_command(handler: Callable[..., Awaitable[Any]], owner: str) -> turns.Command:
    """A plugin's command handler as a Command, called in the one form commands take: (turn, args).

    Handlers written as the plugin contract shows them, `handler(args)`, are adapted; a handler
    that also wants the request (who sent it, with which privileges) takes `(turn, args)`.
    """
    if len(inspect.signature(handler).parameters) >= 2:
        call = handler
    else:
        @functools.wraps(handler)
        async def call(turn: turns.Turn, args: str) -> Any:
            return await handler(args)

    return turns.Command(call, owner=owner, usage=turns.usage_of(handler))
