"""Configuration: `.env`, `llm-models.json`, `plugin-manifest.json`, `plugins-enabled.json`, `agents.json`.

Every file is loaded into pydantic models; a malformed file or field stops start-up with a
`ConfigError` that names the file and the field. Files are looked up in the config directory
first and fall back to the shipped copies (`defaults/` for the files an instance writes, the
checkout for the plugin manifest), so a fresh checkout runs as is and a second instance only needs
the files it changes. The shipped copies are never written: an instance writes its own copies
(`own_copies`), which in the checkout itself are git-ignored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import unquote, urlsplit

from dotenv import dotenv_values
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

logger = logging.getLogger("agent_mcp.config")

CODE_DIR = Path(__file__).resolve().parent
#: The shipped defaults of the files an instance writes (OWN_FILES); tracked, never written at run time.
DEFAULTS_DIR = CODE_DIR / "defaults"
MODELS_FILE = "llm-models.json"
MANIFEST_FILE = "plugin-manifest.json"
ENABLED_FILE = "plugins-enabled.json"
GATE_DEFAULTS_FILE = "gate-defaults.json"
AGENTS_FILE = "agents.json"
MAX_TOOL_ITERATIONS = 10
#: Settings whose values are secrets: never logged, never shown.
SECRET_NAME = re.compile(r"(KEY|TOKEN|PASS|PASSWORD|SECRET)$", re.IGNORECASE)


class ConfigError(Exception):
    """A configuration file is missing, not JSON, or has an invalid field; the message says which."""


class _Model(BaseModel):
    # Unknown fields are kept (agentctl and newer versions may add some) but reported.
    model_config = ConfigDict(extra="allow")


#: Gate declarations of the core tools (same contract as a plugin's get_gate_tools()).
CORE_GATES: dict[str, dict[str, Any]] = {
    "get_system_info": {"type": "system", "operation": "read"},
    "read_system_prompt": {"type": "system", "operation": "read"},
    "update_system_prompt": {"type": "system", "operation": "write"},
    "llm_list": {"type": "system", "operation": "read"},
    "llm_clean_text": {"type": "llm_call", "operation": "read"},
    "llm_clean_tool": {"type": "llm_call", "operation": "read"},
    # It sends data to another system and sets off work there.
    "agent_call": {"type": "agent_call", "operation": "write"},
}

class ModelConfig(_Model):
    """One entry of `llm-models.json`."""

    model_id: str = Field(min_length=1)
    type: Literal["OPENAI", "GEMINI"]
    host: str | None = None
    env_key: str | None = None
    max_context: int = Field(default=50, ge=2)
    enabled: bool = True
    tool_call_available: bool = False
    llm_call_timeout: float = Field(default=60, gt=0)
    description: str = ""
    llm_tools: Literal["all"] | list[str] = "all"
    max_retries: int = Field(default=2, ge=0, le=10)
    router: bool = False
    #: "native": tools go through the API's tool calling; "text": they are described in the system
    #: prompt and the model answers with `<tool_code>` blocks (servers without tool calling).
    tool_mode: Literal["native", "text"] = "native"
    #: The model's context window in tokens; None: asked from the backend, else a default (budget.py).
    context_tokens: int | None = Field(default=None, ge=512)
    #: Share of the window kept free for the answer; the request gets the rest.
    answer_share: float = Field(default=0.25, gt=0, le=0.75)
    #: Sampling temperature sent with every request; None: the client library's default (OpenAI-compatible:
    #: none sent, so the server's; Gemini: langchain-google-genai's).
    temperature: float | None = Field(default=None, ge=0, le=2)

    @field_validator("host")
    @classmethod
    def _host_is_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https:// (or be null)")
        return v


class ManifestEntry(_Model):
    """One plugin of `plugin-manifest.json`: what exists and what it needs."""

    type: Literal["data_tool", "client_interface"]
    file: str = Field(min_length=1)
    description: str = ""
    dependencies: list[str] = []
    env_vars: list[str] = []
    #: Files in the data dir whose variables count as set for `env_vars` (e.g. db-setup's db-accounts.env).
    env_files: list[str] = []
    config_files: list[str] = []
    priority: int = 500
    tools: list[str] = []
    default_port: int | None = Field(default=None, ge=1, le=65535)
    #: What the operator grants the plugin beyond its own sessions (plugin_checks.GRANTS, e.g. "all-sessions").
    grants: list[str] = []


class RateLimit(_Model):
    """A rate-limit window for one tool type."""

    calls: int = Field(ge=0)
    window_seconds: float = Field(ge=0)
    auto_disable: bool = False


class SessionLimit(_Model):
    """Bounds of the sessions of one client class."""

    #: Days without activity after which a session is deleted; null: never.
    idle_days: float | None = Field(default=7, gt=0)
    #: Sessions of the class kept at most; beyond it the least recently active idle one is deleted.
    max_sessions: int = Field(default=1000, ge=1)


class SessionsConfig(_Model):
    """`sessions` of `plugins-enabled.json`: how long sessions live, how many are kept, how much they store."""

    #: Interactive clients (shell.py): never expire unless configured.
    interactive: SessionLimit = SessionLimit(idle_days=None)
    #: Every other client (API, swarm, proxy, Slack, MCP, ids no plugin owns).
    non_interactive: SessionLimit = SessionLimit()
    #: Per client class (shell, api, swarm, proxy, slack, mcp): replaces the entry above for that class.
    classes: dict[str, SessionLimit] = {}
    #: Messages of history stored per session; the oldest whole turns go first.
    max_history_messages: int = Field(default=1000, ge=2)
    #: Characters of one stored message; longer texts are cut when the session is saved.
    max_message_chars: int = Field(default=200_000, ge=1000)
    #: Minutes between two sweeps (expiry and caps) of the running server.
    sweep_minutes: float = Field(default=60, gt=0)

    def limit(self, kind: str, interactive: bool) -> SessionLimit:
        """The bounds of client class `kind`."""
        return self.classes.get(kind) or (self.interactive if interactive else self.non_interactive)


#: How long a gate routed to approvers waits for an answer by default, and the longest wait allowed.
APPROVAL_TIMEOUT = 300.0
MAX_APPROVAL_TIMEOUT = 3600.0
_SLACK_USER = re.compile(r"[UW][A-Z0-9]{2,40}")
_SLACK_CHANNEL = re.compile(r"[CGD][A-Z0-9]{2,40}")
_TOKEN_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")


def _known_fields(model: type[BaseModel], data: Any) -> Any:
    """Refuse unknown fields with the list of known ones: a misspelt approver must not leave gates unanswerable."""
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(model.model_fields))
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}; the fields are "
                             f"{', '.join(model.model_fields)} (see docs/approvals.md)")
    return data


class Approvers(BaseModel):
    """Who may answer a routed gate (`approvals` of plugins-enabled.json; see docs/approvals.md)."""

    #: Slack user ids (U…/W…) who may answer, wherever the gate is shown to them.
    slack_users: list[str] = []
    #: A Slack channel id (C…/G…/D…) the gate is posted to; without slack_users anyone answering there may.
    slack_channel: str | None = None
    #: Shell windows that opted in with `!approver on` (token-authenticated shell.py windows only).
    shell: bool = False
    #: Names of human MCP tokens (mcp-tokens.json) whose holders may answer.
    mcp_tokens: list[str] = []
    #: API clients holding the admin key (API_ADMIN_KEY).
    api_admin: bool = False
    #: Seconds a gate routed by this entry waits (default: the section's timeout_seconds).
    timeout_seconds: float | None = Field(default=None, gt=0, le=MAX_APPROVAL_TIMEOUT)

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, data: Any) -> Any:
        return _known_fields(cls, data)

    @field_validator("slack_users")
    @classmethod
    def _slack_users(cls, v: list[str]) -> list[str]:
        for user in v:
            if not _SLACK_USER.fullmatch(user):
                raise ValueError(f"{user[:60]!r} is not a Slack user id: use the member id (U… or W…, e.g. "
                                 "U0123ABCD; in Slack: the profile's ⋮ menu → Copy member ID), not a name")
        return v

    @field_validator("slack_channel")
    @classmethod
    def _slack_channel(cls, v: str | None) -> str | None:
        if v is not None and not _SLACK_CHANNEL.fullmatch(v):
            raise ValueError(f"{v[:60]!r} is not a Slack channel id: use the channel id (C…, G… or D…, e.g. "
                             "C0123ABCD; in Slack: the channel's details → About, at the bottom), not its #name")
        return v

    @field_validator("mcp_tokens")
    @classmethod
    def _token_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _TOKEN_NAME.fullmatch(name):
                raise ValueError(f"{name[:60]!r} is not an MCP token name: use the 'name' of a human token in "
                                 "mcp-tokens.json (letters, digits, . _ @ -), never the token itself")
        return v

    def empty(self) -> bool:
        """True when this entry names nobody (its gates are not routed: they are refused as without approvals)."""
        return not (self.slack_users or self.slack_channel or self.shell or self.mcp_tokens or self.api_admin)


class ClassApprovers(Approvers):
    """The approvers of one client class, with entries of their own for some tools and (db gates) tables."""

    tools: dict[str, Approvers] = {}
    tables: dict[str, Approvers] = {}


class ApprovalsConfig(BaseModel):
    """`approvals` of plugins-enabled.json: per client class, who answers the gates that class cannot."""

    timeout_seconds: float = Field(default=APPROVAL_TIMEOUT, gt=0, le=MAX_APPROVAL_TIMEOUT)
    #: Client class (client_classes.CLASSES: api, swarm, proxy, slack, mcp, unknown) → its approvers.
    classes: dict[str, ClassApprovers] = {}

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, data: Any) -> Any:
        return _known_fields(cls, data)


class EnabledConfig(_Model):
    """`plugins-enabled.json`: the operator's control panel."""

    version: str = "1.0.0"
    default_model: str
    enabled_plugins: list[str] = []
    plugin_config: dict[str, dict[str, Any]] = {}
    rate_limits: dict[str, RateLimit] = {}
    sessions: SessionsConfig = SessionsConfig()
    #: Who answers the gates of client classes that cannot answer them (none: they are refused as the spec says).
    approvals: ApprovalsConfig = ApprovalsConfig()


