"""SQL classification for the `db` gate: which operation a statement performs, on which tables (pure).

`classify_sql` names what a statement touches, for the human who approves it and for grants:
its operation (`read` < `write` < `ddl`, the strongest of a batch) and the gate keys of its
tables. It parses with sqlglot's MySQL dialect under MySQL's default `sql_mode` (backslash
escapes on, `"` quotes a string): every connection that runs what it classified must pin that
mode (`ASSUMED_SQL_MODE_OFF` must not be set), or the two would split statements differently.

Rules (see docs/security.md):
- Names resolve per scope (sqlglot's scope analysis, checked against SQL's visibility rules): a
  CTE hides a table only inside the query that defines it (its body, and the CTEs after it in
  the same WITH; every CTE of a WITH RECURSIVE); elsewhere the name is the real table. Write
  targets are always real tables. Where in doubt, a name counts as a real table.
- No word list removes a table name: only the bare keyword `DUAL` of `FROM DUAL` is no table.
- `SHOW` is `__meta__` only for the forms in `SHOW_META` with nothing but names and one string
  after `LIKE`; a `WHERE` is classified like a SELECT of its expression (its subqueries' tables
  and functions count); `SHOW PROCESSLIST` and the other forms in `SHOW_KEYED` are keyed by the
  system table they reveal; any other form touches any table.
- DDL (CREATE, DROP, ALTER, RENAME, TRUNCATE) is its own operation; a statement that does not
  parse, or whose effect cannot be known, is `ddl` on `*` (any table): nothing weaker covers it.
- Executable comments are classified as the SQL the server runs (`server_readings`): MariaDB runs
  the text of `/*! … */` and `/*M! … */`, and of `/*!NNNNN`/`/*M!NNNNNN … */` when the version is
  at most its own (MariaDB skips `/*!50700`…`/*!99999`, MySQL runs them and reads `/*M!` as a plain
  comment). The server's version is unknown, so the text is read once per version it may have
  (and as MySQL would, where that differs), following MariaDB's lexer (strings, quoted names and
  line comments inside the comment, one nested plain comment, the first `*/` in code ends it), and
  a batch is the strongest of all readings with the keys of all. A `/*!` in a string or a line
  comment is text, not code. A statement the splitter sees as one but the server as several
  (`SELECT 1 /*!; DROP …*/`), a comment left open, `/*m!`, `/*!!`/`/*M!!` (reversed comments of
  newer MariaDB), a NUL, or more than 24 readings are `ddl` on `*`. `--` before a non-ASCII
  character is code for the server, so sqlglot is not let take it for a comment.
- Compound statements are keyed by every statement inside them and refused as a whole: their own
  parts (`BEGIN NOT ATOMIC`, labels, `IF … THEN`, `WHILE … DO`, `LOOP`, `REPEAT`, `CASE`, `FOR`,
  `DECLARE`, `END …`) are never known, so a compound is `ddl` on `*` plus the tables of each
  statement in it. So are dynamic SQL (`EXECUTE [IMMEDIATE]`, `PREPARE`, `DEALLOCATE`, even with a
  literal: the text it runs is data), `CALL` and role switches (`SET ROLE`, `SET DEFAULT ROLE`,
  `GRANT role`): `ddl` on `*` needs a human's approval for anything on any table, and nothing an
  agent does day to day needs them, while a plain comment or an optimizer hint (`SELECT /*+ … */`)
  classifies as it always did.
- Keys keep the case the server distinguishes: `case_sensitive=True` (`lower_case_table_names=0`)
  keeps names as written, otherwise they are lower-cased. `information_schema` is case-insensitive
  on every server and always lower-cased.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import TYPE_CHECKING, Any, ClassVar

# sqlglot (about 9 MiB of code) is imported by the functions that parse, at the first statement: every
# server imports this module through the gate, and only one with a `db` tool ever classifies SQL.
if TYPE_CHECKING:
    from sqlglot import exp
    from sqlglot.tokens import Token, Tokenizer

logger = logging.getLogger("agent_mcp.sql")


def _not_command_fallback(record: logging.LogRecord) -> bool:
    # sqlglot warns, quoting the whole SQL, when it parses a statement as an opaque Command; the
    # classifier treats every Command as unknown anyway, and SQL text does not belong in the log.
    return "Falling back to parsing as a 'Command'" not in record.getMessage()


logging.getLogger("sqlglot").addFilter(_not_command_fallback)

READ, WRITE, DDL = "read", "write", "ddl"
#: The operations, weakest first: a batch is its strongest statement's.
OPERATIONS = (READ, WRITE, DDL)
#: Gate key of statements that touch no table (SHOW TABLES, DESCRIBE, SELECT 1).
META = "__meta__"
#: Gate key of statements that could not be analysed: they may touch any table.
ANY_TABLE = "*"
#: `sql_mode` flags the classifier assumes are OFF on every connection that runs what it classified.
ASSUMED_SQL_MODE_OFF = ("NO_BACKSLASH_ESCAPES", "ANSI_QUOTES")
#: Schemas of the server itself (accounts, grants, status): gated by their own keys, never by `*`.
SYSTEM_SCHEMAS = frozenset({"mysql", "information_schema", "performance_schema", "sys"})
# Schemas whose names (and table names) the server compares without case on every setting.
_CASELESS_SCHEMAS = frozenset({"information_schema"})
#: What may start an executable comment (`/*!`, `/*M!`, and `/*m!`, which the classifier refuses), found
#: anywhere in the raw text, strings included: a text without it has none. sqlglot sees a comment.
EXECUTABLE_COMMENT = re.compile(r"/\*M?!", re.IGNORECASE)


@functools.cache
def _roots() -> tuple[tuple[type[exp.Expr], ...], ...]:
    """(read roots, write roots, DDL roots, nodes that make a statement more than a plain read wherever
    they appear in its tree)."""
    from sqlglot import exp
    return ((exp.Select, exp.Union, exp.Except, exp.Intersect, exp.Subquery),
            (exp.Insert, exp.Update, exp.Delete, exp.Merge),
            (exp.Create, exp.Drop, exp.Alter, exp.TruncateTable),
            (exp.DML, exp.DDL, exp.Drop, exp.Alter, exp.TruncateTable, exp.Command, exp.Set, exp.Into,
             exp.Lock, exp.LoadData, exp.Grant, exp.Revoke, exp.Kill, exp.Use, exp.Transaction,
             exp.Commit, exp.Rollback, exp.Analyze, exp.Pragma, exp.Cache, exp.Uncache, exp.Refresh,
             exp.Comment))


# Builtins with side effects (files, locks, time, sequences, replication): a statement calling one is a write.
_SIDE_EFFECT_FUNCTIONS = frozenset({
    "load_file", "sleep", "benchmark", "get_lock", "release_lock", "release_all_locks", "is_free_lock",
    "is_used_lock", "master_pos_wait", "source_pos_wait", "wait_for_executed_gtid_set",
    "sys_exec", "sys_eval", "setval", "nextval", "lastval", "last_insert_id", "uuid_short",
})
# Side-effect-free MySQL/MariaDB builtins sqlglot does not model (it parses them as anonymous calls).
# Any other function it does not model is a user-defined or stored function: it may write anything.
_SAFE_UNMODELLED_FUNCTIONS = frozenset({
    "adddate", "addtime", "aes_decrypt", "aes_encrypt", "bin", "charset", "coercibility", "conv", "crc32",
    "export_set", "field", "find_in_set", "found_rows", "from_days", "inet_aton", "inet_ntoa", "inet6_aton",
    "inet6_ntoa", "json_array", "json_arrayagg", "json_contains", "json_contains_path", "json_depth",
    "json_insert", "json_length", "json_merge_patch", "json_merge_preserve", "json_quote", "json_replace",
    "json_search", "json_unquote", "json_valid", "makedate", "microsecond", "mid", "now", "oct",
    "octet_length", "ord", "period_add", "period_diff", "quote", "row_count", "sec_to_time", "strcmp",
    "subdate", "subtime", "sysdate", "system_user", "time_format", "time_to_sec", "timediff", "to_seconds",
    "uncompress", "unix_timestamp", "user", "weekday", "yearweek", "connection_id", "database", "schema",
})
# MySQL statement modifiers, per statement verb: sqlglot takes some of them for a table name
# (`UPDATE LOW_PRIORITY users` would be keyed `low_priority`), so they are dropped before parsing.
_MODIFIERS = {
    "UPDATE": frozenset({"LOW_PRIORITY", "IGNORE"}),
    "INSERT": frozenset({"LOW_PRIORITY", "DELAYED", "HIGH_PRIORITY", "IGNORE"}),
    "REPLACE": frozenset({"LOW_PRIORITY", "DELAYED"}),
    "DELETE": frozenset({"LOW_PRIORITY", "QUICK", "IGNORE"}),
}
_ALL_MODIFIERS = frozenset().union(*_MODIFIERS.values())
# Objects of CREATE/DROP/ALTER that are tables (keyed by name); any other object (database, routine,
# event, trigger, view, user, …) may touch anything.
_TABLE_OBJECTS = frozenset({"TABLE", "INDEX", "SEQUENCE"})
_TABLE_KEYWORDS = frozenset({"FROM", "JOIN", "INTO", "UPDATE", "TABLE", "TABLES", "LOCK TABLES", "HANDLER", "TO"})
_NAME_TOKENS = ("VAR", "IDENTIFIER")

# ── SHOW ──
#: SHOW forms that reveal the schema or the server's settings, never rows: `__meta__` reads (when
#: nothing but names, FROM/IN and one string after LIKE follow; a WHERE is classified on its own).
SHOW_META = frozenset({
    "TABLES", "TABLE STATUS", "OPEN TABLES", "DATABASES", "SCHEMAS", "COLUMNS", "FIELDS", "INDEX", "INDEXES",
    "KEYS", "CREATE TABLE", "CREATE VIEW", "CREATE DATABASE", "CREATE SCHEMA", "CREATE SEQUENCE", "VARIABLES",
    "STATUS", "WARNINGS", "ERRORS", "COUNT", "ENGINES", "CHARACTER SET", "CHARSET", "COLLATION", "PLUGINS",
    "PRIVILEGES", "TRIGGERS", "EVENTS", "PROCEDURE STATUS", "FUNCTION STATUS", "PACKAGE STATUS",
    "PACKAGE BODY STATUS", "AUTHORS", "CONTRIBUTORS", "PROFILES", "PROFILE", "GRANTS",
})
#: SHOW forms that reveal what a system table holds: keyed like that table (never `__meta__`).
SHOW_KEYED = {
    "PROCESSLIST": "information_schema.processlist",  # other sessions' statements in flight
    "EXPLAIN": "information_schema.processlist",  # SHOW EXPLAIN / ANALYZE FOR <thread>: another session's query
    "ANALYZE": "information_schema.processlist",
    "CREATE PROCEDURE": "mysql.proc", "CREATE FUNCTION": "mysql.proc", "CREATE PACKAGE": "mysql.proc",
    "PROCEDURE CODE": "mysql.proc", "FUNCTION CODE": "mysql.proc",
    "CREATE TRIGGER": "information_schema.triggers", "CREATE EVENT": "mysql.event",
    "CREATE USER": "mysql.user",  # and SHOW GRANTS FOR <another account> (see _classify_show)
}
# Words between SHOW and the form that do not change what it reveals.
_SHOW_NOISE = frozenset({"FULL", "GLOBAL", "SESSION", "EXTENDED", "STORAGE", "ALL"})
# `SHOW GRANTS FOR <these>` shows the caller's own grants: no account's table.
_OWN_ACCOUNT = frozenset({"CURRENT_USER", "CURRENT_ROLE"})


@functools.cache
def _word_tokenizer() -> type[Tokenizer]:
    from sqlglot.dialects.mysql import MySQL

    class WordTokenizer(MySQL.Tokenizer):
        """MySQL tokens, with CALL/REPLACE/RENAME/… not swallowing the rest of the statement as one string."""

        COMMANDS: ClassVar[set[Any]] = set()

    return WordTokenizer


def _tokens(text: str) -> list[Token] | None:
    from sqlglot.errors import SqlglotError
    try:
        return _word_tokenizer()().tokenize(text)
    except (SqlglotError, RecursionError, ValueError):
        return None


def table_key(name: str, schema: str | None = None, *, case_sensitive: bool = False) -> str:
    """The gate key of a table: `name`, or `schema.name` when the statement names its schema; lower case
    unless the server tells names apart by case (`information_schema` never does). A name that could be
    read as another key (one with a dot or a backquote, `*`, `__meta__`) is backquoted: the table
    `` `shop.users` `` is not `shop.users`, and a table named `__meta__` is not metadata."""
    caseless = not case_sensitive or (schema or "").lower() in _CASELESS_SCHEMAS
    key = f"{_key_part(schema)}.{_key_part(name)}" if schema else _key_part(name)
    return key.lower() if caseless else key


def _key_part(part: str) -> str:
    if "." in part or "`" in part or part in (META, ANY_TABLE):
        return "`" + part.replace("`", "``") + "`"
    return part


def is_system_key(key: str) -> bool:
    """Whether a gate key names a table of a system schema (`mysql.user`, `information_schema.tables`)."""
    return "." in key and key.partition(".")[0].lower() in SYSTEM_SCHEMAS


def strongest(ops: Any) -> str:
    """The strongest of some operations (read < write < ddl); anything unknown is ddl."""
    rank = 0
    for op in ops:
        rank = max(rank, OPERATIONS.index(op) if op in OPERATIONS else len(OPERATIONS) - 1)
    return OPERATIONS[rank]


# ── What the server reads ───────────────────────────────────────────────────────────────────

#: The server versions the readings of versioned comments start from: MariaDB 10.0, MySQL 5.7.
MIN_SERVER_VERSION, MYSQL_57 = 100000, 50700
# More readings than this (distinct version numbers in one text) and the text is refused.
_MAX_READINGS = 24
_VERSIONED = re.compile(r"/\*M?!(\d{5}\d?)")
_SPECIAL = re.compile(r"['\"`#/*-]")
# `--` before a character beyond ASCII: sqlglot may take it for a comment (a Unicode space), MariaDB never does.
_ODD_DASHES = re.compile(r"--[^\x00-\x7f]")


class _Refused(Exception):
    """Text whose reading by the server the classifier does not model: it may touch anything."""


def server_readings(sql: str) -> list[str] | None:
    """Every text the server may run for `sql` once its executable comments are read, or None when the
    classifier does not model how the server would read it (then it may touch anything).

    `[sql]` itself when nothing in its code (outside strings, quoted names and comments) is read
    differently by the server and by sqlglot. Otherwise each reading has the markers of the
    comments that run replaced by a space, their text kept, and the comments that do not run
    replaced by a space, following MariaDB's lexer (sql_lex.cc): `/*!` and `/*M!` without a version
    run; with one (5 digits, or 6), when it is at most the server's, except `/*!50700`…`/*!99999`,
    which MariaDB skips; inside a running comment a string, a quoted name, `#` or `-- ` may hold
    `*/`, a plain comment nests once, and the first `*/` in code ends it. The server's version is
    unknown, so there is one reading per version it may have (10.0, and each version number in the
    text); where the text has `/*M!` or a version from 5.7 on, MySQL's readings too (`/*M!` is a
    plain comment, every `/*!` up to its version runs, 6 digits only before a space). `--` that is no
    comment for the server (not before a space or a control character) is `- -` in the reading, so
    neither sqlglot (`--` before a no-break space) nor the reading itself (`--/*!*/1`) takes it for
    one. Refused: a comment left open, `/*!!` and `/*M!!` (reversed comments of newer
    MariaDB), `/*m!`, a NUL character, more than `_MAX_READINGS` readings.
    """
    if "\x00" in sql:
        return None
    if not EXECUTABLE_COMMENT.search(sql) and not _ODD_DASHES.search(sql):
        return [sql]
    versions = {int(n) for v in _VERSIONED.findall(sql) for n in (v, v[:5])}
    worlds = [(v, False) for v in sorted({MIN_SERVER_VERSION} | {v for v in versions if v > MIN_SERVER_VERSION})]
    if "/*M!" in sql or any(v >= MYSQL_57 for v in versions):
        worlds += [(v, True) for v in sorted({MYSQL_57, 999999} | {v for v in versions if MYSQL_57 < v < 999999})]
    if len(worlds) > _MAX_READINGS:
        return None
    readings: list[str] = []
    try:
        for threshold, mysql in worlds:
            text = _read(sql, threshold, mysql)
            if text not in readings:
                readings.append(text)
    except _Refused:
        return None
    return readings


def _read(sql: str, threshold: int, mysql: bool) -> str:
    """`sql` as a server of version `threshold` runs it (`mysql`: MySQL's rules, see `server_readings`)."""
    out: list[str] = []
    i, n, running = 0, len(sql), False  # running: inside an executable comment that runs
    while i < n:
        found = _SPECIAL.search(sql, i)
        if found is None:
            out.append(sql[i:])
            break
        j = found.start()
        out.append(sql[i:j])
        c = sql[j]
        if c in "'\"`":
            i = _quoted_end(sql, j)
            out.append(sql[j:i])
        elif c == "#" or (c == "-" and sql.startswith("--", j) and _starts_line_comment(sql, j + 2)):
            end = sql.find("\n", j)
            i = n if end < 0 else end
            out.append(sql[j:i])
        elif c == "-" and sql.startswith("--", j):
            # Two minus signs for the server. Kept apart, so that neither a marker read away after them
            # (`--/*!*/1`) nor a character sqlglot counts as a space (`--\u00a0`) makes a comment of them.
            out.append("- ")
            i = j + 1
        elif c == "/" and sql.startswith("/*", j):
            i = _comment(sql, j, threshold, mysql, out)
            running = running or i < 0
            i = abs(i)
        elif c == "*" and running and sql.startswith("*/", j):
            out.append(" ")
            i, running = j + 2, False
        else:
            out.append(c)
            i = j + 1
    if running:
        raise _Refused  # the server: a syntax error
    return "".join(out)


def _starts_line_comment(sql: str, k: int) -> bool:
    """Whether `--` followed by sql[k] opens a comment for MariaDB: a space, a control character (tabs and
    line ends among them) or the end of the text."""
    return k >= len(sql) or sql[k] == " " or ord(sql[k]) < 0x20 or sql[k] == "\x7f"


def _comment(sql: str, j: int, threshold: int, mysql: bool, out: list[str]) -> int:
    """Read the comment at sql[j] (`/*`) into `out`: where the reading goes on, negated when it goes on
    inside an executable comment that runs (its text is code)."""
    k = j + 2
    maria = sql.startswith("M!", k)
    if sql.startswith("m!", k):
        raise _Refused  # a plain comment for MariaDB, but one letter from MariaDB's own marker
    if not (maria or sql.startswith("!", k)) or (maria and mysql):  # MySQL: /*M! is a plain comment
        end = _comment_end(sql, k, 0)
        out.append(sql[j:end] if not maria else " ")  # a plain comment (an optimizer hint stays one)
        return end
    k += 2 if maria else 1
    if sql.startswith("!", k):
        raise _Refused  # /*!! and /*M!!: reversed comments (newer MariaDB), read differently by different versions
    digits = 0
    while digits < 6 and k + digits < len(sql) and sql[k + digits] in "0123456789":
        digits += 1
    if digits < 5:  # no version: the text runs on every server (digits it starts with are code)
        out.append(" ")
        return -k
    if mysql and digits == 6 and not (k + 6 < len(sql) and sql[k + 6].isspace()):
        digits = 5  # MySQL: a sixth digit is the version's only before a space
    version = int(sql[k:k + digits])
    runs = version <= threshold and (mysql or maria or not MYSQL_57 <= version <= 99999)
    out.append(" ")
    if runs:
        return -(k + digits)
    return _comment_end(sql, j + (4 if maria else 3), 1)  # skipped: one plain comment may nest in it


def _comment_end(sql: str, i: int, nesting: int) -> int:
    """Where a comment whose text starts at sql[i] ends for MariaDB (after the first `*/`, letting
    `nesting` levels of `/* … */` nest); quotes mean nothing in it."""
    n = len(sql)
    while i < n:
        c = sql[i]
        i += 1
        if nesting > 0 and c == "/" and i < n and sql[i] == "*":
            i = _comment_end(sql, i + 1, nesting - 1)
        elif c == "*" and i < n and sql[i] == "/":
            return i + 1
    raise _Refused  # left open: the server refuses it


def _quoted_end(sql: str, j: int) -> int:
    """Where the string or quoted name starting at sql[j] ends (backslash escapes in strings, doubled quotes)."""
    quote, i, n = sql[j], j + 1, len(sql)
    while i < n:
        c = sql[i]
        if c == "\\" and quote != "`":
            i += 2
        elif c == quote:
            if i + 1 < n and sql[i + 1] == quote:
                i += 2
            else:
                return i + 1
        else:
            i += 1
    raise _Refused  # left open: the server refuses it


# ── Statements ──────────────────────────────────────────────────────────────────────────────


def split_statements(sql: str) -> list[str]:
    """The statements of `sql` as sqlglot's MySQL tokenizer separates them, each with its original text.

    Semicolons inside strings and comments do not split. Empty statements and statements of
    nothing but comments are dropped, except executable comments (`/*!40101 SET … */` in code, not
    in a string or a line comment), which the server runs. Text the tokenizer rejects is returned
    whole: the server then runs at most one statement of it.
    """
    from sqlglot.dialects.mysql import MySQL
    from sqlglot.errors import SqlglotError
    from sqlglot.tokens import TokenType
    try:
        tokens = MySQL().tokenize(sql)
    except (SqlglotError, RecursionError, ValueError):
        return [sql.strip()] if sql.strip() else []
    statements, start, has_tokens = [], 0, False
    for token in [*tokens, None]:  # None: the end of the text
        if token is not None and token.token_type != TokenType.SEMICOLON:
            has_tokens = True
            continue
        end = token.start if token is not None else len(sql)
        text = sql[start:end].strip()
        if has_tokens or (EXECUTABLE_COMMENT.search(text) and server_readings(text) != [text]):
            statements.append(text)
        start, has_tokens = end + 1, False
    return statements


# ── Names ───────────────────────────────────────────────────────────────────────────────────


def _is_dual(table: exp.Table) -> bool:
    """The keyword of `FROM DUAL` (no table); a backquoted, qualified or aliased `dual` is a real table."""
    from sqlglot import exp
    ident = table.this
    return (isinstance(ident, exp.Identifier) and not ident.quoted and not table.db and not table.alias
            and table.name.upper() == "DUAL")


def _same(a: str, b: str, case_sensitive: bool) -> bool:
    return a == b if case_sensitive else a.lower() == b.lower()


def _visible_cte(table: exp.Table, case_sensitive: bool) -> bool:
    """Whether SQL's rules make `table` a reference to a CTE: a WITH of an enclosing query defines its
    name, and the reference is in that query's body, or in a later CTE of the same WITH (any CTE of a
    WITH RECURSIVE). Only table references of FROM/JOIN qualify; qualified names never do."""
    from sqlglot import exp
    if table.db or not isinstance(table.parent, (exp.From, exp.Join)):
        return False
    path: list[exp.Expr] = [table]  # table, its parent, …: path[-1] is the node below `node`
    node: exp.Expr | None = table.parent
    while node is not None:
        with_ = node.args.get("with_") or node.args.get("with")
        if isinstance(node, exp.Query) and isinstance(with_, exp.With):
            ctes = list(with_.expressions)
            names = [c.alias_or_name for c in ctes]
            if path[-1] is with_:  # inside one of this WITH's CTEs: only those before it (or itself) are visible
                inner = next(i for i, c in enumerate(ctes) if c is path[-2])
                visible = names[:inner + 1] if with_.args.get("recursive") else names[:inner]
            else:
                visible = names
            if any(_same(name, table.name, case_sensitive) for name in visible):
                return True
        path.append(node)
        node = node.parent
    return False


def _scope_ctes(tree: exp.Expr) -> set[int]:
    """Ids of the Table nodes sqlglot's scope analysis resolves to a CTE (never on failure)."""
    from sqlglot import exp
    from sqlglot.optimizer.scope import traverse_scope
    roots = [tree] if isinstance(tree, exp.Query) else [
        q for q in tree.find_all(exp.Query) if q.parent is not None and q.find_ancestor(exp.Query) is None]
    found: set[int] = set()
    for root in roots:
        try:
            scopes = traverse_scope(root)
        except Exception:  # an analysis that fails hides nothing: every name counts as a table
            continue
        for scope in scopes:
            for table in scope.tables:
                source = scope.sources.get(table.alias_or_name)
                if not table.db and table.name in scope.cte_sources and source is scope.cte_sources[table.name]:
                    found.add(id(table))
    return found


def _tables(tree: exp.Expr, case_sensitive: bool, nodes: list[exp.Expr] | None = None) -> set[str]:
    """Gate keys of the real tables in a statement: every table reference except the bare DUAL keyword and
    names that both scope analysis and SQL's visibility rules resolve to a CTE (`nodes`: `tree.walk()`)."""
    from sqlglot import exp
    nodes = list(tree.walk()) if nodes is None else nodes
    has_with = any(isinstance(n, exp.With) for n in nodes)
    hidden = _scope_ctes(tree) if has_with else set()  # no WITH: no name can be a CTE's
    names = set()
    for table in nodes:
        if not isinstance(table, exp.Table) or not isinstance(table.this, exp.Identifier):
            continue  # not a table, or @variables of SELECT … INTO, table functions
        if _is_dual(table) or (id(table) in hidden and _visible_cte(table, case_sensitive)):
            continue
        names.add(table_key(table.name, table.db or None, case_sensitive=case_sensitive))
    return names


def _guess_tables(sql: str, case_sensitive: bool) -> set[str]:
    """Table-like names after FROM/INTO/TABLE/… for statements sqlglot cannot analyse (display only)."""
    tokens = _tokens(re.sub(r"/\*M?!\d*|\*/", " ", sql, flags=re.IGNORECASE))
    if tokens is None:
        return set()
    names = set()
    kinds = [t.token_type.name for t in tokens]
    for i in range(1, len(tokens)):
        if tokens[i - 1].text.upper() not in _TABLE_KEYWORDS or kinds[i] not in _NAME_TOKENS:
            continue
        bare = kinds[i] == "VAR"
        following = kinds[i + 1] if i + 1 < len(tokens) else ""
        if bare and following == "STRING" and tokens[i].text.upper() in ("OUTFILE", "DUMPFILE"):
            continue  # INTO OUTFILE '<file>': a file, not a table
        name, schema = tokens[i].text, None
        if following == "DOT" and i + 2 < len(tokens) and kinds[i + 2] in _NAME_TOKENS:
            name, schema = tokens[i + 2].text, tokens[i].text
        elif bare and tokens[i].text.upper() == "DUAL":
            continue
        names.add(table_key(name, schema, case_sensitive=case_sensitive))
    return names


def _without_modifiers(sql: str) -> str:
    """`sql` without the MySQL modifiers that follow UPDATE/INSERT/REPLACE/DELETE (see `_MODIFIERS`)."""
    tokens = _tokens(sql)
    if tokens is None:
        return sql
    cut: list[tuple[int, int]] = []
    allowed: frozenset[str] = frozenset()
    for token in tokens:
        word = token.text.upper()
        if token.token_type.name not in ("IDENTIFIER", "STRING") and word in allowed:  # `ignore` is a name
            cut.append((token.start, token.end + 1))
            continue
        allowed = _MODIFIERS.get(word, frozenset())
    for start, end in reversed(cut):
        sql = sql[:start] + " " + sql[end:]
    return sql


def _risky_call(nodes: list[exp.Expr]) -> bool:
    """Whether a statement (its nodes) calls a builtin with side effects, or a function that is no known builtin."""
    from sqlglot import exp
    for func in nodes:
        if not isinstance(func, exp.Func):
            continue
        if isinstance(func, exp.Anonymous):
            name = str(func.name).lower()
            if name in _SIDE_EFFECT_FUNCTIONS or name not in _SAFE_UNMODELLED_FUNCTIONS:
                return True
            if isinstance(func.parent, exp.Dot):  # db.f(…): a stored function, whatever its name
                return True
        elif str(func.sql_name()).lower() in _SIDE_EFFECT_FUNCTIONS:
            return True
    return False


# Storage engines that keep a table's rows in the table itself. Any other engine (CONNECT, FEDERATED,
# SPIDER, MERGE, …) or a CONNECTION option can make a table a window on other tables or servers.
_LOCAL_ENGINES = frozenset({"INNODB", "MYISAM", "ARIA", "MEMORY", "HEAP"})


def _reaches_elsewhere(nodes: list[exp.Expr]) -> bool:
    """Whether a CREATE/ALTER TABLE's options make the table read or write something beyond itself."""
    from sqlglot import exp
    for node in nodes:
        if isinstance(node, exp.EngineProperty) and node.name.upper() not in _LOCAL_ENGINES:
            return True
        if type(node) is exp.Property and node.name.upper() in ("CONNECTION", "UNION", "TABLE_TYPE"):
            return True
    return False


# ── One statement ───────────────────────────────────────────────────────────────────────────

Verdict = tuple[str, set[str]]


def _classify_show(text: str, tree: exp.Expr | None, case_sensitive: bool) -> Verdict | None:
    """A SHOW statement: `__meta__` for a plain SHOW_META form, its system table for SHOW_KEYED, a WHERE
    classified as a SELECT of its expression; None (unknown) for anything else."""
    from sqlglot import exp
    tokens = _tokens(text)
    if not tokens or tokens[0].text.upper() != "SHOW":
        return None
    words = [t.text.upper() if t.token_type.name != "IDENTIFIER" else "" for t in tokens[1:]]
    kinds = [t.token_type.name for t in tokens[1:]]
    while words and words[0] in _SHOW_NOISE:
        words, kinds = words[1:], kinds[1:]
    form = next((f for f in sorted([*SHOW_META, *SHOW_KEYED], key=len, reverse=True)
                 if words[:len(f.split())] == f.split()), None)
    if form is None:
        return None
    rest, rest_kinds = words[len(form.split()):], kinds[len(form.split()):]
    if form == "GRANTS" and rest:
        if rest[0] != "FOR":
            return None
        who = [w for w in rest[1:] if w not in ("(", ")")]
        return (READ, {META}) if who and set(who) <= _OWN_ACCOUNT else (READ, {"mysql.user"})
    if form in SHOW_KEYED:
        return READ, {SHOW_KEYED[form]}
    if "WHERE" in rest:
        where = tree.args.get("where") if isinstance(tree, exp.Show) else None
        if not isinstance(where, exp.Where) or "LIKE" in rest:
            return None
        verdict = _classify_statement(exp.Select(expressions=[where.this.copy()]), "", case_sensitive)
        return None if verdict is None else (verdict[0], verdict[1] | {META})
    if _plain_show_tail(rest, rest_kinds):
        return READ, {META}
    return None


def _plain_show_tail(words: list[str], kinds: list[str]) -> bool:
    """Whether what follows a SHOW form is only names (FROM/IN a table or schema), `LIMIT n`, and one
    string after LIKE: nothing that reads or computes anything."""
    i = 0
    while i < len(words):
        if words[i] == "LIKE":
            if i + 1 >= len(words) or kinds[i + 1] != "STRING":
                return False
            i += 2
        elif kinds[i] in _NAME_TOKENS or kinds[i] in ("DOT", "COMMA", "NUMBER") or words[i] in (
                "FROM", "IN", "LIMIT", "OFFSET"):
            i += 1
        else:
            return False
    return True


# First words of the parts of a compound statement (BEGIN NOT ATOMIC … END, IF, loops, CASE, handlers,
# cursors), and of statements that run SQL the text does not hold or change the privileges of the session.
_NEVER_KNOWN = frozenset({
    "IF", "ELSEIF", "ELSE", "WHILE", "LOOP", "REPEAT", "UNTIL", "CASE", "WHEN", "FOR", "END", "DECLARE", "LEAVE",
    "ITERATE", "OPEN", "FETCH", "CLOSE", "RETURN", "SIGNAL", "RESIGNAL", "GET",
    "EXECUTE", "PREPARE", "DEALLOCATE", "CALL",
})


def _never_known(text: str) -> bool:
    """Whether a statement is one whose effect the classifier never claims to know, whatever the parser
    makes of it: a part of a compound statement (`BEGIN NOT ATOMIC`, a label, `IF`, `WHILE`, `DECLARE`,
    …), dynamic SQL (`EXECUTE [IMMEDIATE]`, `PREPARE`, `DEALLOCATE`), `CALL`, a role switch (`SET
    [DEFAULT] ROLE`)."""
    tokens = _tokens(text)
    if not tokens:
        return False
    words = [t.text.upper() if t.token_type.name not in ("IDENTIFIER", "STRING") else "" for t in tokens[:4]]
    if words[0] in _NEVER_KNOWN or words[:2] == ["BEGIN", "NOT"] or words[:2] == ["DROP", "PREPARE"]:
        return True
    if len(tokens) > 1 and tokens[0].token_type.name in _NAME_TOKENS and tokens[1].token_type.name == "COLON":
        return True  # `label: BEGIN …`, `label: LOOP …`
    return words[0] == "SET" and "ROLE" in words[1:3]


def _classify_statement(tree: exp.Expr, text: str, case_sensitive: bool) -> Verdict | None:
    """(operation, tables) of one parsed statement, or None when it cannot be trusted."""
    from sqlglot import exp
    read_roots, write_roots, ddl_roots, not_read_nodes = _roots()
    if isinstance(tree, exp.Show) or (isinstance(tree, exp.Command) and str(tree.this).upper() == "SHOW"):
        return _classify_show(text, tree, case_sensitive)
    if isinstance(tree, exp.Describe):
        inner = tree.this
        if isinstance(inner, exp.Table) and not list(tree.find_all(*not_read_nodes)):
            return READ, {META}  # DESCRIBE t: the columns of a table, its schema only
        # EXPLAIN <statement>: EXPLAIN ANALYZE runs it, and EXPLAIN may run subqueries: judge the statement.
        return _classify_statement(inner, "", case_sensitive) if isinstance(inner, exp.Expression) else None
    nodes = list(tree.walk())  # one walk, read by every check below
    if any(isinstance(t, exp.Table) and isinstance(t.this, exp.Identifier) and not t.this.quoted
           and t.name.upper() in _ALL_MODIFIERS for t in nodes):
        return None  # a modifier the parser took for a table: do not trust the names it found
    if any(isinstance(n, exp.Command) for n in nodes):
        return None
    tables = _tables(tree, case_sensitive, nodes)
    if isinstance(tree, exp.Drop) and str(tree.args.get("kind") or "").upper() == "INDEX":
        on = tree.args.get("cluster")  # DROP INDEX i ON t: `i` names an index, `t` the table
        if not (isinstance(on, exp.OnProperty) and isinstance(on.this, exp.Table)):
            return None
        tables = _tables(on, case_sensitive)
    if isinstance(tree, ddl_roots):
        kind = "TABLE" if isinstance(tree, exp.TruncateTable) else str(tree.args.get("kind") or "").upper()
        if kind not in _TABLE_OBJECTS:
            return DDL, {ANY_TABLE}  # its name is no table's; what it may touch is unknown
        elsewhere = _risky_call(nodes) or _reaches_elsewhere(nodes)
        return (DDL, tables | ({ANY_TABLE} if elsewhere else set())) if tables else None
    if _risky_call(nodes):
        return WRITE, tables | {ANY_TABLE}
    if isinstance(tree, read_roots) and not any(isinstance(n, not_read_nodes) for n in nodes):
        return READ, tables or {META}
    if isinstance(tree, (*read_roots, *write_roots)):
        if any(isinstance(n, ddl_roots) for n in nodes):
            return None
        return (WRITE, tables) if tables else None
    return None


def classify_sql(sql: Any, *, case_sensitive: bool = False) -> tuple[str, frozenset[str]]:
    """(operation, gate keys) of a SQL string: MySQL dialect, statement by statement, fail closed.

    A plain read (SELECT/UNION without INTO, locks or side-effect functions) is a read of its
    tables (`__meta__` when it touches none). INSERT/UPDATE/DELETE are writes; CREATE/DROP/ALTER/
    TRUNCATE/RENAME are `ddl`. A statement that does not parse, or whose effect cannot be known
    (CALL, SET, GRANT, EXECUTE, a compound statement, …) is `ddl` on `*`, meaning any table. An
    executable comment is classified as the SQL the server runs (every reading of it). The
    operation of a batch is its strongest statement's; its keys are all of theirs.
    """
    if not isinstance(sql, str) or not sql.strip():
        return DDL, frozenset({ANY_TABLE})
    try:
        return _classify(sql, case_sensitive)
    except Exception:  # a parser bug must not open a gate (nor crash the turn)
        logger.warning("SQL classification failed; treating it as DDL on any table", exc_info=True)
        return DDL, frozenset({ANY_TABLE})


def _classify(sql: str, case_sensitive: bool) -> tuple[str, frozenset[str]]:
    readings = server_readings(sql)
    if readings is None:
        return DDL, frozenset(_guess_tables(sql, case_sensitive) | {ANY_TABLE})
    if readings == [sql]:
        return _classify_text(sql, case_sensitive)
    # What the server runs: the readings of the whole text, and of each statement as split_statements cuts
    # it (each is sent on its own); a statement that the server would read as several is unknown.
    # A reading of nothing (a comment that does not run) adds nothing, unless nothing else is read.
    verdicts = [_classify_text(text, case_sensitive) for text in readings if text.strip() or not any(readings)]
    pieces = split_statements(sql)
    for piece in pieces:
        piece_readings = server_readings(piece) if len(pieces) > 1 else readings
        if piece_readings is None:
            verdicts.append((DDL, frozenset(_guess_tables(piece, case_sensitive) | {ANY_TABLE})))
            continue
        if len(pieces) > 1:
            verdicts.extend(_classify_text(text, case_sensitive) for text in piece_readings)
        if any(len(split_statements(text)) > 1 for text in piece_readings):
            verdicts.append((DDL, frozenset({ANY_TABLE})))  # one statement for the splitter, several for the server
    return strongest(v[0] for v in verdicts), frozenset().union(*(v[1] for v in verdicts))


def _classify_text(sql: str, case_sensitive: bool) -> tuple[str, frozenset[str]]:
    """(operation, keys) of text with no executable comment left in its code, statement by statement."""
    from sqlglot import exp
    statements = split_statements(sql) if ";" in sql else [sql.strip()]  # no ';': one statement, no second pass
    ops, tables, unknown = [], set(), not statements
    for text in statements:
        never = _never_known(text)
        tree = None if never else _parse(text)
        if never:
            verdict = None
        elif tree is not None:
            verdict = _classify_statement(tree, text, case_sensitive)
        else:  # SHOW forms sqlglot does not know are judged from their words
            verdict = _classify_show(text, None, case_sensitive)
        if verdict is None:
            unknown = True
            tables |= _guess_tables(text, case_sensitive)
            if tree is not None and not isinstance(tree, exp.Use):  # USE names a database, not a table
                tables |= _tables(tree, case_sensitive)
            continue
        ops.append(verdict[0])
        tables |= verdict[1]
    if unknown:
        return DDL, frozenset(tables | {ANY_TABLE})
    return strongest(ops), frozenset(tables)


def _parse(text: str) -> exp.Expr | None:
    """The tree of one statement's text (its modifiers dropped), or None when it is not one that parses."""
    import sqlglot
    from sqlglot.errors import SqlglotError
    try:
        trees = [t for t in sqlglot.parse(_without_modifiers(text), read="mysql") if t is not None]
    except (SqlglotError, RecursionError, ValueError):  # does not parse: fail closed
        return None
    return trees[0] if len(trees) == 1 else None
