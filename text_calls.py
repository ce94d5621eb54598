"""Tool calls that local models write as text: finding them, hiding them while they stream, describing tools.

Local models often write their tool calls as text instead of using the tool-calling API. Only
explicit call syntax is recognised (tags, fenced blocks, a reply that starts with JSON calls), only
names of tools bound for the turn run, and prose is never taken for a call. Explicit call syntax
that cannot be used (an unknown tool, arguments that are not a JSON object, JSON that does not
parse) is reported as a problem, so the loop can tell the model once how to write the call.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from langchain_core.tools import StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel

_OPENERS = ("<tool_call>", "<tool_code>", "<tools>", "<function=", "<|python_tag|>", "```json", "```tool", "```\n")
_OPENER_STARTS = frozenset(o[:i] for o in _OPENERS for i in range(1, len(o)))
_LONGEST_OPENER = max(map(len, _OPENERS))
_BLOCKS = re.compile(
    r"<tool_call>(?P<tool_call>.*?)(?:</tool_call>|\Z)"
    r"|<tools>(?P<tools>.*?)(?:</tools>|\Z)"  # Qwen's template lists tools in this tag: a small model echoes it
    r"|<tool_code>(?P<tool_code>.*?)(?:</tool_code>|\Z)"
    r"|(?P<function><function=[^>\s]+>.*?(?:</function>|\Z))"
    r"|```(?P<lang>[\w-]*)[ \t]*\n(?P<fenced>.*?)(?:```|\Z)",
    re.DOTALL,
)
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_ARG_KEYS = ("arguments", "parameters", "input", "args")
_PY_CALL_LANGS = ("tool_code", "tool_call", "tool")
PYTHON_TAG = "<|python_tag|>"


def _json_values(body: str) -> list[Any] | None:
    """Every JSON value in `body` (one after another, whitespace between), or None if anything else is there.

    Retried with `{{`/`}}` collapsed, an artefact of some chat templates.
    """
    for candidate in (body, body.replace("{{", "{").replace("}}", "}")):
        decoder, values, pos, text = json.JSONDecoder(), [], 0, candidate.strip()
        try:
            while pos < len(text):
                value, pos = decoder.raw_decode(text, pos)
                values.append(value)
                while pos < len(text) and text[pos] in " \t\r\n,;":
                    pos += 1
        except ValueError:
            continue
        if values:
            return values
    return None


def _python_calls(body: str) -> list[tuple[str, dict[str, Any]]] | None:
    """Gemma-style `name(key=value)` calls (literal keyword arguments only), or None if not exactly that."""
    try:
        tree = ast.parse(body.strip())
    except SyntaxError:
        return None
    calls = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            return None
        items = stmt.value.elts if isinstance(stmt.value, ast.List | ast.Tuple) else [stmt.value]
        for item in items:
            if isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and item.func.id == "print" \
                    and len(item.args) == 1:
                item = item.args[0]
            if not isinstance(item, ast.Call) or item.args or any(k.arg is None for k in item.keywords):
                return None
            func = item.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name is None:
                return None
            try:
                calls.append((name, {str(k.arg): ast.literal_eval(k.value) for k in item.keywords}))
            except (ValueError, SyntaxError):
                return None
    return calls or None


def _function_calls(body: str) -> list[tuple[str, dict[str, Any], bool]]:
    """`<function=name>` calls: XML `<parameter=…>` values (strings, typed later) or a JSON body."""
    calls = []
    for name, inner in _FUNCTION.findall(body):
        params = _PARAMETER.findall(inner)
        if params:
            calls.append((name, dict(params), True))
        elif not inner.strip():
            calls.append((name, {}, False))
        else:
            values = _json_values(inner)
            if values and len(values) == 1 and isinstance(values[0], dict):
                calls.append((name, values[0], False))
    return calls


def _typed_xml_args(tool: StructuredTool, args: dict[str, str]) -> dict[str, Any]:
    """XML parameter values are text: decode JSON for the parameters whose schema is not a string."""
    schema = tool.args_schema  # a pydantic model for every registered tool (registry._check_tool)
    props = (schema.model_json_schema().get("properties", {})
             if isinstance(schema, type) and issubclass(schema, BaseModel) else {})
    typed: dict[str, Any] = {}
    for key, value in args.items():
        kinds = {props.get(key, {}).get("type")} | {a.get("type") for a in props.get(key, {}).get("anyOf", [])}
        if "string" in kinds or not kinds - {None}:
            typed[key] = value
            continue
        try:
            typed[key] = json.loads(value)
        except ValueError:
            typed[key] = value
    return typed


@dataclass
class TextCalls:
    """What a reply holds in text call syntax: the calls to run, where they stand, and what could not be used."""

    #: Calls of known tools with object arguments, duplicates dropped: {"id", "name", "args"}.
    calls: list[dict[str, Any]] = field(default_factory=list)
    #: Where in the reply the usable calls stand (hidden from the user).
    spans: list[tuple[int, int]] = field(default_factory=list)
    #: Explicit call syntax that could not be used (unknown tool, arguments not an object, unreadable JSON).
    problems: list[str] = field(default_factory=list)
    #: Where those unusable calls stand.
    bad_spans: list[tuple[int, int]] = field(default_factory=list)


_ATTEMPT = re.compile(r"\s*(?:[{\[]|[A-Za-z_][\w.]*\s*\()")
_Found = tuple[list[tuple[str, dict[str, Any], bool]], list[str]]


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 80 else text[:79] + "…"


def _json_call(obj: Any) -> tuple[str | None, Any, bool] | None:
    """(name, raw arguments, explicit) of one JSON value shaped like a call, else None. `explicit`: it says
    so itself (an arguments key, `tool_name`, or the OpenAI `function` wrapper), not only a `name`."""
    if not isinstance(obj, dict):
        return None
    explicit = isinstance(obj.get("function"), dict) or "tool_name" in obj
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {"name", "arguments"}}
        obj = obj["function"]
    explicit = explicit or any(k in obj for k in _ARG_KEYS)
    name = obj.get("name", obj.get("tool_name"))
    if not isinstance(name, str) and not explicit:
        return None
    return (name if isinstance(name, str) else None), next((obj[k] for k in _ARG_KEYS if k in obj), {}), explicit


def _json_calls(values: list[Any], tools: dict[str, StructuredTool], tagged: bool) -> _Found | None:
    """Calls and problems of JSON values, or None when they are not calls at all (ordinary JSON).

    Untagged JSON (a ```json block, a reply that starts with JSON) counts only when a value names a
    bound tool or says explicitly that it is a call; one value that is no call spoils the block."""
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    shaped = [_json_call(v) for v in flat]
    usable = [s for s in shaped if s is not None]
    if not tagged and not any(s[2] or s[0] in tools for s in usable):
        owner = _arguments_of(flat, tools)
        if owner:  # a small model wrote only the arguments: `{"section": "backups"}`
            return [], [f"arguments without a tool name (a call of {owner}?): {_snippet(json.dumps(flat[0]))}"]
        return None
    if len(usable) < len(shaped) or not shaped:
        return [], [f"not a call: {_snippet(json.dumps(flat, ensure_ascii=False))}"]
    found: list[tuple[str, dict[str, Any], bool]] = []
    problems: list[str] = []
    for name, args, _ in usable:
        if name is None:
            owner = _arguments_of([args], tools)
            problems.append(f"a call without a tool name (of {owner}? write its name)" if owner
                            else "a call without a tool name")
            continue
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                problems.append(f"the arguments of {name} are not valid JSON")
                continue
        if not isinstance(args, dict):
            problems.append(f"the arguments of {name} must be a JSON object, not {type(args).__name__}")
        elif name not in tools:
            problems.append(f"unknown tool '{name}'")
        else:
            found.append((name, _unwrap_schema(args, tools[name]), False))
    return found, problems


def _arguments_of(flat: list[Any], tools: dict[str, StructuredTool]) -> str | None:
    """The one bound tool that has a parameter for every key of a lone JSON object, if exactly one has."""
    if len(flat) != 1 or not isinstance(flat[0], dict) or not flat[0]:
        return None
    owners = [name for name, tool in tools.items()
              if set(flat[0]) <= set(convert_to_openai_tool(tool)["function"].get("parameters", {})
                                     .get("properties", {}))]
    return owners[0] if len(owners) == 1 else None


_SCHEMA_KEYS = frozenset({"properties", "type", "required"})


def _unwrap_schema(args: dict[str, Any], tool: StructuredTool) -> dict[str, Any]:
    """Small models copy the JSON schema they were shown into a call: `{"properties": {"city": "Paris"},
    "type": "object"}`. Such arguments are unwrapped to `{"city": "Paris"}` (to `{}` when "properties"
    holds schemas), unless the tool really has parameters named like schema keys."""
    if not args or not set(args) <= _SCHEMA_KEYS or not isinstance(args.get("properties", {}), dict):
        return args
    params = convert_to_openai_tool(tool)["function"].get("parameters", {}).get("properties", {})
    if set(args) & set(params):
        return args
    inner = args.get("properties", {})
    return {k: v for k, v in inner.items() if not (isinstance(v, dict) and "type" in v)}


def _block_calls(match: re.Match[str], tools: dict[str, StructuredTool]) -> _Found | None:
    """Calls and problems of one tagged or fenced block; None when the block is not a call at all."""
    body = next(g for g in (match["tool_call"], match["tools"], match["tool_code"], match["function"],
                            match["fenced"]) if g is not None)
    lang = (match["lang"] or "").lower()
    tagged = match["fenced"] is None or lang in _PY_CALL_LANGS
    if "<function=" in body:
        calls = _function_calls(body)
        unknown = [f"unknown tool '{n}'" for n, _, _ in calls if n not in tools]
        return [c for c in calls if c[0] in tools], unknown or ([] if calls else [f"unreadable call: {_snippet(body)}"])
    values = _json_values(body.strip().removeprefix(PYTHON_TAG))
    if values is not None:
        return _json_calls(values, tools, tagged)
    if match["tool_code"] is not None or lang in _PY_CALL_LANGS:
        python = _python_calls(body)
        if python is not None:
            return ([(n, a, False) for n, a in python if n in tools],
                    [f"unknown tool '{n}'" for n, _ in python if n not in tools])
    looks_like_json_call = re.search(r'"(?:tool_)?name"\s*:', body) is not None
    if (tagged and _ATTEMPT.match(body)) or looks_like_json_call:
        return [], [f"a call that could not be read (write the arguments as one JSON object): {_snippet(body)}"]
    return None


def _leading_json(text: str) -> tuple[list[Any], int]:
    """The JSON values a reply starts with (one after another) and where they end; prose may follow.

    A reply that is all JSON with `{{`/`}}` doubled (a chat-template artefact) is read collapsed."""
    values, end = _leading_values(text)
    if not values and text.startswith("{{"):
        collapsed = text.rstrip().replace("{{", "{").replace("}}", "}")
        values, end = _leading_values(collapsed)
        if end < len(collapsed):  # prose after it: positions in the collapsed text say nothing here
            return [], 0
        end = len(text.rstrip())
    return values, end


def _leading_values(text: str) -> tuple[list[Any], int]:
    decoder, values, pos, end = json.JSONDecoder(), [], 0, 0
    while pos < len(text) and text[pos] in "{[":
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            break
        values.append(value)
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
    return values, end


def find_text_calls(text: str, tools: dict[str, StructuredTool]) -> TextCalls:
    """Tool calls written as text, validated against `tools` (see TextCalls).

    Recognised: `<tool_call>{json}</tool_call>` (Qwen, Hermes), `<tool_code>{"tool_name",
    "arguments"}</tool_code>` (seed 004) or Gemma's `name(key=value)`, `<function=name>` with
    `<parameter=…>` XML or a JSON body, fenced blocks (```json, ```tool_call, ```tool_code, plain
    ```), and a reply that starts with JSON calls (Llama's `{"name", "parameters"}`, optionally
    after `<|python_tag|>`), prose after them allowed. Several calls in one reply all count.
    JSON inside prose, ordinary JSON and ordinary code are never calls.
    """
    found: list[tuple[str, dict[str, Any], bool]] = []
    out = TextCalls()
    for match in _BLOCKS.finditer(text):
        block = _block_calls(match, tools)
        if block is None:
            continue
        found += block[0]
        out.problems += block[1]
        (out.spans if block[0] else out.bad_spans).append(match.span())
    if not found and not out.problems:
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        if body.startswith(PYTHON_TAG):
            lead += len(PYTHON_TAG) + len(body[len(PYTHON_TAG):]) - len(body[len(PYTHON_TAG):].lstrip())
        values, end = _leading_json(text[lead:])
        block = _json_calls(values, tools, tagged=False) if values else None
        if block is None and not values and re.match(r'\{\s*"(?:tool_)?name"\s*:', text[lead:]) \
                and any(f'"{k}"' in text for k in _ARG_KEYS):
            block = [], [f"a call that could not be read (not valid JSON): {_snippet(text[lead:])}"]
            end = len(text) - lead
        if block is not None:
            found, out.problems = block
            (out.spans if found else out.bad_spans).append((0, lead + end))
    seen = set()
    for name, args, xml in found:
        tool = tools[name]
        if xml:
            args = _typed_xml_args(tool, args)
        signature = call_signature(name, args)
        if signature not in seen:
            seen.add(signature)
            out.calls.append({"id": f"text-{uuid.uuid4().hex[:8]}", "name": name, "args": args})
    return out


def try_force_tool_calls(
    text: str, tools: dict[str, StructuredTool]
) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """The usable tool calls written as text in `text` and the spans they came from (find_text_calls)."""
    found = find_text_calls(text, tools)
    return found.calls, found.spans


def call_signature(name: str, args: dict[str, Any]) -> str:
    """Identity of a call: the same tool with the same arguments gives the same signature."""
    return name + json.dumps(args, sort_keys=True, ensure_ascii=False, default=str)


def call_shape(text_mode: bool) -> str:
    """How a call is written, as the corrective message and the text-mode prompt show it."""
    if text_mode:
        return '<tool_code>{"tool_name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_code>'
    return '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>'


def tool_signatures(tools: list[StructuredTool]) -> str:
    """One line per tool: its name and argument names with their types, e.g. `- read_file(path: string)`."""
    lines = []
    for tool in tools:
        props = convert_to_openai_tool(tool)["function"].get("parameters", {}).get("properties", {})
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
        lines.append(f"- {tool.name}({args})")
    return "\n".join(lines)


_ASKS_TO_CALL = re.compile(r"\b(?:call|calling|use|using|run|invoke)\s", re.I)


def described_tool(text: str, tools: dict[str, StructuredTool]) -> str | None:
    """The tool a reply tells the user to call instead of calling it ("you can use the `llm_list` function"),
    if any: a bound tool's name right after call/use/run/invoke. Small models answer so when asked to call."""
    if not _ASKS_TO_CALL.search(text):  # most replies: no pattern per tool to try
        return None
    for name in tools:
        if re.search(rf"\b(?:call|calling|use|using|run|invoke)\s+(?:the\s+)?[`'\"]?{re.escape(name)}\b", text, re.I):
            return name
    return None


def likely_call(text: str, tools: dict[str, StructuredTool]) -> tuple[str, dict[str, Any]] | None:
    """(tool, arguments) that a call written without its tool name most likely meant: the first JSON object of
    the reply (in a block or bare) whose arguments fit exactly one bound tool."""
    bodies = [m["tool_call"] or m["tools"] or m["tool_code"] or m["fenced"] or "" for m in _BLOCKS.finditer(text)]
    for body in [*bodies, text]:
        for value in _json_values(body.strip()) or []:
            args = value.get("arguments", value) if isinstance(value, dict) else None
            if isinstance(args, dict) and (owner := _arguments_of([args], tools)):
                return owner, args
    return None


def _example(tool: StructuredTool, args: dict[str, Any] | None, text_mode: bool) -> str:
    """The exact call of `tool` (its arguments as placeholders of their type when none are given)."""
    if args is None:
        props = convert_to_openai_tool(tool)["function"].get("parameters", {}).get("properties", {})
        args = {k: f"<{v.get('type', 'value')}>" for k, v in props.items()}
    body = json.dumps({"tool_name" if text_mode else "name": tool.name, "arguments": args}, ensure_ascii=False)
    return f"<tool_code>{body}</tool_code>" if text_mode else f"<tool_call>{body}</tool_call>"


def correction(problems: list[str], tools: list[StructuredTool], text_mode: bool,
               meant: tuple[str, dict[str, Any] | None] | None = None, insist: bool = False) -> str:
    """The one message that tells a model why its text call was not run and how to write one; with `meant`
    (the tool it most likely wanted, and its arguments if known), that call written out exactly. `insist`:
    the model named the tool instead of calling it, so it is told to call it now (no way out in prose, which
    small models take)."""
    tool = next((t for t in tools if meant and t.name == meant[0]), None)
    how = (f"To call {tool.name}, write exactly:\n{_example(tool, meant[1] if meant else None, text_mode)}"
           if tool is not None else f"To call one, write exactly:\n{call_shape(text_mode)}")
    end = ("Reply now with only that call; its result comes back to you." if insist and tool is not None
           else "Or, if no tool is needed, answer the user directly.")
    return ("[Tool call error]: not run: " + "; ".join(dict.fromkeys(problems)) + ".\n"
            f"The tools you can call:\n{tool_signatures(tools)}\n{how}\n{end}")

class TextCallFilter:
    """Holds streamed text back from the first sign of a text tool call until the reply is complete.

    Text before a call streams as usual; call syntax is never shown; if the held text turns out
    not to be a call, it is sent whole at the end.
    """

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.pending = ""  # received, not shown yet (a possible opener, or leading whitespace)
        self.sent = 0  # characters shown so far
        self.holding = False

    def feed(self, chunk: str) -> str:
        """Add streamed text; return what can be shown now."""
        self.chunks.append(chunk)
        if self.holding:
            return ""
        body = self.pending + chunk
        if self.sent == 0:
            lead = body.lstrip()
            if not lead or lead[0] in "{[":  # whitespace so far, or a reply that may be all JSON
                self.pending, self.holding = body, bool(lead)
                return ""
        # Every opener starts with < or `: most chunks have neither, and need no search for eight openers.
        hits = [i for i in (body.find(o) for o in _OPENERS) if i >= 0] if "<" in body or "`" in body else ()
        if hits:
            self.holding = True
            cut = min(hits)
        else:  # keep back a tail that may be the start of an opener split across chunks
            tail = body[-_LONGEST_OPENER:]
            keep = 0 if "<" not in tail and "`" not in tail else next(
                (k for k in range(min(len(body), _LONGEST_OPENER), 0, -1) if body[-k:] in _OPENER_STARTS), 0)
            cut = len(body) - keep
        self.sent += cut
        self.pending = body[cut:]
        return body[:cut]

    def finish(self, spans: list[tuple[int, int]]) -> str:
        """The rest of the reply to show, without the spans that were tool calls."""
        text = "".join(self.chunks)
        out, pos = [], self.sent
        for start, end in sorted(spans):
            if end <= pos:
                continue
            out.append(text[pos:max(pos, start)])
            pos = max(pos, end)
        out.append(text[pos:])
        self.sent, self.pending = len(text), ""
        rest = "".join(out)
        return rest.strip() if spans else rest


TEXT_TOOLS_PROMPT = """\
## Tools
You can call these tools. To call one, reply with this block (one block per call):
{shape}
The result comes back in the next message; then answer the user from it, or call another tool.
Never call a tool again with the same arguments. Answer without a block when no tool is needed.

{manifest}"""


def tool_manifest(tools: list[StructuredTool]) -> str:
    """The system-prompt part that describes tools to a model in `text` tool mode (seed 004).

    Arguments are shown the way a call writes them (`{"city": "<string>"}`), not as a JSON schema:
    small models copy a schema into their calls."""
    entries = []
    for tool in tools:
        params = convert_to_openai_tool(tool)["function"].get("parameters", {})
        props, required = params.get("properties", {}), set(params.get("required", []))
        shape = ", ".join(f'"{k}": <{v.get("type", "value")}>' for k, v in props.items())
        notes = "".join(f"\n    {k}{'' if k in required else ' (optional)'}: {v['description']}"
                        for k, v in props.items() if v.get("description"))
        entries.append(f"- {tool.name}: {tool.description}\n  arguments: {{{shape}}}{notes}")
    return TEXT_TOOLS_PROMPT.format(shape=call_shape(True), manifest="\n".join(entries))


def without_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` without the character ranges `spans` (overlapping ones too): a reply with its calls taken out."""
    out, pos = [], 0
    for start, end in sorted(spans):
        out.append(text[pos:max(pos, start)])
        pos = max(pos, end)
    return "".join(out) + text[pos:]