class Manifest(_Model):
    """`plugin-manifest.json`."""

    version: str = "1.0.0"
    plugins: dict[str, ManifestEntry]


class ModelsFile(_Model):
    """`llm-models.json`."""

    version: str = "1.0.0"
    models: dict[str, ModelConfig]


class ToolPermission(_Model):
    """Whether a tool's reads / writes run without asking (True = auto-allow, gate off)."""

    read: bool = False
    write: bool = False


class GatePermission(ToolPermission):
    """Whether reads / writes / DDL of a database key run without asking (True = auto-allow, gate off).

    `ddl` (CREATE, DROP, ALTER, RENAME, TRUNCATE) never follows from `write`; files written before
    it existed load with it off.
    """

    ddl: bool = False


class GateDefaults(_Model):
    """`gate-defaults.json`: the gate state every session starts from (absent = gated).

    `db` is keyed by table name, `*` (every table without its own entry) and `__meta__`
    (statements that touch no table: SHOW, DESCRIBE, …); `tools` by tool name and `*`.
    """

    version: str = "1.0.0"
    db: dict[str, GatePermission] = {}
    tools: dict[str, ToolPermission] = {}


class AgentTarget(_Model):
    """One agent-mcp instance `agent_call` may reach: its API URL and the token to present there."""

    url: str
    #: Name of the environment variable holding the bearer token this target issued (None: send none).
    token_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    timeout: float = Field(default=120, gt=0, le=3600)
    description: str = ""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")


