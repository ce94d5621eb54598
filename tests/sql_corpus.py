"""Crafted statements of issue 25 with the exact (operation, gate keys) the classifier must give (plain data).

`ATTACKS` holds statements written as an attacker would (CTE names hiding tables in every
scope, SHOW … WHERE subqueries, tables named like keywords, quoting, DDL, locks, sequences):
each with the operation and keys under the default case rule (`case_sensitive=False`).
`CASE_SENSITIVE` holds statements with their keys on a server with `lower_case_table_names=0`.
The tables they name: `users` (allowed in the tests), `secrets` (never allowed), `copy`,
`dual`, `outfile`, `dumpfile`, `seq`, `t` and schema `shop`. Other tests (the database proof
corpus) run the same statements through `db_query`; keep this file data only.
"""

from __future__ import annotations

R, W, D, META, ANY = "read", "write", "ddl", "__meta__", "*"
S = "secrets"
PROCESSLIST = "information_schema.processlist"

# CTE names hide a table only inside the query that defines them: elsewhere the name is the real table.
CTE_SCOPES = [
    ("SELECT (WITH secrets AS (SELECT 1) SELECT 1) AS x, s.* FROM secrets s", R, {S}),
    ("SELECT * FROM secrets WHERE id IN (WITH secrets AS (SELECT 1 AS id) SELECT id FROM secrets)", R, {S}),
    ("SELECT * FROM secrets ORDER BY (WITH secrets AS (SELECT 1) SELECT 1)", R, {S}),
    ("SELECT a FROM secrets GROUP BY a HAVING (WITH secrets AS (SELECT 1) SELECT 1)", R, {S}),
    ("SELECT * FROM (WITH secrets AS (SELECT 1 AS a) SELECT a FROM secrets) d, secrets", R, {S}),
    ("WITH a AS (SELECT * FROM secrets), secrets AS (SELECT 1) SELECT * FROM a", R, {S}),  # second CTE
    ("WITH x AS (WITH secrets AS (SELECT 1) SELECT * FROM secrets) SELECT * FROM x, secrets", R, {S}),
    ("WITH secrets AS (SELECT * FROM secrets) SELECT * FROM secrets", R, {S}),  # not recursive: the table
    ("SELECT * FROM secrets UNION (WITH secrets AS (SELECT 1) SELECT * FROM secrets)", R, {S}),
    ("SELECT 1 WHERE EXISTS (WITH secrets AS (SELECT 1) SELECT 1) AND (SELECT COUNT(*) FROM secrets) > 0", R, {S}),
    ("WITH secrets AS (SELECT 1) SELECT * FROM shop.secrets", R, {"shop.secrets"}),
    # where the CTE is in scope it hides the name (no table is read)
    ("WITH secrets AS (SELECT 1 AS a) SELECT * FROM secrets", R, {META}),
    ("WITH t AS (SELECT 1 AS a) SELECT * FROM users WHERE a IN (SELECT a FROM t)", R, {"users"}),
    ("WITH s AS (SELECT 1 AS a) SELECT * FROM s UNION ALL SELECT * FROM s", R, {META}),
    ("WITH RECURSIVE r AS (SELECT 1 AS n UNION ALL SELECT n + 1 FROM r WHERE n < 3) SELECT * FROM r", R, {META}),
    # statements scope analysis does not cover: write targets are always tables
    ("UPDATE users u JOIN (WITH secrets AS (SELECT 1 AS id) SELECT id FROM secrets) d ON u.id = d.id "
     "JOIN secrets s ON s.id = u.id SET s.a = 1", W, {"users", S}),
    ("UPDATE users SET note = (SELECT note FROM secrets LIMIT 1) "
     "WHERE id IN (WITH secrets AS (SELECT 1 AS id) SELECT id FROM secrets)", W, {"users", S}),
    ("DELETE s FROM secrets s JOIN (WITH secrets AS (SELECT 1 AS id) SELECT id FROM secrets) d ON s.id = d.id",
     W, {"s", S}),  # `s` is an alias the classifier keys too: over-keying is safe
    ("DELETE FROM secrets WHERE id IN (WITH secrets AS (SELECT 1 AS id) SELECT id FROM secrets)", W, {S}),
    ("INSERT INTO users (note) SELECT note FROM secrets WHERE 1 IN (WITH secrets AS (SELECT 1) SELECT 1)",
     W, {"users", S}),
    ("INSERT INTO users SELECT * FROM secrets WHERE EXISTS (WITH secrets AS (SELECT 1) SELECT * FROM secrets)",
     W, {"users", S}),
    ("INSERT INTO users SELECT s.* FROM (WITH secrets AS (SELECT 1) SELECT * FROM secrets) d JOIN secrets s",
     W, {"users", S}),
    ("INSERT INTO users WITH secrets AS (SELECT 1, 1, 'x') SELECT * FROM secrets", W, {"users"}),
    ("CREATE TABLE copy AS SELECT * FROM secrets WHERE EXISTS (WITH secrets AS (SELECT 1) SELECT 1 FROM secrets)",
     D, {"copy", S}),
    ("CREATE TABLE copy AS WITH secrets AS (SELECT 1) SELECT * FROM secrets", D, {"copy"}),
    ("CREATE TEMPORARY TABLE users AS SELECT * FROM secrets", D, {"users", S}),
]

