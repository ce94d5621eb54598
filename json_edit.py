"""Writing a changed JSON document back in the layout it had: only what changed is rewritten.

agentctl edits hand-formatted files (one plugin per line, lists wrapped to the width). Dumping the
whole document again would turn a one-flag change into a diff of every line; `edit()` keeps the
original text of everything unchanged, and lays out a new member or value the way its neighbours are.
The result is always checked: it must parse to exactly the new document, else the plain dump is used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

WIDTH = 120
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


@dataclass
class _Node:
    """Where one value is in the text: [start, end); an object's members (key, where the key starts, value)
    and an array's items."""

    start: int
    end: int
    members: list[tuple[str, int, _Node]] = field(default_factory=list)
    items: list[_Node] = field(default_factory=list)


def _skip(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]  # the pattern matches the empty string too


def _parse(text: str, pos: int) -> _Node:
    pos = _skip(text, pos)
    if text[pos] in "{[":
        node, closing, pos = _Node(pos, pos), "}" if text[pos] == "{" else "]", _skip(text, pos + 1)
        while text[pos] != closing:
            if closing == "}":
                key, after = _DECODER.raw_decode(text, pos)
                value = _parse(text, _skip(text, after) + 1)  # after the colon
                node.members.append((key, pos, value))
            else:
                value = _parse(text, pos)
                node.items.append(value)
            pos = _skip(text, value.end)
            if text[pos] == ",":
                pos = _skip(text, pos + 1)
        node.end = pos + 1
        return node
    _, end = _DECODER.raw_decode(text, pos)
    return _Node(pos, end)


def _column(text: str, pos: int) -> int:
    return pos - (text.rfind("\n", 0, pos) + 1)


def _indent_of(text: str, pos: int) -> str:
    line = text[text.rfind("\n", 0, pos) + 1:pos]
    return line[:len(line) - len(line.lstrip())]


def _fresh(value: Any, indent: str, column: int) -> str:
    """A value written anew: on one line when it fits, else indented under `indent`."""
    flat = json.dumps(value, ensure_ascii=False)
    if column + len(flat) <= WIDTH or not isinstance(value, dict | list) or not value:
        return flat
    return json.dumps(value, ensure_ascii=False, indent=2).replace("\n", "\n" + indent)


def _separator(gaps: list[str]) -> str:
    """How members or items are separated in this container (", " or ",\n    "), from its last gap."""
    return gaps[-1] if gaps else ", "


def _render(text: str, node: _Node, old: Any, new: Any) -> str:
    if old == new and type(old) is type(new):
        return text[node.start:node.end]
    if isinstance(old, dict) and isinstance(new, dict) and node.members:
        kept = [k for k in old if k in new]
        if kept and kept == [k for k in new if k in old]:  # the same order: edit in place
            return _render_object(text, node, old, new)
    if isinstance(old, list) and isinstance(new, list) and node.items and len(new) > len(old) \
            and new[:len(old)] == old:
        return _render_appended(text, node, new[len(old):])
    if isinstance(old, list) and isinstance(new, list) and node.items and len(new) == len(old):
        parts = [_render(text, item, a, b) for item, a, b in zip(node.items, old, new, strict=True)]
        return _join(text, node, [item.start for item in node.items], parts)
    return _fresh(new, _indent_of(text, node.start), _column(text, node.start))


def _join(text: str, node: _Node, starts: list[int], parts: list[str]) -> str:
    """The container's text with its entries replaced by `parts`, its own gaps kept where there are entries."""
    ends = [value.end for _, _, value in node.members] or [item.end for item in node.items]
    gaps = [text[ends[i]:starts[i + 1]] for i in range(len(starts) - 1)]
    if not parts:
        return text[node.start] + text[node.end - 1]
    out = text[node.start:starts[0]] + parts[0]
    for i, part in enumerate(parts[1:]):
        out += (gaps[i] if i < len(gaps) else _separator(gaps)) + part
    return out + text[ends[-1]:node.end]


def _render_object(text: str, node: _Node, old: dict[str, Any], new: dict[str, Any]) -> str:
    starts = [start for _, start, _ in node.members]
    gaps = [text[node.members[i][2].end:starts[i + 1]] for i in range(len(starts) - 1)]
    indent = _separator(gaps).rpartition("\n")[2] if "\n" in _separator(gaps) else ""
    parts, part_starts = [], []
    for key, start, value in node.members:
        if key in new:
            parts.append(text[start:value.start] + _render(text, value, old[key], new[key]))
            part_starts.append(start)
    known = {key for key, _, _ in node.members}
    for key in new:
        if key not in known:
            head = json.dumps(key, ensure_ascii=False) + ": "
            column = len(indent) if indent else _column(text, node.members[-1][2].end) + 2
            parts.append(head + _fresh(new[key], indent, column + len(head)))
    if len(part_starts) == len(node.members):
        return _join(text, node, starts, parts)
    # Members were removed: keep the layout of the first gaps.
    out = text[node.start:starts[0]] if parts else text[node.start]
    sep = _separator(gaps)
    return out + sep.join(parts) + (text[node.members[-1][2].end:node.end] if parts else text[node.end - 1])


def _render_appended(text: str, node: _Node, added: list[Any]) -> str:
    gaps = [text[node.items[i].end:node.items[i + 1].start] for i in range(len(node.items) - 1)]
    sep = _separator(gaps)
    indent = sep.rpartition("\n")[2] if "\n" in sep else ""
    body, column = text[node.start:node.items[-1].end], _column(text, node.items[-1].end)
    for value in added:
        piece = _fresh(value, indent, 0)
        if "\n" in sep and column + 2 + len(piece) > WIDTH:  # a wrapped list: a new line when this one is full
            body, column = body + "," + "\n" + indent + piece, len(indent) + len(piece)
        else:
            body, column = body + ", " + piece, column + 2 + len(piece)
    return body + text[node.items[-1].end:node.end]


def edit(original: str, old: Any, new: Any) -> str:
    """`new` written in the layout of `original` (the text of `old`); anything unexpected: a plain dump."""
    plain = json.dumps(new, indent=2, ensure_ascii=False) + "\n"
    try:
        root = _parse(original, 0)
        text = original[:root.start] + _render(original, root, old, new) + original[root.end:]
    except (ValueError, IndexError, json.JSONDecodeError):
        return plain
    try:
        return text if json.loads(text) == new else plain
    except ValueError:
        return plain