class AgentsFile(_Model):
    """`agents.json`: the allow-list of agents `agent_call` may call, by name."""

    version: str = "1.0.0"
    agents: dict[str, AgentTarget] = {}

    @field_validator("agents")
    @classmethod
    def _names(cls, v: dict[str, AgentTarget]) -> dict[str, AgentTarget]:
        bad = [name for name in v if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name)]
        if bad:
            raise ValueError(f"agent names may use letters, digits, '_', '.', '-' only: {', '.join(bad)}")
        return v


class AppConfig(BaseModel):
    """Everything the server reads at start, with disabled models already removed."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    config_dir: Path
    env: dict[str, str]
    models: dict[str, ModelConfig]
    manifest: Manifest
    enabled: EnabledConfig
    gates: GateDefaults = GateDefaults()
    agents: dict[str, AgentTarget] = {}

    @property
    def default_model(self) -> str:
        return self.enabled.default_model

    def plugin_config(self, name: str) -> dict[str, Any]:
        return dict(self.enabled.plugin_config.get(name, {}))

    def data_dir(self) -> Path:
        return Path(self.env.get("AGENT_DATA_DIR") or self.config_dir / "data")

    def path(self, name: str) -> Path:
        """A config-relative file: the config dir's copy, else the one shipped with the code."""
        return config_path(self.config_dir, name)


def env_seconds(env: Mapping[str, str], name: str, default: float, *, meaning: str = "") -> float:
    """A number of seconds from 0 to 3600 in environment variable `name` (`default` when unset); ConfigError naming
    it otherwise (`meaning`: what 0 does, for the message)."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        zero = f" ({meaning})" if meaning else ""
        raise ConfigError(f"environment variable {name}={raw[:40]!r}: must be a number of seconds from 0{zero} to "
                          f"3600 (default {default:g})")
    return value


def config_path(config_dir: Path, name: str) -> Path:
    """Where a config file is read from: `config_dir/name` if present, else the shipped default."""
    own = Path(config_dir) / name
    return own if own.exists() else shipped_path(name)


def shipped_path(name: str) -> Path:
    """The shipped copy of a config file: `defaults/` for the files an instance writes, else the checkout's."""
    return DEFAULTS_DIR / name if name in OWN_FILES else CODE_DIR / name


