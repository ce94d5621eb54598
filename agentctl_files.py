"""agentctl's view of the config directory: each file read, validated and written back atomically,
and the errors agentctl reports."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

import json_edit
from config import (
    ENABLED_FILE,
    GATE_DEFAULTS_FILE,
    MANIFEST_FILE,
    MODELS_FILE,
    AppConfig,
    ConfigError,
    EnabledConfig,
    GateDefaults,
    Manifest,
    ModelConfig,
    ModelsFile,
    atomic_write,
    config_path,
    config_problems,
    load_env,
    read_json,
    validate_data,
)

FILE_MODELS: dict[str, type[BaseModel]] = {
    MODELS_FILE: ModelsFile, MANIFEST_FILE: Manifest, ENABLED_FILE: EnabledConfig, GATE_DEFAULTS_FILE: GateDefaults,
}
#: gate-defaults.json when neither the config dir nor the checkout has one: every gate on.
ALL_GATED = {"db": {"*": {"read": False, "write": False, "ddl": False},
                    "__meta__": {"read": False, "write": False, "ddl": False}},
             "tools": {"*": {"read": False, "write": False}}}



class CtlError(Exception):
    """A command cannot be done; the message says what to do, `exit_code` is agentctl's exit status."""

    exit_code = 1


class InputError(CtlError):
    """The command asks for something invalid (unknown name, bad value, conflict); nothing was changed."""

    exit_code = 1


class FileProblem(CtlError):
    """A config file is missing, malformed or cannot be written; nothing was changed."""

    exit_code = 2


# --------------------------------------------------------------------------- config files


class ConfigFiles:
    """The config files of one directory as parsed JSON, and the one way agentctl writes them."""

    def __init__(self, config_dir: Path):
        self.dir = config_dir
        self.env = load_env(config_dir)
        self.data: dict[str, Any] = {}
        self._read: dict[str, tuple[Path, bytes | None]] = {}  # what each file was read from, to notice edits
        #: Saves a file a running server owns through that server (agentctl_remote.OwnedWriter); None: never.
        self.via_server: Any = None
        for name, model in FILE_MODELS.items():
            path = config_path(config_dir, name)
            try:
                raw = read_json(path) if name != GATE_DEFAULTS_FILE or path.exists() else copy.deepcopy(ALL_GATED)
                validate_data(model, raw, path)
            except ConfigError as exc:
                raise FileProblem(f"{exc}\nRun `agentctl repair {name}` to save it aside and start from the shipped "
                                  "defaults, or fix it by hand (agentctl changes only valid files).") from None
            self.data[name] = raw
            self._read[name] = path, _contents(path)

    def parsed(self, name: str, data: dict[str, Any] | None = None) -> Any:
        """One file (from `data`, default the current contents) as its pydantic model."""
        return validate_data(FILE_MODELS[name], (self.data if data is None else data)[name], self.dir / name)

    @property
    def models(self) -> dict[str, ModelConfig]:
        parsed: ModelsFile = self.parsed(MODELS_FILE)
        return parsed.models

    @property
    def enabled(self) -> EnabledConfig:
        parsed: EnabledConfig = self.parsed(ENABLED_FILE)
        return parsed

    @property
    def manifest(self) -> Manifest:
        parsed: Manifest = self.parsed(MANIFEST_FILE)
        return parsed

    def app_config(self) -> AppConfig:
        """What the server would see (for the plugin checks it runs at start)."""
        return AppConfig(
            config_dir=self.dir,
            env=self.env,
            manifest=self.manifest,
            enabled=self.enabled,
            models={k: m for k, m in self.models.items() if m.enabled},
            gates=self.parsed(GATE_DEFAULTS_FILE),
        )

    def _problems(self, data: dict[str, Any]) -> list[str]:
        models = self.parsed(MODELS_FILE, data).models
        enabled = {k: m for k, m in models.items() if m.enabled}
        return config_problems(self.dir, enabled, self.parsed(ENABLED_FILE, data))

    def raw(self, name: str) -> Any:
        """A deep copy of one file's JSON to edit and hand to save()."""
        return copy.deepcopy(self.data[name])

    def save(self, name: str, raw: Any) -> Path:
        """Write one file into the config dir after loading the written copy with the server's models."""
        target = self.dir / name
        before = self._problems(self.data)
        if self.via_server is not None and name in self.via_server.owned:
            candidate = {**self.data, name: copy.deepcopy(raw)}
            try:
                self.parsed(name, candidate)
            except ConfigError as exc:
                raise InputError(f"refused, the result would be invalid: {exc}") from None
            if new := [p for p in self._problems(candidate) if p not in before]:
                raise InputError(f"refused: the server would not start with this change: {new[0]}")
            if self.via_server.save(name, raw):  # the running server wrote it, applied it and audited it
                self.data[name] = copy.deepcopy(raw)
                return target

        def check(tmp: Path) -> None:
            source, contents = self._read[name]
            if config_path(self.dir, name) != source or _contents(source) != contents:
                raise FileProblem(f"{source} was changed by someone else meanwhile; nothing was changed, "
                                  "run the command again")
            candidate = {**self.data, name: read_json(tmp)}
            self.parsed(name, candidate)
            new = [p for p in self._problems(candidate) if p not in before]
            if new:
                raise InputError(f"refused: the server would not start with this change: {new[0]}")

        contents = self._read[name][1]
        # In the layout the file had (only what changed is rewritten: a minimal diff); a new file: plain.
        text = (json_edit.edit(contents.decode("utf-8"), self.data[name], raw) if contents is not None
                else json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
        try:
            atomic_write(target, text, check)
        except ConfigError as exc:
            raise InputError(f"refused, the result would be invalid: {exc}") from None
        except OSError as exc:
            raise FileProblem(f"{target}: cannot write ({exc.strerror or exc}); nothing was changed") from None
        self.data[name] = copy.deepcopy(raw)
        self._read[name] = target, _contents(target)
        return target


def _contents(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def field_value(model: type[BaseModel], field: str, value: Any, base: dict[str, Any]) -> Any:
    """`value` (often a string typed by the operator) checked and converted by `model`'s own field."""
    try:
        result = getattr(model.model_validate({**base, field: value}), field)
    except ValidationError as exc:
        errors = [e for e in exc.errors() if e["loc"] and e["loc"][0] == field] or exc.errors()
        raise InputError(f"invalid {field} {value!r}: {errors[0]['msg']}") from None
    return int(result) if isinstance(result, float) and result.is_integer() else result


def model_value(field: str, text: str) -> Any:
    """A `llm-models.json` field from the operator's text (`null` clears host/env_key, `a,b` lists tools)."""
    value: Any = text
    if field in ("host", "env_key") and text.strip().lower() in ("", "null", "none"):
        value = None
    elif field == "llm_tools" and text.strip() != "all":
        value = [t.strip() for t in text.split(",") if t.strip()]
    return field_value(ModelConfig, field, value, {"model_id": "x", "type": "OPENAI"})
