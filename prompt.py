"""The system prompt: a recursive tree of section files in `.system_prompt/`.

The root file `.system_prompt/.system_prompt` holds the main paragraph, a `[SECTIONS]` line and
then `name: description` lines; each section `name` lives in `.system_prompt/.system_prompt_<name>`.
A section whose file has its own `[SECTIONS]` list is a container; every other section is a leaf
with an editable body. Circular references and names used twice are reported, never followed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from config import atomic_write

logger = logging.getLogger("agent_mcp.prompt")

PROMPT_DIR = ".system_prompt"
ROOT_FILE = ".system_prompt"
SECTION_PREFIX = ".system_prompt_"
MARKER = "[SECTIONS]"
OPERATIONS = ("append", "prepend", "replace", "delete", "overwrite")
DEFAULT_ROOT = (
    "You are agent-mcp, a careful assistant with tools. Use a tool when it helps; say what you did.\n"
    f"{MARKER}\n"
)


class PromptError(ValueError):
    """A section cannot be found or edited; the message says what to do instead."""


@dataclass
class Section:
    """One node of the tree, in depth-first order."""

    name: str
    description: str
    body: str
    depth: int
    parent: str | None
    is_container: bool = False
    error: str | None = None


def _parse_section_list(lines: list[str]) -> list[tuple[str, str]]:
    entries = []
    for line in lines:
        if ":" in line:
            name, desc = line.split(":", 1)
            if name.strip():
                entries.append((name.strip(), desc.strip()))
    return entries


def _split_marker(text: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(text before the marker, children) if `text` has a `[SECTIONS]` line, else None."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == MARKER:
            return "\n".join(lines[:i]).strip(), _parse_section_list(lines[i + 1 :])
    return None


_TOOL_LIST = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\s*,\s*[A-Za-z_][A-Za-z0-9_]*)*$")


def _documents_a_bound_tool(section: Section, tools: frozenset[str]) -> bool:
    """False only for a `tool-…` section describing tools (by name) of which none is bound."""
    if not section.name.startswith("tool-") or not _TOOL_LIST.match(section.description):
        return True
    return any(name.strip() in tools for name in section.description.split(","))


class PromptTree:
    """Loads, assembles, addresses and edits the section tree of one prompt directory."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.main = ""
        self.sections: list[Section] = []
        self.problems: list[str] = []
        self._assembled: dict[frozenset[str] | None, str] = {}

    def load(self) -> PromptTree:
        """(Re)read every file; problems are logged and kept in `problems`, never raised."""
        self.sections, self.problems, self._assembled = [], [], {}
        root = self.directory / ROOT_FILE
        if not root.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write(root, DEFAULT_ROOT)
        split = _split_marker(root.read_text(encoding="utf-8"))
        self.main, children = split if split else (root.read_text(encoding="utf-8").strip(), [])
        seen: set[str] = set()
        for name, desc in children:
            self._load_section(name, desc, 0, None, (), seen)
        for problem in self.problems:
            logger.warning("system prompt: %s", problem)
        return self

    def _load_section(
        self, name: str, desc: str, depth: int, parent: str | None, ancestors: tuple[str, ...], seen: set[str]
    ) -> None:
        def broken(msg: str) -> None:
            self.problems.append(msg)
            self.sections.append(Section(name, desc, f"[SECTION ERROR: {msg}]", depth, parent, error=msg))

        if name in ancestors:
            return broken(f"circular reference to '{name}' (via {' → '.join(ancestors)})")
        if name in seen:
            return broken(f"duplicate section name '{name}'")
        seen.add(name)
        path = self.directory / f"{SECTION_PREFIX}{name}"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            return broken(f"section '{name}' cannot be read from {path}: {exc.strerror}")
        if text.startswith("## "):
            text = text.split("\n", 1)[1] if "\n" in text else ""
        split = _split_marker(text)
        if split is None:
            self.sections.append(Section(name, desc, text.strip("\n"), depth, parent))
            return None
        self.sections.append(Section(name, desc, "", depth, parent, is_container=True))
        for child, child_desc in split[1]:
            self._load_section(child, child_desc, depth + 1, name, (*ancestors, name), seen)
        return None

    def assemble(self, tools: Iterable[str] | None = None) -> str:
        """The prompt sent to the model as its system message.

        With `tools` (the names bound for the turn), a `tool-…` section whose description is a list
        of tool names is left out when none of them is bound: the model reads only about tools it has.
        """
        key = None if tools is None else frozenset(tools)
        text = self._assembled.get(key)
        if text is None:
            parts = [self.main]
            for s in self.sections:
                if key is not None and not _documents_a_bound_tool(s, key):
                    continue
                part = f"\n{'#' * (2 + s.depth)} {s.name}: {s.description}"
                parts.append(part + (f"\n{s.body}" if s.body else ""))
            text = self._assembled[key] = "\n".join(parts).strip() + "\n"
        return text

    def find(self, ident: str | int) -> Section:
        """A section by index (as listed) or exact name."""
        text = str(ident).strip()
        if text.isdigit() and int(text) < len(self.sections):
            return self.sections[int(text)]
        for s in self.sections:
            if s.name == text:
                return s
        names = ", ".join(f"{i}:{s.name}" for i, s in enumerate(self.sections)) or "(none)"
        raise PromptError(f"Section '{text}' not found. Available sections: {names}")

    def render(self, ident: str | int) -> str:
        s = self.find(ident)
        if s.is_container:
            kids = [c.name for c in self.sections if c.parent == s.name]
            return f"{'#' * (2 + s.depth)} {s.name}: {s.description}\n(container of: {', '.join(kids)})"
        return f"{'#' * (2 + s.depth)} {s.name}: {s.description}\n{s.body}"

    def apply(
        self,
        ident: str | int,
        operation: str,
        content: str = "",
        target: str = "",
        confirm_overwrite: bool = False,
    ) -> str:
        """Edit one leaf section and rewrite its file; returns a one-line summary."""
        s = self.find(ident)
        if s.is_container:
            raise PromptError(
                f"Section '{s.name}' is a container (has sub-sections) and has no editable body. "
                "Edit its child sections instead."
            )
        if s.error:
            raise PromptError(f"Section '{s.name}' is broken ({s.error}); fix the files first")
        body = s.body
        if operation == "append":
            if not content:
                raise PromptError("append needs content")
            body = body + ("\n" if body.endswith("\n") else "\n\n") + content if body else content
        elif operation == "prepend":
            if not content:
                raise PromptError("prepend needs content")
            body = content + ("" if content.endswith("\n") else "\n\n") + body if body else content
        elif operation == "replace":
            if not target or target not in body:
                raise PromptError(f"replace needs a target that occurs in section '{s.name}'")
            body = body.replace(target, content, 1)
        elif operation == "delete":
            if not target:
                raise PromptError("delete needs a target: every line containing it is removed")
            kept = [line for line in body.split("\n") if target not in line]
            if len(kept) == len(body.split("\n")):
                raise PromptError(f"no line of section '{s.name}' contains {target!r}")
            body = "\n".join(kept)
        elif operation == "overwrite":
            if not confirm_overwrite:
                raise PromptError("overwrite replaces the whole section: repeat with confirm_overwrite=true")
            if not content:
                raise PromptError("overwrite needs content")
            body = content
        else:
            raise PromptError(f"unknown operation '{operation}'; valid: {', '.join(OPERATIONS)}")
        atomic_write(self.directory / f"{SECTION_PREFIX}{s.name}", f"## {s.name}: {s.description}\n{body}\n")
        s.body = body.strip("\n")
        self._assembled.clear()
        return f"Section '{s.name}' updated ({operation}); {len(s.body)} characters."
