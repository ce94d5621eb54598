"""Crafted statements of issue 25 with the exact (operation, gate keys) the classifier must give (plain data).

`ATTACKS` holds statements written as an attacker would (CTE names hiding tables in every
scope, SHOW … WHERE subqueries, tables named like keywords, quoting, DDL, locks, sequences;
executable comments and compound statements of issue 39):
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
    ("SELECT * FROM secrets UNION (WITH secrets AS (SELECT 1) SELECT * FROM secrets)", R, {S}),  # not MariaDB's
    ("SELECT note FROM secrets UNION SELECT a FROM (WITH secrets AS (SELECT 1 AS a) SELECT a FROM secrets) d", R, {S}),
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
    ("INSERT INTO users (id, note) SELECT id + 100, note FROM secrets WHERE 1 IN (WITH secrets AS (SELECT 1) "
     "SELECT 1)", W, {"users", S}),
    ("INSERT INTO users (id, note) SELECT id + 200, note FROM secrets "
     "WHERE EXISTS (WITH secrets AS (SELECT 1) SELECT * FROM secrets)", W, {"users", S}),
    ("INSERT INTO users (id, note) SELECT s.id + 300, s.note FROM (WITH secrets AS (SELECT 1) SELECT * FROM secrets) d "
     "JOIN secrets s", W, {"users", S}),
    ("INSERT INTO users (id, note) WITH secrets AS (SELECT 400 AS id, 'x' AS note) SELECT * FROM secrets",
     W, {"users"}),
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
    ("SELECT * FROM dual d", R, {"dual"}),  # MariaDB refuses it; keyed all the same
    ("SELECT * FROM users JOIN `dual`", R, {"users", "dual"}),
    ("INSERT INTO `dual` (id) VALUES (7)", W, {"dual"}),
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
    ("CREATE TABLE t2 (a INT) SELECT * FROM secrets", D, {"t2", S}),
    ("CREATE TABLE t2 (a INT, FOREIGN KEY (a) REFERENCES secrets (id))", D, {"t2", S}),
    ("CREATE TABLE t2 (a INT) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4", D, {"t2"}),
    # engines and options that make a table a window on other tables or servers: any table
    ("CREATE TABLE t2 ENGINE=CONNECT TABLE_TYPE=MYSQL CONNECTION='mysql://root@127.0.0.1/shop/secrets'",
     D, {"t2", ANY}),
    ("ALTER TABLE t ENGINE=FEDERATED CONNECTION='mysql://root@127.0.0.1/shop/secrets'", D, {"t", ANY}),
    ("CREATE TABLE t2 (a INT) ENGINE=SPIDER COMMENT='wrapper \"mysql\", table \"secrets\"'", D, {"t2", ANY}),
    ("CREATE TABLE t2 (note VARCHAR(20)) ENGINE=MERGE UNION=(secrets)", D, {"t2", ANY}),
]

# Executable comments (issue 39): the server runs their text, so it is classified as the SQL it is, in every
# reading the server may make of it (its version is unknown: a versioned comment is read run and not run).
EXECUTABLE = [
    ("SELECT * FROM users /*!, secrets */", R, {"users", S}),
    ("SELECT * FROM users/*!,secrets*/", R, {"users", S}),  # no space after the marker
    ("SELECT * FROM users /*!50000 , secrets */", R, {"users", S}),  # 5 digits: runs on every MariaDB
    ("SELECT * FROM users /*!100400 , secrets */", R, {"users", S}),  # 6 digits
    ("SELECT * FROM users /*!999999 , secrets */", R, {"users", S}),  # a version above the server's: may run
    ("SELECT * FROM users /*!50700 , secrets */", R, {"users", S}),  # MariaDB skips it, MySQL runs it
    ("SELECT * FROM users /*!10000a , secrets */", R, {"users", S}),  # `a` is code (an alias)
    ("SELECT * FROM users /*M!, secrets */", R, {"users", S}),
    ("SELECT * FROM users /*M!50700 , secrets */", R, {"users", S}),  # MariaDB's own: runs
    ("SELECT * FROM users /*M!100000 , secrets */", R, {"users", S}),
    ("SELECT * FROM users /*M!999999 , secrets */", R, {"users", S}),
    ("SELECT * FROM users /*! , secrets /* one plain comment nests */ */", R, {"users", S}),
    ("SELECT * FROM users /*!999999 , t /* nested */ */ , secrets", R, {"users", "t", S}),
    ("SELECT * FROM users /* a */ /*! , secrets */ /* b */", R, {"users", S}),
    # a string or a quoted name inside the comment may hold */: the comment goes on
    ("SELECT * FROM users /*! WHERE note = '*/' UNION SELECT * FROM secrets */", R, {"users", S}),
    ('SELECT * FROM users /*! WHERE note = "*/" UNION SELECT * FROM secrets */', R, {"users", S}),
    ("SELECT * FROM users /*! , `x*/y` */", R, {"users", "x*/y"}),
    # a line comment inside it hides its */ up to the end of the line
    ("SELECT * FROM users /*! WHERE 1 # */ UNION SELECT * FROM secrets\n */", R, {"users"}),
    ("SELECT * FROM users /*! WHERE 1 -- */ UNION SELECT * FROM secrets\n */", R, {"users"}),
    ("/*!SELECT * FROM secrets*/", R, {S}),
    ("/*!UPDATE secrets SET a = 1*/", W, {S}),
    ("/*M!100000 DELETE FROM secrets */", W, {S}),
    ("/*!999999 DELETE FROM secrets */", W, {S}),
    ("SELECT /*!STRAIGHT_JOIN*/ * FROM users", R, {"users"}),
    ("/*!40101 SET NAMES utf8mb4 */", D, {ANY}),
    # not executable: in a string, a quoted name, a line comment, a plain comment
    ("SELECT * FROM users WHERE note = '/*!, secrets */'", R, {"users"}),
    ('SELECT * FROM users WHERE note = "/*!, secrets */"', R, {"users"}),
    ("SELECT * FROM `users/*!` WHERE 1", R, {"users/*!"}),
    ("SELECT * FROM users -- /*! , secrets */", R, {"users"}),
    ("SELECT * FROM users # /*! , secrets */", R, {"users"}),
    ("SELECT * FROM users /* /*! , secrets */", R, {"users"}),  # a plain comment ends at the first */
    ("SELECT * FROM users /* x /*! , secrets */ */", D, {ANY}),  # … and the rest is a syntax error
    ("SELECT * FROM users /* x /* y */ UNION SELECT * FROM secrets -- */", R, {"users", S}),  # no nesting
    ("SELECT * FROM users /*/ UNION SELECT * FROM secrets */", R, {"users"}),  # /*/ opens, it does not close
    # refused: one statement for the splitter but several for the server, left open, forms read differently
    ("SELECT 1 /*!; UPDATE secrets SET a = 1 */", D, {META, S, ANY}),
    ("/*!SELECT 1; UPDATE secrets SET a = 1 */", D, {META, S, ANY}),
    ("SELECT * FROM users /*! , secrets", D, {"users", ANY}),
    ("SELECT * FROM users /*! , secrets /* */", D, {ANY}),
    ("SELECT * FROM users /*! /*!999999 , t */ , secrets */", D, {"users", S, ANY}),  # where it runs: */ */
    ("SELECT * FROM users /*m!100000 , secrets */", D, {"users", ANY}),
    ("SELECT * FROM users /*!!100000 , secrets */", D, {"users", ANY}),
    ("SELECT * FROM users /*M!!100000 , secrets */", D, {"users", ANY}),
    ("SELECT * FROM users /*!1000000 , secrets */", D, {"users", ANY}),  # 6 digits, then `0` is code
    ("SELECT * FROM users WHERE 1 --\u00a0, (SELECT 1)\n", D, {"users", ANY}),  # `--` + no space: no comment
    ("SELECT note FROM users WHERE a = 1 --/*!*/1 UNION SELECT note FROM secrets", R, {"users", S}),  # 1 - - 1
]

# Compound statements, dynamic SQL and role switches (issue 39): keyed by every statement inside, never known.
COMPOUND = [
    ("/*!BEGIN NOT ATOMIC SET ROLE r1; SELECT a FROM secrets LIMIT 1; END */", D, {S, ANY}),
    ("/*!BEGIN NOT ATOMIC SET ROLE r1; UPDATE secrets SET a = 1; END */", D, {S, ANY}),
    ("/*M!100000 BEGIN NOT ATOMIC SET ROLE r1; SELECT a FROM secrets LIMIT 1; END */", D, {S, ANY}),
    ("/*!BEGIN NOT ATOMIC EXECUTE IMMEDIATE 'SET ROLE r1'; SELECT a FROM secrets LIMIT 1; END */", D, {S, ANY}),
    ("/*!BEGIN NOT ATOMIC SELECT a FROM users; END */", D, {"users", ANY}),
    ("/*!IF 1 THEN UPDATE secrets SET a = 1; END IF */", D, {S, ANY}),
    ("/*!WHILE (SELECT a FROM secrets) = 42 DO UPDATE users SET a = 7; END WHILE */", D, {S, "users", ANY}),
    ("/*!REPEAT UPDATE users SET a = a + 1; UNTIL 1 END REPEAT */", D, {"users", ANY}),
    ("/*!CASE WHEN 1 THEN SELECT * FROM secrets; END CASE */", D, {S, ANY}),
    ("/*!l1: LOOP SELECT * FROM secrets; LEAVE l1; END LOOP l1 */", D, {S, ANY}),
    ("/*!BEGIN NOT ATOMIC DECLARE c CURSOR FOR SELECT a FROM secrets; OPEN c; END */", D, {S, ANY}),
    ("/*!FOR r IN (SELECT a FROM secrets) DO SELECT 1; END FOR */", D, {S, ANY}),
    ("BEGIN NOT ATOMIC SELECT a FROM secrets; END", D, {S, ANY}),
    ("IF 1 THEN SELECT a FROM secrets; END IF", D, {S, ANY}),
    ("EXECUTE IMMEDIATE 'SELECT a FROM secrets'", D, {ANY}),
    ("EXECUTE IMMEDIATE @q", D, {ANY}),
    ("EXECUTE IMMEDIATE CONCAT('SELECT a FROM ', 'secrets')", D, {ANY}),
    ("PREPARE s FROM 'SELECT a FROM secrets'", D, {ANY}),
    ("PREPARE s FROM @q", D, {ANY}),
    ("EXECUTE s", D, {ANY}),
    ("EXECUTE s USING @a", D, {ANY}),
    ("DEALLOCATE PREPARE s", D, {ANY}),
    ("DROP PREPARE s", D, {ANY}),
    ("CALL p()", D, {ANY}),
    ("SET ROLE r1", D, {ANY}),
    ("SET ROLE NONE", D, {ANY}),
    ("SET DEFAULT ROLE r1", D, {ANY}),
    ("SET DEFAULT ROLE r1 FOR u", D, {ANY}),
    ("GRANT r1 TO CURRENT_USER", D, {ANY}),
    ("CREATE PROCEDURE p() BEGIN SELECT a FROM secrets; END", D, {ANY}),
    ("CREATE FUNCTION f() RETURNS INT RETURN (SELECT COUNT(*) FROM secrets)", D, {ANY}),
    ("CREATE EVENT e ON SCHEDULE EVERY 1 DAY DO DELETE FROM secrets", D, {S, ANY}),
]

ATTACKS = CTE_SCOPES + SHOW_WHERE + KEYWORD_NAMES + QUOTING + OTHER_FORMS + DDL_FORMS + EXECUTABLE + COMPOUND

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
