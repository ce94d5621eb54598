"""sql.py: the exact (operation, gate keys) of every statement of both corpora, case rules, typed shapes."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import sql
from sql_shape import sql_shape
from tests.sql_attack_corpus import ROLE_SWITCHES
from tests.sql_cases import SQL_CORPUS
from tests.sql_corpus import ATTACKS, CASE_SENSITIVE


@pytest.mark.parametrize(("text", "operation", "tables"), SQL_CORPUS, ids=[c[0][:50] for c in SQL_CORPUS])
def test_sql_classification(text: str, operation: str, tables: set[str]) -> None:
    assert sql.classify_sql(text) == (operation, frozenset(tables))


@pytest.mark.parametrize(("text", "operation", "tables"), ATTACKS, ids=[c[0][:60] for c in ATTACKS])
def test_the_exact_keys_of_every_crafted_statement(text: str, operation: str, tables: set[str]) -> None:
    assert sql.classify_sql(text) == (operation, frozenset(tables))


@pytest.mark.parametrize(("text", "operation", "tables"), CASE_SENSITIVE, ids=[c[0][:60] for c in CASE_SENSITIVE])
def test_keys_keep_the_case_a_case_sensitive_server_tells_apart(text: str, operation: str, tables: set[str]) -> None:
    assert sql.classify_sql(text, case_sensitive=True) == (operation, frozenset(tables))
    # The same statement on a server that ignores case: the same keys, lower-cased.
    op, keys = sql.classify_sql(text, case_sensitive=False)
    assert op == operation and keys <= {k.lower() for k in tables} and all(k == k.lower() for k in keys)


def test_the_corpora_hold_every_kind_the_issue_lists() -> None:
    assert len(ATTACKS) + len(CASE_SENSITIVE) >= 130
    show_where = [s for s, _, k in ATTACKS if s.startswith("SHOW") and " WHERE " in s and "secrets" in k]
    assert len({s.split(" WHERE ")[0] for s in show_where}) >= 12


def test_a_batch_is_its_strongest_statement() -> None:
    assert sql.classify_sql("SELECT * FROM a; UPDATE b SET x = 1") == ("write", frozenset({"a", "b"}))
    assert sql.classify_sql("SELECT * FROM a; UPDATE b SET x = 1; TRUNCATE c") == ("ddl", frozenset({"a", "b", "c"}))
    assert sql.strongest(["read", "write"]) == "write" and sql.strongest(["read", "nonsense"]) == "ddl"


def test_sql_parsed_as_an_opaque_command_is_not_quoted_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        assert sql.classify_sql("LOCK TABLES secret_salaries WRITE")[0] == "ddl"
    assert "secret_salaries" not in caplog.text


def test_sql_too_deep_to_parse_fails_closed() -> None:
    assert sql.classify_sql("SELECT " + "(" * 3000 + "1" + ")" * 3000 + " FROM users") == (
        "ddl", frozenset({"*", "users"}))


@pytest.mark.parametrize("value", [None, 42, ["SELECT 1"]])
def test_sql_that_is_not_text_is_ddl_on_any_table(value: Any) -> None:
    assert sql.classify_sql(value) == ("ddl", frozenset({"*"}))


def test_system_keys_and_table_keys() -> None:
    assert sql.is_system_key("mysql.user") and sql.is_system_key("MYSQL.user") and sql.is_system_key(
        "information_schema.processlist")
    assert not sql.is_system_key("users") and not sql.is_system_key("shop.mysql")
    assert sql.table_key("Users", "Shop", case_sensitive=True) == "Shop.Users"
    assert sql.table_key("Users", "Shop") == "shop.users"
    assert sql.table_key("TABLES", "INFORMATION_SCHEMA", case_sensitive=True) == "information_schema.tables"
    assert sql.ASSUMED_SQL_MODE_OFF == ("NO_BACKSLASH_ESCAPES", "ANSI_QUOTES")
    assert not sql.is_system_key(sql.table_key("mysql.user"))  # a table named so, in the current schema


# ── Shapes ──────────────────────────────────────────────────────────────────────────────────

GRANTED = "DELETE FROM users WHERE name = 'nobody'"


@pytest.mark.parametrize("other", [
    "DELETE FROM users WHERE name = 0",  # MariaDB compares 0 true with every non-numeric name
    "DELETE FROM users WHERE name = NULL",
    "DELETE FROM users WHERE name = 0x41",
    "DELETE FROM users WHERE name = X'41'",
    "DELETE FROM users WHERE name = b'1'",
    "DELETE FROM users WHERE name = TRUE",
    "DELETE FROM users WHERE name = @v",
    "DELETE FROM users WHERE name = name",
    "DELETE FROM users WHERE name = LOWER(name)",
    "DELETE FROM users WHERE name = N'x'",
    "DELETE FROM users WHERE name = -1",
    "DELETE FROM users WHERE name = 'x' OR 1 = 1",
    "DELETE FROM users WHERE name = 'x'; DELETE FROM users",
    "DELETE FROM users WHERE name = 'x' /*!50000 OR 1 = 1 */",
    "DELETE FROM `users` WHERE name = 'x'",
    "DELETE FROM Users WHERE name = 'x'",
])
def test_a_string_shape_never_matches_another_type_or_statement(other: str) -> None:
    assert sql_shape(GRANTED) == "DELETE FROM users WHERE name = ?s"
    assert sql_shape(other) != sql_shape(GRANTED)


@pytest.mark.parametrize("same", [
    "delete from users where name = 'somebody else'",
    "DELETE   FROM users\n WHERE name = \"x\"",  # "…" is a string in MySQL's default mode
    "DELETE FROM users /* why */ WHERE name = 'x' -- done",
    "DELETE FROM users WHERE name = 'x\\' OR 1 = 1 -- '",  # one string (backslash escapes on)
])
def test_a_shape_ignores_values_of_the_same_type_comments_and_layout(same: str) -> None:
    assert sql_shape(same) == sql_shape(GRANTED)


@pytest.mark.parametrize(("granted", "other"), [
    ("SELECT * FROM t LIMIT 1", "SELECT * FROM t LIMIT 1000000"),
    ("DELETE FROM t WHERE a = 1 LIMIT 1", "DELETE FROM t WHERE a = 1 LIMIT 100"),
    ("SELECT * FROM t LIMIT 0, 1", "SELECT * FROM t LIMIT 0, 100"),
    ("SELECT * FROM t LIMIT 1 OFFSET 0", "SELECT * FROM t LIMIT 1 OFFSET 5"),
    ("SELECT * FROM t WHERE a IN (1)", "SELECT * FROM t WHERE a IN (1, 2)"),
    ("DELETE FROM t WHERE a LIKE 'x'", "DELETE FROM t WHERE a LIKE '%'"),
    ("DELETE FROM t WHERE a LIKE 'x'", "DELETE FROM t WHERE a LIKE 'x_'"),
    ("DELETE FROM t WHERE a REGEXP 'x'", "DELETE FROM t WHERE a REGEXP '.*'"),
    ("SELECT a FROM t ORDER BY 1", "SELECT a FROM t ORDER BY 2"),
    ("DELETE FROM t WHERE d < NOW() - INTERVAL 1 DAY", "DELETE FROM t WHERE d < NOW() - INTERVAL 1000 DAY"),
])
def test_values_that_change_how_much_a_statement_touches_stay_in_the_shape(granted: str, other: str) -> None:
    assert sql_shape(granted) and sql_shape(granted) != sql_shape(other)


@pytest.mark.parametrize("text", ["SELECT 1; SELECT 2", "SELEC 1", "", "SELECT 1 /*M! , 2 */", None,
                                  "CALL p('x')", "REPLACE INTO users VALUES (1)"])
def test_no_shape_for_what_is_not_exactly_one_statement_that_parses(text: Any) -> None:
    assert sql_shape(text) == ""


def test_split_statements_keeps_each_statements_text() -> None:
    assert sql.split_statements("SELECT ';'; /* c */ ; SELECT 2;") == ["SELECT ';'", "SELECT 2"]
    assert sql.split_statements("/*!40101 SET x = 1 */") == ["/*!40101 SET x = 1 */"]


@pytest.mark.parametrize(("granted", "other"), [
    ("DELETE FROM users WHERE INSTR(name, 'nobody') > 0", "DELETE FROM users WHERE INSTR(name, '') > 0"),
    ("DELETE FROM users WHERE REGEXP_LIKE(name, 'nobody')", "DELETE FROM users WHERE REGEXP_LIKE(name, '.*')"),
    ("DELETE FROM users WHERE name LIKE CONCAT('no', 'body')", "DELETE FROM users WHERE name LIKE CONCAT('%', '')"),
    ("DELETE FROM users WHERE name = LOWER('X')", "DELETE FROM users WHERE name = LOWER(name)"),
    ("DELETE FROM users WHERE name = 'nobody'", "DELETE FROM users WHERE name = 'nob_dy'"),
])
def test_function_arguments_and_wildcards_stay_as_written(granted: str, other: str) -> None:
    assert sql_shape(granted) and sql_shape(granted) != sql_shape(other)


def test_lists_subqueries_and_groups_still_generalise() -> None:
    assert sql_shape("INSERT INTO users (name, a) VALUES ('x', 5)") == (
        "INSERT INTO users ( name , a ) VALUES ( ?s , ?n )")
    assert sql_shape("SELECT * FROM t WHERE (a = 1 OR b = 'x') AND c IN (SELECT d FROM e WHERE f = 2)") == (
        "SELECT * FROM t WHERE ( a = ?n OR b = ?s ) AND c IN ( SELECT d FROM e WHERE f = ?n )")


# ── Executable comments and compound statements (issue 39) ──


@pytest.mark.parametrize(("text", "readings"), [
    # no version: runs on every server; a version: once run, once skipped (the server's version is unknown)
    ("SELECT * FROM users /*!, secrets */", ["SELECT * FROM users  , secrets  "]),
    ("SELECT * FROM users /*!100400 , secrets */", ["SELECT * FROM users  ", "SELECT * FROM users   , secrets  "]),
    ("SELECT 1 /*!50701 , 2 */", ["SELECT 1  ", "SELECT 1   , 2  "]),  # MariaDB skips it, MySQL runs it
    ("SELECT * FROM users /*M!, secrets */", ["SELECT * FROM users  , secrets  ", "SELECT * FROM users  "]),
    # a string holding */ does not end the comment; a line comment does hide one
    ("SELECT 1 /*! , '*/' */", ["SELECT 1   , '*/'  "]),
    ("SELECT 1 /*! # */\n */", ["SELECT 1   # */\n  "]),
    ("SELECT 1 /*! , 2 /* plain */ */", ["SELECT 1   , 2 /* plain */  "]),
    # `--` before a character beyond ASCII is code for MariaDB: kept from reading as a comment
    ("SELECT a FROM t WHERE 1 --\u00a0x", ["SELECT a FROM t WHERE 1 - -\u00a0x"]),
    # … and neither does a marker read away right after `--` (MariaDB: `1 - - 1 UNION …`)
    ("SELECT a FROM users WHERE a = 1 --/*!*/1 UNION SELECT a FROM secrets",
     ["SELECT a FROM users WHERE a = 1 - -  1 UNION SELECT a FROM secrets"]),
])
def test_the_readings_of_an_executable_comment_follow_the_server(text: str, readings: list[str]) -> None:
    assert sql.server_readings(text) == readings


@pytest.mark.parametrize("text", [
    "SELECT '/*!, secrets */'", 'SELECT "/*!, secrets */"', "SELECT `/*!x` FROM t", "SELECT 1 -- /*!, secrets */",
    "SELECT 1 # /*!, secrets */", "SELECT 1 /* /*!, secrets */", "SELECT /*+ BKA(t) */ a FROM t", "SELECT 1 --1",
])
def test_text_with_no_executable_comment_in_its_code_is_read_as_written(text: str) -> None:
    assert sql.server_readings(text) == [text]
    assert sql.classify_sql(text) == sql._classify_text(text, False)  # classified exactly as before issue 39


@pytest.mark.parametrize("text", [
    "SELECT 1 /*! , 2", "SELECT 1 /*! , 2 /* */", "SELECT 1 /*!999999 , 2", "SELECT 1 /*! , 'x */",
    "SELECT 1 /*m! , 2 */", "SELECT 1 /*!!100000 , 2 */", "SELECT 1 /*M!!100000 , 2 */", "SELECT 1 /*!1*/\x00",
    " ".join(f"SELECT 1 /*!{100000 + i} , {i} */" for i in range(30)),
])
def test_comments_the_classifier_does_not_model_are_refused(text: str) -> None:
    assert sql.server_readings(text) is None
    op, keys = sql.classify_sql(text)
    assert op == "ddl" and "*" in keys


def test_a_hint_and_a_plain_comment_classify_as_before() -> None:
    assert sql.classify_sql("SELECT a /* why */ FROM t -- done") == ("read", frozenset({"t"}))
    assert sql.classify_sql("SELECT /*!STRAIGHT_JOIN*/ a FROM t") == ("read", frozenset({"t"}))
    hint = "SELECT /*+ BKA(t) */ a FROM t"
    assert sql.classify_sql(hint) == sql._classify_text(hint, False)


def test_a_statement_the_server_reads_as_several_is_never_known() -> None:
    # The splitter sees one statement (the ';' is in a comment for sqlglot), the server two: any table.
    assert sql.classify_sql("SELECT 1 /*!; SELECT 2 */") == ("ddl", frozenset({"__meta__", "*"}))
    assert sql.classify_sql("SELECT 1; SELECT 2") == ("read", frozenset({"__meta__"}))


def test_each_statement_the_database_sends_is_classified_on_its_own_too() -> None:
    # database.py sends split_statements' pieces one by one: a piece's readings count even where the whole
    # text reads otherwise (here the whole text's reading hides the UPDATE in a line comment).
    text = "/*! # */ ; UPDATE secrets SET a = 1\n */"
    assert sql.split_statements(text) == ["/*! # */", "UPDATE secrets SET a = 1\n */"]
    op, keys = sql.classify_sql(text)
    assert op == "ddl" and {"secrets", "*"} <= keys


def test_executable_comments_split_and_shape_by_where_they_are() -> None:
    assert sql.split_statements("SELECT 1; # /*! x */") == ["SELECT 1"]  # a line comment: nothing to run
    assert sql.split_statements("SELECT 1; /*! SELECT 2 */") == ["SELECT 1", "/*! SELECT 2 */"]
    assert sql_shape("SELECT * FROM users WHERE note = '/*!x*/'") == "SELECT * FROM users WHERE note = ?s"
    assert sql_shape("SELECT * FROM users WHERE note = 'x' /*! OR 1 = 1 */") == ""
    assert sql_shape("SELECT a FROM t WHERE 1 --\u00a0, 2") == ""  # sqlglot would drop what the server runs


@pytest.mark.parametrize("text", [
    "BEGIN NOT ATOMIC SELECT 1; END", "lbl: BEGIN NOT ATOMIC SELECT 1; END lbl", "IF 1 THEN SELECT 1; END IF",
    "WHILE 0 DO SELECT 1; END WHILE", "REPEAT SELECT 1; UNTIL 1 END REPEAT", "l: LOOP LEAVE l; END LOOP",
    "CASE WHEN 1 THEN SELECT 1; END CASE", "FOR i IN 1..2 DO SELECT 1; END FOR", "DECLARE x INT",
    "EXECUTE IMMEDIATE 'SELECT 1'", "EXECUTE IMMEDIATE ?", "PREPARE s FROM 'SELECT 1'", "EXECUTE s",
    "DEALLOCATE PREPARE s", "DROP PREPARE s", "CALL p()", "SET ROLE r", "SET ROLE NONE", "SET DEFAULT ROLE r",
    "set default role r for u", "/*!BEGIN NOT ATOMIC SELECT 1; END */", "/*M!100000 SET ROLE r */",
])
def test_compound_statements_dynamic_sql_and_role_switches_are_ddl_on_any_table(text: str) -> None:
    # Even when every statement inside is a plain read: what they run, and under which role, is not in the text.
    op, keys = sql.classify_sql(text)
    assert op == "ddl" and "*" in keys


def test_a_compound_statement_is_keyed_by_every_statement_inside() -> None:
    text = "/*!BEGIN NOT ATOMIC SELECT a FROM secrets; UPDATE users SET a = 1; DELETE FROM shop.t; END */"
    assert sql.classify_sql(text) == ("ddl", frozenset({"secrets", "users", "shop.t", "*"}))


@pytest.mark.parametrize("text", ROLE_SWITCHES)
def test_no_role_switch_of_the_issue_is_less_than_ddl_on_any_table(text: str) -> None:
    # The classifier alone must stop these (the database stops them by itself too, see docs/security.md).
    op, keys = sql.classify_sql(text.format(role="amcp_r_0123456789abcdef"))
    assert op == "ddl" and "*" in keys
