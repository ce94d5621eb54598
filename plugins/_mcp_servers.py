"""mcp-servers.json and the MCP tools it yields: server settings, tool schemas for the model, results as text."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

from langchain_core.tools import StructuredTool
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from config import ConfigError, read_json
from plugin_api import ToolError

# mcp_types and jsonschema are imported where a server's tools and results are handled: reading
# mcp-servers.json (at every start with the plugin on) needs neither.
if TYPE_CHECKING:
    import mcp_types as types

logger = logging.getLogger("agent_mcp.mcp_client")
#: OpenAI rejects function names longer than this.
MAX_TOOL_NAME = 64


def _env_name(v: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
        raise ValueError(f"{v!r} is not an environment variable name (letters, digits, _)")
    return v


def _server_name(v: str) -> str:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,31}", v):
        raise ValueError(f"server name {v!r}: use up to 32 letters, digits and _, starting with a letter "
                         "(it prefixes the names of the server's tools)")
    return v


EnvName = Annotated[str, AfterValidator(_env_name)]
ServerName = Annotated[str, AfterValidator(_server_name)]


class _ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    #: Only for a trusted server do its `readOnlyHint` annotations make tools gate as reads.
    trusted: bool = False
    #: "auto" negotiates the newest protocol era; "legacy" forces the 2025-11-25 handshake.
    protocol: Literal["auto", "legacy"] = "auto"
    connect_timeout: float = Field(default=30, gt=0, le=600)
    call_timeout: float = Field(default=120, gt=0, le=3600)


# ── Secrets in arguments ──

#: `${NAME}` in an argument is replaced by that agent-mcp variable (`.env` or environment) at start.
ARG_REFERENCE = re.compile(r"\$\{([^}]*)\}")
#: A flag (or NAME=) whose last word says its value is a secret: --api-key, --github-token, PASSWORD=.
_SECRET_NAME = re.compile(r"(?:^|[-_.])(?:api[-_]?key|access[-_]?key|private[-_]?key|key|secret|token|password|"
                          r"passwd|pwd|credentials?|bearer|authorization)$", re.IGNORECASE)
#: Prefixes of well-known credentials (OpenAI, Anthropic, Stripe, Slack, GitHub, GitLab, AWS, Google, Tavily,
#: xAI, Hugging Face, npm, PyPI, DigitalOcean, SendGrid) and JWTs.
_KNOWN_SECRET = re.compile(
    r"(?<![A-Za-z0-9])(?:sk-[A-Za-z0-9_-]{16,}|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{10,}|xox[abposr]-[A-Za-z0-9-]{10,}|"
    r"xapp-[A-Za-z0-9-]{10,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{16,}|"
    r"(?:AKIA|ASIA)[0-9A-Z]{16}|AIza[0-9A-Za-z_-]{30,}|ya29\.[0-9A-Za-z_-]{20,}|tvly-[A-Za-z0-9_-]{16,}|"
    r"xai-[A-Za-z0-9_-]{20,}|hf_[A-Za-z0-9]{20,}|npm_[A-Za-z0-9]{30,}|pypi-[A-Za-z0-9_-]{30,}|"
    r"dop_v1_[a-f0-9]{30,}|SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}|eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,})"
)
#: A run of 32 or more letters, digits, + and = with no separator in it (hex and base64 keys, not words).
_PIECES = re.compile(r"[A-Za-z0-9+=]{32,}")


def _entropy(text: str) -> float:
    counts = [text.count(c) for c in set(text)]
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts)


def _secret_value(value: str) -> str | None:
    """Why a literal text looks like a credential, or None."""
    if match := _KNOWN_SECRET.search(value):
        return f"it has the form of a known kind of key or token ({len(match.group())} characters)"
    for piece in _PIECES.findall(value):
        if sum(c.isdigit() for c in piece) >= 2 and sum(c.isalpha() for c in piece) >= 2 and _entropy(piece) >= 3.5:
            return f"it holds a long random-looking string ({len(piece)} characters)"
    return None


def _suggested_variable(server: str, flag: str) -> str:
    words = re.sub(r"[^A-Za-z0-9]+", "_", flag).strip("_").upper() or "SECRET"
    return words if not server or words.startswith(server.upper()) else f"{server.upper()}_{words}"


def _fix(why: str, var: str, shown: str) -> str:
    return (f"looks like a secret ({why}); secrets do not belong in mcp-servers.json: put it in .env as "
            f"{var}=… and write \"{shown}\" in args, or pass it in \"env\" if the server reads a variable "
            "(an argument is visible to every local user in ps)")


def _secret_flag(flag: str) -> bool:
    return bool(flag) and bool(_SECRET_NAME.search(flag))


def _plain_value(value: str) -> bool:
    """A literal value (not a reference, not a path to a key file, not another flag)."""
    return bool(value) and not ARG_REFERENCE.search(value) and not value.startswith(("-", "/", "./", "../", "~"))


def _findings(server: str, args: list[str]) -> list[tuple[int, bool, str]]:
    """(index, whether only the part after `=` is the secret, message) for each secret-looking argument."""
    found: list[tuple[int, bool, str]] = []
    after_flag: set[int] = set()
    for i, arg in enumerate(args):
        if i in after_flag:
            continue
        name, eq, value = arg.partition("=")
        flag = name.lstrip("-")
        if eq and _secret_flag(flag) and _plain_value(value):
            var = _suggested_variable(server, flag)
            found.append((i, True, _fix(f"a literal value for {name}", var, f"{name}=${{{var}}}")))
        elif not eq and name.startswith("-") and _secret_flag(flag) and i + 1 < len(args) \
                and _plain_value(args[i + 1]):
            var = _suggested_variable(server, flag)
            found.append((i + 1, False, _fix(f"a literal value after {name}", var, f"${{{var}}}")))
            after_flag.add(i + 1)
        elif reason := _secret_value(ARG_REFERENCE.sub("", arg)):
            var = f"{server.upper()}_SECRET"
            found.append((i, False, _fix(reason, var, f"${{{var}}}")))
    return found


def secret_arguments(server: str, args: list[str]) -> list[tuple[int, str]]:
    """(index, message with the fix) for every argument holding a literal that looks like a secret.

    The messages never contain the value; a `${NAME}` reference is not a literal and never counts.
    """
    return [(i, message) for i, _, message in _findings(server, args)]


def shown_arguments(args: list[str]) -> list[str]:
    """The arguments as `!mcp` and the log show them: `${NAME}` as written, secret-looking literals masked."""
    shown = list(args)
    for i, after_equals, _ in _findings("", args):
        shown[i] = f"{args[i].partition('=')[0]}=***" if after_equals else "***"
    return shown


class MissingVariable(Exception):
    """An argument names a variable that is not set; `.name` is its name."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def expand_arguments(args: list[str], env: dict[str, str]) -> list[str]:
    """The arguments with every `${NAME}` replaced by its value; MissingVariable when one is unset or empty."""
    def value(match: re.Match[str]) -> str:
        if not env.get(match.group(1)):
            raise MissingVariable(match.group(1))
        return env[match.group(1)]

    return [ARG_REFERENCE.sub(value, arg) for arg in args]