def read_json(path: Path) -> Any:
    """Parse a JSON file, turning every failure into a ConfigError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None


def atomic_write(path: Path, text: str, check: Callable[[Path], object] | None = None) -> None:
    """Replace `path` with `text` all at once; `check(tmp)` may inspect the written copy and raise to abort."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp creates 0600; keep the mode the file had (a server under another user may read it).
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644)
        if check is not None:
            check(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def secret_values(env: dict[str, str], plugin_config: dict[str, Any]) -> list[str]:
    """Every configured secret, longest first: env values under secret-looking names (SECRET_NAME), the
    password of a SESSION_STORE URL, and values under such names anywhere in the plugins' settings. What
    the log filter and the non-admin redaction (client_classes.without_locations) replace by `***`."""
    found = [v for k, v in env.items() if SECRET_NAME.search(k) and v]
    with contextlib.suppress(ValueError):
        found.append(unquote(urlsplit(env.get("SESSION_STORE", "")).password or ""))

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, str(k))
        elif isinstance(value, list):
            for v in value:
                walk(v, key)
        elif SECRET_NAME.search(key) and isinstance(value, str | int) and not isinstance(value, bool):
            found.append(str(value))

    walk(plugin_config, "")
    return sorted({s for s in found if len(s) >= 6}, key=len, reverse=True)


def field_problems(exc: ValidationError, top: str, template: str = "{where}: {msg}", sep: str = "; ") -> str:
    """Every error of a pydantic validation as `template` lines (`where`: the dotted field path, or
    `top` for the whole value) joined by `sep`: the one formatter of validation errors."""
    return sep.join(template.format(where=".".join(map(str, e["loc"])) or top, msg=e["msg"]) for e in exc.errors())


_Validated = TypeVar("_Validated", bound=BaseModel)


def validate_data(model: type[_Validated], data: Any, path: Path) -> _Validated:
    """`data` (parsed JSON of `path`) as `model`; a ConfigError lists every invalid field by name."""
    try:
        obj = model.model_validate(data)
    except ValidationError as exc:
        lines = field_problems(exc, "(top level)", "  field '{where}': {msg}", "\n")
        raise ConfigError(f"{path}: invalid configuration\n{lines}") from None
    _warn_unknown(obj, path, "")
    return obj


def _warn_unknown(obj: Any, path: Path, prefix: str) -> None:
    if isinstance(obj, BaseModel):
        for key in obj.model_extra or {}:
            if key != "metadata":
                logger.warning("%s: unknown field '%s%s' ignored", path, prefix, key)
        for name in type(obj).model_fields:
            _warn_unknown(getattr(obj, name), path, f"{prefix}{name}.")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _warn_unknown(value, path, f"{prefix}{key}.")


#: What an instance writes and must therefore own: created in its config dir from the shipped
#: copies at the first start (`own_copies`). The manifest stays the checkout's (it describes code).
OWN_FILES = (".system_prompt", MODELS_FILE, ENABLED_FILE, GATE_DEFAULTS_FILE, "mcp-servers.json")


def own_copies(config_dir: Path) -> list[str]:
    """Copy each of OWN_FILES that the config dir lacks from the shipped defaults (`defaults/`), so
    edits (prompt, models, gates) stay this instance's and never change a tracked file (the checkout's
    own copies are git-ignored). Returns the names created."""
    config_dir = Path(config_dir)
    created = []
    for name in OWN_FILES:
        source, target = DEFAULTS_DIR / name, config_dir / name
        if target.exists() or not source.exists():
            continue
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
        created.append(name + ("/" if source.is_dir() else ""))
    return created


def load_env(config_dir: Path) -> dict[str, str]:
    """`.env` of the config dir under the process environment (the environment wins)."""
    env_file = Path(config_dir) / ".env"
    values = {k: v for k, v in dotenv_values(env_file).items() if v is not None} if env_file.exists() else {}
    return {**values, **os.environ}


def load_models(config_dir: Path) -> dict[str, ModelConfig]:
    """Enabled models of `llm-models.json`, by key."""
    path = config_path(config_dir, MODELS_FILE)
    models = validate_data(ModelsFile, read_json(path), path).models
    return {key: m for key, m in models.items() if m.enabled}


