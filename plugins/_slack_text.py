"""Slack text: Markdown turned into Slack mrkdwn, and long answers split where Slack allows."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from markdown_it.token import Token
from slackify_markdown.slackify import SlackifyMarkdown

FENCE = "```"
_MENTION = re.compile(r"<[@#][A-Z0-9]+(?:\|[^<>]*)?>")


def escape(text: str) -> str:
    """Slack's escaping of the three characters it treats as control characters."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _escape_keeping_mentions(text: str) -> str:
    # User and channel mentions (<@U…>, <#C…>) stay live; `<!channel>`-style broadcasts do not.
    out, pos = [], 0
    for m in _MENTION.finditer(text):
        out += [escape(text[pos:m.start()]), m.group()]
        pos = m.end()
    out.append(escape(text[pos:]))
    return "".join(out)


class _Mrkdwn(SlackifyMarkdown):  # type: ignore[misc]  # slackify_markdown ships no types: its class is Any
    """slackify-markdown with Slack's escaping applied inside code too, and no broadcast mentions."""

    def text(self, tokens: list[Token], idx: int, options: Any, env: Any) -> str:
        return _escape_keeping_mentions(tokens[idx].content)

    def code_inline(self, tokens: list[Token], idx: int, options: Any, env: Any) -> str:
        return f"`{escape(tokens[idx].content)}`"

    def fence(self, tokens: list[Token], idx: int, options: Any, env: Any) -> str:
        code = escape(tokens[idx].content)
        if code and not code.endswith("\n"):
            code += "\n"  # an unclosed block at the end of an answer: the closing fence needs its own line
        return f"{FENCE}\n{code}{FENCE}\n"

    code_block = fence


def to_mrkdwn(markdown: str) -> str:
    """An answer in (GitHub-style) markdown as Slack mrkdwn."""
    text: str = _Mrkdwn(markdown).slackify()  # slackify_markdown ships no types
    return text.strip("\n")


@dataclass(frozen=True, slots=True)
class _Line:
    text: str
    code_before: bool  # inside a code block at the start of this line
    code_after: bool


def _lines(text: str, width: int) -> Iterator[_Line]:
    """The lines of `text` with their code-block state; lines wider than `width` are cut."""
    in_code = False
    for line in text.split("\n"):
        while True:
            part = line
            if len(line) > width:
                cut = line.rfind(" ", width // 2, width) if not in_code else -1
                cut = cut if cut > 0 else width
                part, line = line[:cut], line[cut:].lstrip(" ") if not in_code else line[cut:]
            after = in_code != (part.count(FENCE) % 2 == 1)
            yield _Line(part, in_code, after)
            in_code = after
            if part is line:
                break


def _render(lines: list[_Line]) -> str:
    text = "\n".join(line.text for line in lines)
    if lines and lines[0].code_before:
        text = f"{FENCE}\n{text}"
    if lines and lines[-1].code_after:
        text = f"{text}\n{FENCE}"
    return text


def _best_cut(lines: list[_Line], limit: int) -> int:
    """Where to cut a full message: before its last blank line outside code in the second half, else at the end."""
    cut, chars = len(lines), 0
    for i, line in enumerate(lines):
        if i and chars >= limit // 2 and not line.code_before and not line.text.strip():
            cut = i
        chars += len(line.text) + 1
    return cut


def split_message(text: str, limit: int) -> list[str]:
    """Cut mrkdwn into messages of at most `limit` characters without breaking code blocks.

    A code block that spans a cut is closed at the end of one message and reopened at the start
    of the next. Cuts prefer a blank line outside code in the second half of a message.
    """
    fence = len(FENCE) + 1
    chunks: list[str] = []
    current: list[_Line] = []
    chars = 0  # characters of `current`, one newline per line included

    def size(total: int, first: _Line, last: _Line) -> int:
        return total - 1 + (fence if first.code_before else 0) + (fence if last.code_after else 0)

    def emit(lines: list[_Line]) -> None:
        while lines and not lines[0].code_before and not lines[0].text.strip():
            lines = lines[1:]
        while lines and not lines[-1].code_after and not lines[-1].text.strip():
            lines = lines[:-1]
        if lines:
            chunks.append(_render(lines))

    for line in _lines(text, limit - 2 * fence):
        while current and size(chars + len(line.text) + 1, current[0], line) > limit:
            cut = _best_cut(current, limit)
            emit(current[:cut])
            current = current[cut:]
            chars = sum(len(kept.text) + 1 for kept in current)
        current.append(line)
        chars += len(line.text) + 1
    emit(current)
    return chunks or [""]