# ── Fences of stdio servers ──

#: Paths of this user's credentials that no sandboxed server sees (besides the agent's own dirs).
DEFAULT_HIDDEN = ["~/.ssh", "~/.gnupg", "~/.aws", "~/.azure", "~/.config/gcloud", "~/.kube", "~/.docker",
                  "~/.netrc", "~/.git-credentials", "~/.pgpass", "~/.my.cnf", "~/.npmrc", "~/.pypirc"]


class Limits(BaseModel):
    """Resource limits of a stdio server's processes (setrlimit, soft = hard); null lifts one."""

    model_config = ConfigDict(extra="forbid")

    #: Writable private memory per process (RLIMIT_DATA: heap and anonymous mappings), in MiB.
    memory_mb: int | None = Field(default=1024, ge=16)
    #: CPU time over the process's life (RLIMIT_CPU), in seconds: SIGXCPU, then the server is restarted.
    cpu_seconds: int | None = Field(default=3600, ge=1)
    #: Processes and threads of the user the server runs as (RLIMIT_NPROC; the kernel exempts root).
    processes: int | None = Field(default=256, ge=1)
    #: Open files per process (RLIMIT_NOFILE).
    open_files: int | None = Field(default=1024, ge=16)
    #: Largest file a process may write (RLIMIT_FSIZE), in MiB.
    file_size_mb: int | None = Field(default=1024, ge=1)


Sandbox = Literal["auto", "required", "off"]
#: "none": a network namespace of its own (only its own loopback); "host": the host's network.
Network = Literal["none", "host"]