# SHOW … WHERE is classified like a SELECT of its expression; in 12+ forms, also inside a batch.
_SHOW_FORMS = ["TABLES", "FULL TABLES", "DATABASES", "SCHEMAS", "TABLE STATUS", "OPEN TABLES",
               "COLUMNS FROM users", "FULL COLUMNS FROM users", "INDEX FROM users", "VARIABLES",
               "SESSION VARIABLES", "GLOBAL STATUS", "CHARACTER SET", "COLLATION", "TRIGGERS", "EVENTS",
               "PROCEDURE STATUS", "FUNCTION STATUS"]
SHOW_WHERE = [(f"SHOW {form} WHERE (SELECT COUNT(*) FROM secrets) > 0", R, {META, S}) for form in _SHOW_FORMS]
SHOW_WHERE += [
    # error-based reads: unknown functions make it a write on any table as well
    ("SHOW TABLES WHERE extractvalue(1, concat(0x7e, (SELECT note FROM secrets LIMIT 1)))", W, {META, S, ANY}),
    ("SHOW DATABASES WHERE updatexml(1, concat(0x7e, (SELECT note FROM secrets LIMIT 1)), 1)", W, {META, S, ANY}),
    # boolean oracle, and inside a batch
    ("SHOW DATABASES WHERE (SELECT SUBSTR(note, 1, 1) FROM secrets LIMIT 1) = 'a'", R, {META, S}),
    ("SELECT 1; SHOW TABLES WHERE (SELECT 1 FROM secrets LIMIT 1)", R, {META, S}),
    ("SHOW KEYS FROM users WHERE (SELECT COUNT(*) FROM secrets) > 0", D, {"users", S, ANY}),  # not parsed: closed
    ("SHOW TABLES LIKE (SELECT note FROM secrets)", D, {S, ANY}),
    ("SHOW TABLES LIKE 'a' WHERE 1", D, {ANY}),
    # the plain forms stay __meta__
    ("SHOW TABLES WHERE Tables_in_shop = 'users'", R, {META}),
    ("SHOW TABLES LIKE 'u%'", R, {META}),
    ("SHOW TABLES FROM shop LIKE 'u%'", R, {META}),
    ("SHOW COLUMNS FROM users FROM shop LIKE 'a%'", R, {META}),
    ("SHOW CREATE TABLE secrets", R, {META}),
    ("SHOW WARNINGS LIMIT 5", R, {META}),
    ("SHOW GRANTS", R, {META}),
    ("SHOW GRANTS FOR CURRENT_USER()", R, {META}),
    # forms that reveal a system table's contents are keyed like it; unknown forms touch anything
    ("SHOW GRANTS FOR 'root'@'localhost'", R, {"mysql.user"}),
    ("SHOW CREATE PROCEDURE p", R, {"mysql.proc"}),
    ("SHOW PROCESSLIST", R, {PROCESSLIST}),
    ("SHOW FULL PROCESSLIST", R, {PROCESSLIST}),
    ("select * from information_schema.PROCESSLIST", R, {PROCESSLIST}),
    ("SHOW EXPLAIN FOR 1", R, {PROCESSLIST}),
    ("SHOW BINLOG EVENTS", D, {ANY}),
    ("SHOW ENGINE INNODB STATUS", D, {ANY}),
    ("SHOW MASTER STATUS", D, {ANY}),
]

# Tables named like keywords are tables; only the bare keyword of FROM DUAL is none.
KEYWORD_NAMES = [
    ("SELECT * FROM `dual`", R, {"dual"}),
    ("SELECT * FROM `DUAL`", R, {"dual"}),
    ("SELECT * FROM shop.dual", R, {"shop.dual"}),
    ("SELECT * FROM dual d", R, {"dual"}),
    ("SELECT * FROM users JOIN `dual`", R, {"users", "dual"}),
    ("INSERT INTO `dual` VALUES (1)", W, {"dual"}),
    ("SELECT * FROM `outfile`", R, {"outfile"}),
    ("SELECT * FROM shop.outfile", R, {"shop.outfile"}),
    ("SELECT * FROM dumpfile", R, {"dumpfile"}),
    ("SELECT * FROM `dumpfile` WHERE 1", R, {"dumpfile"}),
    ("SELECT * INTO OUTFILE '/tmp/x' FROM outfile", D, {"outfile", ANY}),
    ("SELECT 1 FROM DUAL", R, {META}),
    # names that read like other keys are backquoted in the key
    ("SELECT * FROM `__meta__`", R, {"`__meta__`"}),
    ("SELECT * FROM `*`", R, {"`*`"}),
    ("SELECT * FROM `shop.users`", R, {"`shop.users`"}),
    ("SELECT * FROM `mysql.user`", R, {"`mysql.user`"}),
]

