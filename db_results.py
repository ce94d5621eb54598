"""What a database call returns, as values and as text: each statement's result, the errors that stop a
call (each with what to do next), and the tables and messages a user or the model reads (database.py runs
the calls).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pymysql

#: Characters of one cell shown in a result table.
MAX_CELL = 120


# ── Errors ──────────────────────────────────────────────────────────────────────────────────

_HINTS = {
    1044: "this MySQL user has no rights on that database: check MYSQL_DB or ask for a GRANT",
    1045: "wrong MYSQL_USER or MYSQL_PASS",
    1049: "that database does not exist: check MYSQL_DB",
    1054: "check the column names (DESCRIBE <table> lists them)",
    1064: "fix the SQL (one statement at a time; statements are separated by ';')",
    1142: "this call has no right to do that: ask the user to approve it, or an administrator must GRANT it",
    1143: "this call has no right to do that: ask the user to approve it, or an administrator must GRANT it",
    1227: "this call has no right to do that: ask the user to approve it, or an administrator must GRANT it",
    1146: "check the table name (SHOW TABLES lists them)",
    1148: "LOAD DATA LOCAL is disabled",
    1792: "it was taken for a read and ran in a read-only transaction, but it writes; send it as a write",
    1969: "the server's time limit stopped it; narrow the query (WHERE, LIMIT, an index)",
    2002: "is the MySQL server running? check MYSQL_HOST and MYSQL_PORT",
    2003: "is the MySQL server running? check MYSQL_HOST and MYSQL_PORT",
    2006: "the connection was lost while the statement ran; a write may or may not have been applied",
    2013: "the connection was lost while the statement ran; a write may or may not have been applied",
    4166: "LOAD DATA LOCAL is disabled",
}


class DatabaseError(Exception):
    """A database call failed; `str()` is the message for the user, with what to do next."""


class ConnectError(DatabaseError):
    """No usable connection: the server is down or unreachable, or the credentials are refused."""


class StatementError(DatabaseError):
    """The server refused or failed one statement (syntax, unknown table, no rights, its time limit)."""


class StatementTimeout(StatementError):
    """A statement outlived the client-side limit; its connection was dropped and its server thread killed."""


def describe_error(exc: BaseException) -> str:
    """`MySQL error <code>: <server message> — <what to do>` for a PyMySQL error, else its text."""
    args = exc.args if isinstance(exc, pymysql.err.MySQLError) else ()
    if len(args) >= 2 and isinstance(args[0], int):
        hint = _HINTS.get(args[0])
        return f"MySQL error {args[0]}: {args[1]}" + (f" — {hint}" if hint else "")
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# ── Statements and results ──────────────────────────────────────────────────────────────────


@dataclass
class StatementResult:
    """One statement's outcome: a result set (`columns`, the first rows, `row_count` of all rows) or rows affected."""

    sql: str
    columns: list[str] | None = None
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    row_count: int = 0
    insert_id: int | None = None


@dataclass
class Outcome:
    """What a call did: the statements that ran, and the error that stopped it (if any)."""

    statements: list[str]
    results: list[StatementResult] = field(default_factory=list)
    error: DatabaseError | None = None
    notes: list[str] = field(default_factory=list)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, (bytes, bytearray)):
        try:
            text = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            text = "0x" + bytes(value[:MAX_CELL]).hex()
    else:
        text = str(value)
    text = text.replace("\r\n", "\\n").replace("\n", "\\n").replace("\t", " ")
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 1] + "…"


def format_table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    """A pipe table: header, `-+-` rule, one line per row, each column padded to its widest cell."""
    cells = [[_cell(v) for v in row] for row in rows]
    header = [_cell(c) for c in columns]
    widths = [max([len(header[i]), *(len(r[i]) for r in cells)]) for i in range(len(columns))]

    def line(values: list[str]) -> str:
        return " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *(line(r) for r in cells)])


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_result(result: StatementResult) -> str:
    """A result set as a table with its row count, or `OK — rows affected: N`."""
    if result.columns is None:
        insert = f" (last insert id: {result.insert_id})" if result.insert_id else ""
        return f"OK — rows affected: {result.row_count}{insert}"
    if not result.rows:
        return format_table(result.columns, []) + "\n(no rows)"
    count = f"({_plural(result.row_count, 'row')}"
    if result.row_count > len(result.rows):
        count += f"; the first {_plural(len(result.rows), 'row')} shown — add WHERE or LIMIT to see the others"
    return format_table(result.columns, result.rows) + "\n" + count + ")"


def _one_line(sql: str, width: int = 80) -> str:
    flat = " ".join(sql.split())
    return flat if len(flat) <= width else flat[:width - 1] + "…"


def format_outcome(outcome: Outcome, marker: str = "ERROR: ") -> str:
    """The text a user or the model gets: results, and a first line starting with `marker` when something
    failed (the db_query tool passes "" and raises ToolError with it, which adds the marker itself)."""
    total = len(outcome.statements)
    blocks = [format_result(r) if total == 1 else f"[{i}/{total}] {_one_line(r.sql)}\n{format_result(r)}"
              for i, r in enumerate(outcome.results, 1)]
    head = []
    if outcome.error is not None:
        done = len(outcome.results)
        if isinstance(outcome.error, ConnectError) or total <= 1:
            head.append(f"{marker}{outcome.error}")
        else:
            rest = total - done - 1
            fate = ["statement 1 ran (changes it made are kept)" if done == 1 else
                    f"statements 1–{done} ran (changes they made are kept)"] if done else []
            fate += [f"the {_plural(rest, 'statement')} after it did not run"] if rest else []
            fate_text = "; ".join(fate)
            head.append(f"{marker}statement {done + 1} of {total} failed: {outcome.error}\n"
                        f"{fate_text[:1].upper()}{fate_text[1:]}.")
    return "\n\n".join([*head, *blocks, *outcome.notes]).strip()