class StdioDefaults(BaseModel):
    """`stdio` in mcp-servers.json: the fence every stdio server gets unless its entry says otherwise."""

    model_config = ConfigDict(extra="forbid")

    limits: Limits = Limits()
    #: "auto": in a bubblewrap sandbox where bwrap works, else unsandboxed (said at start);
    #: "required": a server does not start without the sandbox; "off": never sandboxed.
    sandbox: Sandbox = "auto"
    network: Network = "none"
    #: Paths no sandboxed server sees (`~` is this user's home), on top of the config and data dirs and `.env`.
    hidden: list[str] = DEFAULT_HIDDEN


class StdioServer(_ServerConfig):
    """A server started as a child process, speaking MCP over its stdin/stdout."""

    command: str = Field(min_length=1)
    #: Arguments; `${NAME}` takes a value from agent-mcp's environment (`.env`) at start.
    args: list[str] = []
    #: Variables passed to the child, as names (same name) or child name → agent-mcp variable.
    #: Nothing else of agent-mcp's environment is passed (the child gets PATH, HOME and LANG besides).
    env: dict[EnvName, EnvName] = {}
    #: Working directory (writable in the sandbox, beside its own `<data dir>/mcp/<server>`); relative to
    #: the config directory. Default: the config directory unsandboxed, its own dir sandboxed.
    cwd: str | None = None
    #: Overrides of `stdio.limits` for this server, field by field.
    limits: Limits | None = None
    sandbox: Sandbox | None = None
    network: Network | None = None
    #: Replaces `stdio.hidden` for this server (e.g. [] for one that needs ~/.aws).
    hidden: list[str] | None = None

    @field_validator("env", mode="before")
    @classmethod
    def _names_to_mapping(cls, v: Any) -> Any:
        return {n: n for n in v} if isinstance(v, list) and all(isinstance(n, str) for n in v) else v

    @field_validator("args")
    @classmethod
    def _references_are_names(cls, v: list[str]) -> list[str]:
        for arg in v:
            for name in ARG_REFERENCE.findall(arg):
                _env_name(name)
        return v


class HttpServer(_ServerConfig):
    """A server reached over Streamable HTTP."""

    url: str
    #: Literal headers (nothing secret: the file is not a secret store).
    headers: dict[str, str] = {}
    #: Header name → environment variable holding its value.
    headers_env: dict[str, EnvName] = {}
    #: Environment variable holding a bearer token, sent as `Authorization: Bearer <token>`.
    token_env: EnvName | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL, e.g. http://127.0.0.1:8000/mcp")
        return v


def _server_kind(value: Any) -> str | None:
    if isinstance(value, BaseModel):
        return "stdio" if isinstance(value, StdioServer) else "http"
    if not isinstance(value, dict) or ("command" in value) == ("url" in value):
        return None
    return "stdio" if "command" in value else "http"


ServerConfig = Annotated[
    Annotated[StdioServer, Tag("stdio")] | Annotated[HttpServer, Tag("http")],
    Discriminator(
        _server_kind,
        custom_error_type="server_kind",
        custom_error_message="a server needs exactly one of 'command' (stdio) and 'url' (Streamable HTTP)",
    ),
]


class McpServersFile(BaseModel):
    """`mcp-servers.json`: the MCP servers whose tools agent-mcp uses, by name."""

    model_config = ConfigDict(extra="forbid")

    version: str = "1.0.0"
    #: The fence of every stdio server (limits, sandbox, network), unless its entry overrides it.
    stdio: StdioDefaults = StdioDefaults()
    servers: dict[ServerName, ServerConfig] = {}

    @model_validator(mode="after")
    def _no_secrets_and_defaults_filled(self) -> McpServersFile:
        problems = []
        for name, spec in self.servers.items():
            if not isinstance(spec, StdioServer):
                continue
            problems += [f"servers.{name}.args.{i}: {why}" for i, why in secret_arguments(name, spec.args)]
            own = spec.limits.model_dump(exclude_unset=True) if spec.limits else {}
            spec.limits = self.stdio.limits.model_copy(update=own)
            spec.sandbox = spec.sandbox or self.stdio.sandbox
            spec.network = spec.network or self.stdio.network
            spec.hidden = self.stdio.hidden if spec.hidden is None else spec.hidden
        if problems:
            raise PydanticCustomError("secret_arguments", "{problems}", {"problems": "\n".join(problems)})
        return self