# The classifier parses with backslash escapes on and `"` as a string (connections pin that sql_mode).
QUOTING = [
    ("SELECT * FROM users WHERE note = 'x\\' UNION SELECT * FROM secrets -- '", R, {"users"}),
    ('SELECT * FROM users WHERE note = "x\\" UNION SELECT * FROM secrets -- "', R, {"users"}),
    ("DELETE FROM users WHERE note = 'nobody\\' OR 1=1 -- '", W, {"users"}),
    ('SELECT "secrets"', R, {META}),
]

# Other forms: EXPLAIN/DESCRIBE, HANDLER, INTO @var, locks, PROCEDURE ANALYSE, TABLE, VALUES, windows, sequences.
OTHER_FORMS = [
    ("EXPLAIN SELECT * FROM secrets", R, {S}),
    ("EXPLAIN EXTENDED SELECT * FROM secrets", R, {S}),
    ("EXPLAIN FORMAT=JSON SELECT * FROM secrets", R, {S}),
    ("EXPLAIN DELETE FROM secrets", W, {S}),
    ("ANALYZE SELECT * FROM secrets", D, {S, ANY}),
    ("ANALYZE FORMAT=JSON DELETE FROM secrets", D, {S, ANY}),
    ("DESCRIBE secrets", R, {META}),
    ("EXPLAIN secrets", R, {META}),
    ("DESCRIBE secrets note", D, {ANY}),
    ("HANDLER secrets OPEN", D, {S, ANY}),
    ("HANDLER secrets READ FIRST", D, {S, ANY}),
    ("SELECT note INTO @x FROM secrets", W, {S}),
    ("SELECT * FROM secrets FOR UPDATE", W, {S}),
    ("SELECT * FROM secrets LOCK IN SHARE MODE", W, {S}),
    ("SELECT * FROM secrets PROCEDURE ANALYSE()", D, {S, ANY}),
    ("TABLE secrets", R, {S}),
    ("VALUES (1), (2)", D, {ANY}),
    ("SELECT a, ROW_NUMBER() OVER (PARTITION BY a ORDER BY id) FROM t", R, {"t"}),
    ("SELECT SUM(a) OVER w FROM t WINDOW w AS (ORDER BY id)", R, {"t"}),
    ("SELECT NEXTVAL(seq)", W, {ANY}),
    ("SELECT NEXT VALUE FOR seq", D, {ANY}),
    ("SELECT PREVIOUS VALUE FOR seq", D, {ANY}),
    ("SELECT SETVAL(seq, 100)", W, {ANY}),
    ("SELECT LASTVAL(seq)", W, {ANY}),
    ("SELECT * FROM seq", R, {"seq"}),
    ("SELECT @v := note FROM secrets", R, {S}),
]

# DDL is its own operation: CREATE, DROP, ALTER, RENAME, TRUNCATE (tables, indexes, sequences keyed by name).
DDL_FORMS = [
    ("CREATE SEQUENCE seq", D, {"seq"}),
    ("DROP SEQUENCE seq", D, {"seq"}),
    ("ALTER SEQUENCE seq RESTART", D, {ANY}),
    ("RENAME TABLE users TO u2", D, {"users", "u2", ANY}),
    ("ALTER TABLE users RENAME TO u2", D, {"users", "u2"}),
    ("CREATE TABLE t2 LIKE secrets", D, {"t2", S}),
    ("DROP TEMPORARY TABLE t", D, {"t"}),
    ("CREATE OR REPLACE TABLE users (a INT)", D, {"users"}),
    ("TRUNCATE users", D, {"users"}),
    ("TRUNCATE TABLE users", D, {"users"}),
    ("DROP TABLE users", D, {"users"}),
    ("ALTER TABLE users ADD b INT", D, {"users"}),
    ("OPTIMIZE TABLE users", D, {"users", ANY}),
    ("ANALYZE TABLE users", D, {"users", ANY}),
    ("CREATE INDEX ix ON users (a)", D, {"users"}),
    ("DROP INDEX ix ON users", D, {"users"}),
    ("SELECT * FROM users; DROP TABLE users", D, {"users"}),
    ("CREATE VIEW v AS SELECT * FROM secrets", D, {ANY}),
]

ATTACKS = CTE_SCOPES + SHOW_WHERE + KEYWORD_NAMES + QUOTING + OTHER_FORMS + DDL_FORMS

# On a server that tells names apart by case (lower_case_table_names=0): names keep their case;
# information_schema is case-insensitive everywhere and always lower-cased.
CASE_SENSITIVE = [
    ("SELECT * FROM Users", R, {"Users"}),
    ("SELECT * FROM users JOIN Users", R, {"users", "Users"}),
    ("SELECT * FROM Shop.Users", R, {"Shop.Users"}),
    ("UPDATE USERS SET a = 1", W, {"USERS"}),
    ("DROP TABLE Users", D, {"Users"}),
    ("SELECT * FROM INFORMATION_SCHEMA.PROCESSLIST", R, {PROCESSLIST}),
    ("SHOW PROCESSLIST", R, {PROCESSLIST}),
    ("WITH Secrets AS (SELECT 1) SELECT * FROM secrets", R, {"secrets"}),
    ("SELECT * FROM `Secrets` s WHERE s.a IN (SELECT a FROM secrets)", R, {"Secrets", "secrets"}),
]
