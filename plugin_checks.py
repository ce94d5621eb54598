"""What a plugin needs before it can start: its manifest entry, file, env vars, config files and pip
dependencies, each with the problem and what to do. Apart from the loader so that agentctl can check
plugins without importing the server.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path

from dotenv import dotenv_values
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from config import CODE_DIR, AppConfig, EnabledConfig


@dataclass
class PluginReport:
    """What happened to one plugin at start: loaded, disabled, invalid or failed, and why."""

    name: str
    status: str
    reasons: list[str] = field(default_factory=list)
    priority: int = 0

    def line(self) -> str:
        why = f": {'; '.join(self.reasons)}" if self.reasons else ""
        return f"{self.name} [{self.status}]{why}"


def requirement_names(requirements: list[str]) -> set[str]:
    """The canonical package names of pip requirement strings (a string that is none: as given)."""
    names: set[str] = set()
    for text in requirements:
        try:
            names.add(canonicalize_name(Requirement(text).name))
        except InvalidRequirement:
            names.add(text)
    return names


def dependency_problem(requirement: str) -> str | None:
    """Why a pip requirement such as `slack-sdk>=3.30` is not satisfied, or None."""
    try:
        req = Requirement(requirement)
    except InvalidRequirement:
        return f"dependency '{requirement}' is not a valid requirement string"
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return f"dependency '{req.name}' is not installed (pip install '{requirement}')"
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        return f"dependency '{req.name}' is {version}, needs {req.specifier} (pip install '{requirement}')"
    return None


#: The grant of every session (plugin_scope.py), for plugins whose job is administering them.
ALL_SESSIONS = "all-sessions"
#: What an operator may grant a plugin in its plugin-manifest.json entry (`"grants": [...]`), beyond its own
#: sessions: grant → what it lets the plugin do.
GRANTS = {
    ALL_SESSIONS: "reads and acts on every session, not only those of its own client-id namespaces "
                  "(the shell, the API's admin key, the MCP server's human token)",
}


@dataclass
class PluginCheck:
    """One requirement of a plugin (`kind`: manifest, file, env_var, config_file, dependency, grant) and its
    problem."""

    kind: str
    item: str
    problem: str | None = None


def plugin_file(cfg: AppConfig, name: str) -> Path | None:
    """The plugin's file: `plugins/<file>` in the config dir first, then next to the code."""
    entry = cfg.manifest.plugins.get(name)
    if entry is None:
        return None
    for base in (cfg.config_dir, CODE_DIR):
        candidate = base / "plugins" / entry.file
        if candidate.is_file():
            return candidate
    return None


def is_enabled(enabled: EnabledConfig, name: str) -> bool:
    """Listed in `enabled_plugins` and not switched off with `"enabled": false` in its plugin_config."""
    return name in enabled.enabled_plugins and enabled.plugin_config.get(name, {}).get("enabled", True) is not False


def check_plugin(cfg: AppConfig, name: str) -> list[PluginCheck]:
    """Each thing the plugin needs before it can start, with the problem (if any) and what to do."""
    entry = cfg.manifest.plugins.get(name)
    if entry is None:
        return [PluginCheck("manifest", name, f"not declared in plugin-manifest.json (add an entry for '{name}')")]
    checks = [
        PluginCheck(
            "file", f"plugins/{entry.file}", None if plugin_file(cfg, name) else f"file plugins/{entry.file} not found"
        )
    ]
    env = dict(cfg.env)
    for name in entry.env_files:
        path = cfg.data_dir() / name
        if path.is_file():
            env.update({k: v for k, v in dotenv_values(path).items() if v})
    also = f" or make {' / '.join(entry.env_files)} in {cfg.data_dir()}" if entry.env_files else ""
    checks += [
        PluginCheck("env_var", v, None if env.get(v) else f"environment variable {v} is not set (add it to .env{also})")
        for v in entry.env_vars
    ]
    checks += [PluginCheck("config_file", f, None if (cfg.config_dir / f).exists()
                           else f"config file {f} not found in {cfg.config_dir}") for f in entry.config_files]
    checks += [PluginCheck("dependency", d, dependency_problem(d)) for d in entry.dependencies]
    checks += [PluginCheck("grant", g, None if g in GRANTS else
                           f"plugin-manifest.json grants '{g}' is no grant; the known ones: {', '.join(GRANTS)}")
               for g in entry.grants]
    return checks