def load_servers(path: Path) -> McpServersFile:
    """Read and validate `mcp-servers.json`; a ConfigError names the file and each bad field."""
    data = read_json(path)
    try:
        return McpServersFile.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            # Drop the union tags pydantic puts in the location; users know fields, not tags.
            where = ".".join(str(p) for p in err["loc"] if p not in ("stdio", "http")) or "(top level)"
            lines.append(f"  field '{where}': {err['msg']}")
        raise ConfigError(f"{path}: invalid configuration\n" + "\n".join(lines)) from None


# ── Tool schemas and results ────────────────────────────────────────────────────────────────


class McpTool(StructuredTool):
    """A StructuredTool that shows models the MCP server's own input schema, unchanged."""

    mcp_schema: dict[str, Any]

    @property
    def tool_call_schema(self) -> dict[str, Any]:
        return {**copy.deepcopy(self.mcp_schema), "description": self.description}


def _llm_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The input schema as sent to models: an object schema with `properties`, no `$schema`."""
    out = {k: copy.deepcopy(v) for k, v in schema.items() if k != "$schema"}
    out["type"] = "object"
    out.setdefault("properties", {})
    return out


def _args_model(exposed: str, schema: dict[str, Any]) -> type[BaseModel]:
    """A pydantic model that validates arguments against the server's JSON schema and keeps them all."""
    import jsonschema

    llm_schema = _llm_schema(schema)
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        validator: jsonschema.protocols.Validator | None = cls(schema)
    except jsonschema.SchemaError as exc:
        # The server checks its own arguments anyway; a broken schema must not hide the tool.
        logger.warning("tool %s: input schema is not valid JSON Schema (%s); arguments are not checked", exposed,
                       exc.message)
        validator = None

    class Arguments(BaseModel):
        model_config = ConfigDict(extra="allow", title=f"{exposed}_arguments")

        @model_validator(mode="before")
        @classmethod
        def _match_schema(cls, data: Any) -> Any:
            if validator is not None:
                problems = [
                    f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}"
                    for e in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
                ]
                if problems:
                    raise PydanticCustomError("mcp_arguments", "{problems}", {"problems": "; ".join(problems)})
            return data

        @classmethod
        def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return copy.deepcopy(llm_schema)

    Arguments.__name__ = Arguments.__qualname__ = f"{exposed}_arguments"
    return Arguments


def exposed_name(server: str, tool: str) -> str:
    """`<server>_<tool>` as a valid identifier of at most 64 characters."""
    name = re.sub(r"\W", "_", f"{server}_{tool}", flags=re.ASCII)
    if len(name) > MAX_TOOL_NAME:
        digest = hashlib.sha1(name.encode()).hexdigest()[:6]
        name = f"{name[:MAX_TOOL_NAME - 7]}_{digest}"
    return name


def _echoes(text: str, structured: dict[str, Any]) -> bool:
    """Whether a text block already carries the structured content (SDKs send both)."""
    candidates: list[Any] = [structured]
    if list(structured) == ["result"]:  # non-object results are wrapped as {"result": …}
        candidates.append(structured["result"])
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    return value in candidates or text in candidates


def _block_text(block: Any) -> str:
    import mcp_types as types

    if isinstance(block, types.TextContent):
        return block.text
    if isinstance(block, types.ImageContent | types.AudioContent):
        kind = "image" if isinstance(block, types.ImageContent) else "audio"
        return f"[{kind} {block.mime_type}, {len(block.data) * 3 // 4} bytes]"
    if isinstance(block, types.ResourceLink):
        return f"[resource link: {block.name} {block.uri}]" + (f" {block.description}" if block.description else "")
    if isinstance(block, types.EmbeddedResource):
        res = block.resource
        if isinstance(res, types.TextResourceContents):
            return f"[resource {res.uri}]\n{res.text}"
        return f"[resource {res.uri} {res.mime_type or ''}, {len(getattr(res, 'blob', '')) * 3 // 4} bytes]"
    return json.dumps(block.model_dump(mode="json", exclude_none=True), ensure_ascii=False)


def format_result(exposed: str, result: types.CallToolResult) -> str:
    """A tool result as text for the model: text blocks, structured JSON; ToolError when `isError`."""
    texts = [t for t in map(_block_text, result.content) if t]
    structured = result.structured_content
    if structured is not None and not any(_echoes(t, structured) for t in texts):
        texts.append(json.dumps(structured, ensure_ascii=False))
    body = "\n".join(texts) or "(no output)"
    if result.is_error:
        raise ToolError(f"{exposed} reported an error: {body}")
    return body
