"""agentctl's model commands: the models of `llm-models.json`, each field of one, and the default model of
`plugins-enabled.json`."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

from rich.markup import escape
from rich.table import Table

from agentctl_base import CommandBase
from agentctl_files import InputError, model_value
from agentctl_term import ArgParser
from config import ENABLED_FILE, MODELS_FILE, ModelConfig

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ModelCommands(CommandBase):
    """models, model, model-info, model-add, model-remove, model-enable, model-disable and the model-<field>
    setters."""

    def _model(self, name: str) -> str:
        if name not in self.files.models:
            raise self._unknown("model", name, list(self.files.models))
        return name

    def _model_setter(self, args: list[str], handler: Callable[..., Any], field: str) -> None:
        """`<command> <name> <value>`: one field of one model, checked by ModelConfig."""
        name, text = self._args(args, handler, 2)
        self._set_model_field(name, field, model_value(field, text))

    def _set_model_field(self, name: str, field: str, value: Any) -> None:
        raw = self.files.raw(MODELS_FILE)
        raw["models"][self._model(name)][field] = value
        self.files.save(MODELS_FILE, raw)
        self.term.done(f"{name}: {field} = {json.dumps(value)}")

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
            fields[field] = ask(question, functools.partial(model_value, field), str(default) if default != "" else "")
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
