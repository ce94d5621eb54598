"""The shape of a SQL statement, for shape grants (pure): its text with each literal value replaced by a
placeholder of its type, so one grant covers the same statement with other values and nothing else.

Built from sqlglot's MySQL tokens, like `sql.py`'s classification, and imported by the gate with it: sqlglot
itself is imported at the first statement shaped (see `sql.py`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from sql import server_readings, split_statements

if TYPE_CHECKING:
    from sqlglot.tokens import Token

#: What a literal of each token type becomes in a shape: its type, never its value.
_PLACEHOLDERS = {"STRING": "?s", "NUMBER": "?n", "HEX_STRING": "?x", "BIT_STRING": "?bit",
                 "NATIONAL_STRING": "?ns", "BYTE_STRING": "?x"}
# Literals whose value changes how much a statement touches or how it matches: kept as written
# (numbers after these words; any pattern after REGEXP/RLIKE; a LIKE pattern with a wildcard).
_NUMBER_KEPT_AFTER = frozenset({"LIMIT", "OFFSET", "BY", "ORDER BY", "GROUP BY", "INTERVAL"})
_PATTERN_WORDS = frozenset({"REGEXP", "RLIKE"})
_LIKE_WILDCARDS = re.compile(r"[%_\\]")


def sql_shape(sql: Any) -> str:
    r"""The statement with each literal value replaced by a placeholder of its type, or "" when it is not
    exactly one statement that parses: then no shape grant can match it.

    `'x'` becomes `?s`, `0` `?n`, `0x41` `?x`, `b'1'` `?bit`; NULL, TRUE, variables, columns and
    function calls stay as written. Values whose content decides what a statement matches or how
    much it touches stay as written too: the numbers of LIMIT/OFFSET, ORDER/GROUP BY positions and
    INTERVALs, REGEXP patterns, strings with a LIKE wildcard or escape (`%`, `_`, `\`), and every
    argument of a function call (`INSTR(name, '')`, `REGEXP_LIKE(name, '.*')` are true for every
    row). So `name = 'x'` never shapes like `name = 0`, nor `LIKE 'x'` like `LIKE '%'`, nor `LIMIT 1`
    like `LIMIT 1000`. Built from the tokens (keywords upper-cased, comments dropped, quoted names
    kept quoted), so nothing the parser drops can hide in it.
    """
    if not isinstance(sql, str) or server_readings(sql) != [sql] or len(split_statements(sql)) != 1:
        return ""  # text the server reads otherwise than the tokens say (an executable comment) has no shape
    import sqlglot
    from sqlglot import exp
    from sqlglot.dialects.mysql import MySQL
    try:
        statements = [s for s in sqlglot.parse(sql, read="mysql") if s is not None]
        tokens = MySQL().tokenize(sql)
    except Exception:  # a parser failure means no shape, never a match
        return ""
    if len(statements) != 1 or isinstance(statements[0], exp.Command):
        return ""
    words: list[str] = []
    previous, previous_kind = "", ""
    calls: list[bool] = []  # one entry per open parenthesis: whether it holds a function's arguments
    for i, token in enumerate(tokens):
        kind = token.token_type.name
        if kind == "SEMICOLON":
            continue
        if kind == "L_PAREN":
            calls.append(_opens_call(previous, previous_kind))
        elif kind == "R_PAREN" and calls:
            calls.pop()
        if kind in _PLACEHOLDERS:
            number = kind == "NUMBER"
            kept = (any(calls) or previous in _PATTERN_WORDS or bool(_LIKE_WILDCARDS.search(token.text))
                    or (number and (previous in _NUMBER_KEPT_AFTER or (previous == "," and _after_limit(tokens, i)))))
            words.append(_literal(token) if kept else _PLACEHOLDERS[kind])
        elif kind == "IDENTIFIER":
            words.append("`" + token.text.replace("`", "``") + "`")
        elif kind == "VAR":
            words.append(token.text)
        else:
            words.append(token.text.upper())
        previous, previous_kind = (words[-1], kind) if kind not in _PLACEHOLDERS else ("?", kind)
    return " ".join(words)


# Words a parenthesis follows that opens a list, a subquery or a group, not a function's arguments.
_NOT_CALLS = frozenset({
    "IN", "VALUES", "VALUE", "EXISTS", "NOT", "ANY", "SOME", "ALL", "AND", "OR", "XOR", "ON", "USING", "AS",
    "SELECT", "FROM", "WHERE", "HAVING", "BY", "INTO", "SET", "JOIN", "TABLE", "WITH", "UNION", "INTERSECT",
    "EXCEPT", "LIMIT", "OFFSET", "ROW", "WHEN", "THEN", "ELSE", "CASE", "RETURNING", "LATERAL", "OVER",
})


def _opens_call(previous: str, previous_kind: str) -> bool:
    """Whether a `(` after this token opens a function's arguments: after a name or a keyword that names
    a function (`CONCAT(`, `DATE(`, `LEFT(`); not after an operator, a comma or a clause word."""
    if previous_kind in ("VAR", "IDENTIFIER"):
        return True
    return previous.replace("_", "").isalpha() and previous not in _NOT_CALLS


def _after_limit(tokens: list[Token], i: int) -> bool:
    """Whether token i follows `LIMIT n ,` (MySQL's `LIMIT offset, count`)."""
    return i >= 3 and tokens[i - 3].text.upper() == "LIMIT"


def _literal(token: Token) -> str:
    kind = token.token_type.name
    if kind == "STRING":
        return "'" + token.text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if kind in ("HEX_STRING", "BYTE_STRING"):
        return f"X'{token.text}'"
    if kind == "BIT_STRING":
        return f"B'{token.text}'"
    if kind == "NATIONAL_STRING":
        return "N'" + token.text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return token.text
