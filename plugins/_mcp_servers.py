"""mcp-servers.json and the MCP tools it yields: server settings, tool schemas for the model, results as text."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
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


class StdioServer(_ServerConfig):
    """A server started as a child process, speaking MCP over its stdin/stdout."""

    command: str = Field(min_length=1)
    args: list[str] = []
    #: Variables passed to the child, as names (same name) or child name → agent-mcp variable.
    #: Nothing else of agent-mcp's environment is passed (the SDK adds HOME, PATH, SHELL, …).
    env: dict[EnvName, EnvName] = {}
    #: Working directory; relative paths are relative to the config directory (the default).
    cwd: str | None = None

    @field_validator("env", mode="before")
    @classmethod
    def _names_to_mapping(cls, v: Any) -> Any:
        return {n: n for n in v} if isinstance(v, list) and all(isinstance(n, str) for n in v) else v


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
    servers: dict[ServerName, ServerConfig] = {}


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
    def tool_call_schema(self) -> dict[str, Any]:  # type: ignore[override]
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
