"""agentctl repair: a config file that is broken or missing is re-created from the shipped defaults, the broken
one saved aside (it runs when the config files do not load, so it reads them one by one)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import agentctl_remote
from agentctl_base import CommandBase
from agentctl_files import FILE_MODELS, FileProblem
from agentctl_term import RESTART
from config import ConfigError, atomic_write, load_env, read_json, shipped_path, validate_data


class RepairCommands(CommandBase):
    """repair."""

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
        if any(r["action"] == "repaired" for r in report):
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
        # Only a file of its own gets here (else it returned above): it is saved aside, then re-created.
        saved = target.with_name(f"{name}.broken-{time.strftime('%Y%m%dT%H%M%S')}")
        target.rename(saved)
        atomic_write(target, default)
        return {"file": name, "action": "repaired", "saved_as": str(saved),
                "detail": f"{problem}; saved as {saved.name}, re-created from the shipped defaults"}


def _shipped_default(name: str) -> str | None:
    """The shipped copy of a config file (`defaults/`) when it is valid; None when there is none."""
    source = shipped_path(name)
    try:
        text = source.read_text(encoding="utf-8")
        validate_data(FILE_MODELS[name], json.loads(text), source)
    except (OSError, ValueError, ConfigError):
        return None
    return text