def load_manifest(config_dir: Path) -> Manifest:
    """`plugin-manifest.json`, the config dir's copy first. An entry of such a copy that says nothing of
    `grants` has those of the shipped entry of the same plugin and file, so a copy made before grants
    existed keeps the shell, the API and the MCP server reaching every session; `"grants": []` gives none."""
    path = config_path(config_dir, MANIFEST_FILE)
    manifest = validate_data(Manifest, read_json(path), path)
    shipped = shipped_path(MANIFEST_FILE)
    if path.resolve() != shipped.resolve():
        ours = validate_data(Manifest, read_json(shipped), shipped).plugins
        for name, entry in manifest.plugins.items():
            if "grants" not in entry.model_fields_set and name in ours and ours[name].file == entry.file:
                entry.grants = list(ours[name].grants)
    return manifest


def load_enabled(config_dir: Path) -> EnabledConfig:
    path = config_path(config_dir, ENABLED_FILE)
    return validate_data(EnabledConfig, read_json(path), path)


def load_gate_defaults(config_dir: Path) -> GateDefaults:
    """`gate-defaults.json`; without the file every gate is on."""
    path = config_path(config_dir, GATE_DEFAULTS_FILE)
    return validate_data(GateDefaults, read_json(path), path) if path.exists() else GateDefaults()


def load_agents(config_dir: Path) -> dict[str, AgentTarget]:
    """`agents.json` (the agents agent_call may reach); without the file there are none."""
    path = config_path(config_dir, AGENTS_FILE)
    return validate_data(AgentsFile, read_json(path), path).agents if path.exists() else {}


def load_config(config_dir: str | Path | None = None) -> AppConfig:
    """Load and cross-check every config file; raise ConfigError naming the file and field."""
    cdir = Path(config_dir).resolve() if config_dir else CODE_DIR
    if not cdir.is_dir():
        raise ConfigError(f"{cdir}: config directory does not exist")
    env = load_env(cdir)
    models = load_models(cdir)
    manifest = load_manifest(cdir)
    enabled = load_enabled(cdir)
    problems = config_problems(cdir, models, enabled)
    if problems:
        raise ConfigError(problems[0])
    return AppConfig(
        config_dir=cdir, env=env, models=models, manifest=manifest, enabled=enabled, gates=load_gate_defaults(cdir),
        agents=load_agents(cdir),
    )


def config_problems(config_dir: Path, models: dict[str, ModelConfig], enabled: EnabledConfig) -> list[str]:
    """What keeps files that are each valid from working together (`models`: the enabled ones)."""
    if not models:
        return [f"{config_path(config_dir, MODELS_FILE)}: no enabled model; enable at least one"]
    if enabled.default_model not in models:
        return [
            f"{config_path(config_dir, ENABLED_FILE)}: field 'default_model': '{enabled.default_model}' is not an "
            f"enabled model of {MODELS_FILE} (enabled: {', '.join(models)})"
        ]
    return []


def save_model_fields(config_dir: Path, changes: dict[str, dict[str, Any]]) -> Path:
    """Write `{model key: {field: value}}` into the config dir's `llm-models.json`; return its path.

    The file in use (the config dir's, else the shipped one) is read whole, so disabled models
    and unknown fields are kept; the result always goes to the config dir.
    """
    source = config_path(config_dir, MODELS_FILE)
    data = read_json(source)
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise ConfigError(f"{source}: no 'models' object to update")
    for key, fields in changes.items():
        if not isinstance(models.get(key), dict):
            raise ConfigError(f"{source}: model '{key}' not found")
        # `!llm_timeout local 120` stores 120, not 120.0: the file keeps the operator's number.
        models[key].update({k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in fields.items()})
    target = Path(config_dir) / MODELS_FILE
    atomic_write(target, json.dumps(data, indent=2, ensure_ascii=False) + "\n",
                 check=lambda tmp: validate_data(ModelsFile, read_json(tmp), target))
    return target


def save_gate_defaults(config_dir: Path, defaults: GateDefaults) -> Path:
    """Write `defaults` to the config dir's `gate-defaults.json` (all at once, checked); return its path."""
    target = Path(config_dir) / GATE_DEFAULTS_FILE
    text = json.dumps(defaults.model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"
    atomic_write(target, text, check=lambda tmp: validate_data(GateDefaults, read_json(tmp), target))
    return target


def resolve_api_key(model: ModelConfig, env: dict[str, str]) -> str | None:
    """The API key for a model, or None when its `env_key` is set but empty in the environment."""
    if model.env_key:
        return env.get(model.env_key) or None
    return "no-key-required"
