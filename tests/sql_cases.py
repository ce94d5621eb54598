"""The SQL gate-key table: statements with the exact (operation, gate keys) the classifier must give.

Hand-written cases by category, then families built from small tables (each family's rule is
stated with it and computed here, never by asking the classifier). Keys: a table's name, or
`schema.name` when the statement names the schema; `*` for anything that may touch any table;
`__meta__` for statements on no table. Operations: read, write, and ddl for CREATE/DROP/ALTER/
TRUNCATE/RENAME and for every statement that cannot be analysed (nothing weaker may cover it).
"""

from __future__ import annotations

R, W, D, META, ANY = "read", "write", "ddl", "__meta__", "*"

SQL_CORPUS = [
    # plain reads
    ("SELECT * FROM users", R, {"users"}),
    ("select * from USERS where name = 'DROP TABLE x'", R, {"users"}),
    ("SELECT 1", R, {META}),
    ("SELECT NOW() FROM DUAL", R, {META}),
    # leading comments
    ("-- list everyone\nSELECT * FROM users", R, {"users"}),
    ("/* harmless */ DELETE FROM users WHERE id = 1", W, {"users"}),
    ("# mysql comment\nUPDATE users SET name = 'x'", W, {"users"}),
    # executable comments run in MySQL: classified as what they hold; a `;` in one is several statements in one
    ("SELECT 1 /*!50000 ; DROP TABLE users */", D, {META, "users", ANY}),
    ("/*!50000 DELETE FROM users */ SELECT 1", D, {"users", ANY}),
    ("SELECT 1 /*M! DROP TABLE accounts */", D, {META, "accounts", ANY}),  # MySQL: a plain comment
    # several statements
    ("SELECT 1; DROP TABLE users", D, {META, "users"}),
    ("SELECT * FROM a; SELECT * FROM b;", R, {"a", "b"}),
    ("SELECT * FROM a; CALL purge()", D, {"a", ANY}),
    # CTEs: CTE names are not tables where a SELECT defines them; MariaDB has no WITH before
    # DELETE/INSERT (nor DML inside a CTE), so there the name counts as a table (over-keying is safe)
    ("WITH recent AS (SELECT id FROM orders) SELECT * FROM recent", R, {"orders"}),
    ("WITH d AS (SELECT id FROM a) DELETE FROM b WHERE id IN (SELECT id FROM d)", W, {"a", "b", "d"}),
    ("WITH d AS (DELETE FROM users RETURNING *) SELECT * FROM d", W, {"users", "d"}),
    ("WITH x AS (SELECT * FROM a) INSERT INTO t SELECT * FROM x", W, {"a", "t", "x"}),
    ("INSERT INTO t WITH x AS (SELECT * FROM a) SELECT * FROM x", W, {"a", "t"}),
    # files, procedures, session state, privileges, renames, handlers, DO, REPLACE
    ("SELECT * INTO OUTFILE '/tmp/users.csv' FROM users", D, {"users", ANY}),
    ("SELECT name FROM users INTO DUMPFILE '/tmp/x'", D, {"users", ANY}),
    ("LOAD DATA INFILE '/tmp/x.csv' INTO TABLE users", D, {"users", ANY}),
    ("LOAD DATA LOCAL INFILE '/tmp/x.csv' INTO TABLE `my db`.users", D, {"my db.users", ANY}),
    ("CALL reset_everything()", D, {ANY}),
    ("SET @a = (SELECT password FROM users)", D, {"users", ANY}),
    ("SET GLOBAL general_log = 1", D, {ANY}),
    ("GRANT ALL PRIVILEGES ON *.* TO 'eve'@'%'", D, {ANY}),
    ("RENAME TABLE users TO old_users", D, {"users", "old_users", ANY}),
    ("HANDLER users OPEN", D, {"users", ANY}),
    ("DO SLEEP(5)", D, {ANY}),
    ("REPLACE INTO users VALUES (1, 'x')", D, {"users", ANY}),
    ("LOCK TABLES users WRITE", D, {"users", ANY}),
    ("USE mysql", D, {ANY}),
    ("BEGIN", D, {ANY}),
    # reads that are not plain: locks, INTO variables, side-effect functions
    ("SELECT * FROM users FOR UPDATE", W, {"users"}),
    ("SELECT * FROM users LOCK IN SHARE MODE", W, {"users"}),
    ("SELECT password INTO @p FROM users WHERE id = 1", W, {"users"}),
    ("SELECT LOAD_FILE('/etc/passwd')", W, {ANY}),
    ("SELECT SLEEP(100) FROM users", W, {"users", ANY}),
    ("SELECT GET_LOCK('x', 10)", W, {ANY}),
    # names: backticks, schema qualifiers (kept in the key), comma joins
    ("SELECT * FROM `my db`.`Users` u JOIN mymcp.orders o ON u.id = o.uid", R, {"my db.users", "mymcp.orders"}),
    ("SELECT * FROM `orders`", R, {"orders"}),
    ("SELECT * FROM a, b, c WHERE a.id = b.id AND b.id = c.id", R, {"a", "b", "c"}),
    # subqueries and UNIONs touching several tables
    ("SELECT * FROM a WHERE id IN (SELECT id FROM b) UNION SELECT * FROM c", R, {"a", "b", "c"}),
    ("SELECT (SELECT MAX(x) FROM t2) FROM t1 WHERE EXISTS (SELECT 1 FROM t3)", R, {"t1", "t2", "t3"}),
    ("INSERT INTO logs SELECT * FROM users", W, {"logs", "users"}),
    # DML and DDL
    ("UPDATE users SET a = 1", W, {"users"}),
    ("DELETE a, b FROM a JOIN b ON a.id = b.id", W, {"a", "b"}),
    ("INSERT INTO a VALUES (1) ON DUPLICATE KEY UPDATE x = 1", W, {"a"}),
    ("TRUNCATE TABLE users", D, {"users"}),
    ("DROP TABLE IF EXISTS `a`, b", D, {"a", "b"}),
    ("ALTER TABLE users ADD c INT", D, {"users"}),
    ("CREATE TABLE t2 AS SELECT * FROM users", D, {"t2", "users"}),
    # metadata reads
    ("SHOW TABLES", R, {META}),
    ("SHOW COLUMNS FROM users", R, {META}),
    ("SHOW CREATE TABLE users", R, {META}),
    ("DESCRIBE users", R, {META}),
    ("DESC users", R, {META}),
    ("EXPLAIN SELECT * FROM users", R, {"users"}),
    ("EXPLAIN ANALYZE DELETE FROM users", W, {"users"}),
    # garbage and emptiness fail closed
    ("SELEC * FORM users", D, {ANY}),
    ("FLUSH PRIVILEGES", D, {ANY}),
    ("", D, {ANY}),
    ("   ;  ", D, {ANY}),
]

SQL_CORPUS += [
    # statement modifiers are never table names
    ("UPDATE LOW_PRIORITY IGNORE users SET a = 1 WHERE id = 2", W, {"users"}),
    ("update low_priority users set a = 1", W, {"users"}),
    ("INSERT LOW_PRIORITY IGNORE INTO users (a) VALUES (1)", W, {"users"}),
    ("INSERT IGNORE INTO users SELECT * FROM staging", W, {"users", "staging"}),
    ("DELETE IGNORE FROM logs", W, {"logs"}),
    ("DELETE LOW_PRIORITY a, b FROM a JOIN b ON a.id = b.id", W, {"a", "b"}),
    ("REPLACE LOW_PRIORITY INTO users VALUES (1)", D, {"users", ANY}),
    ("REPLACE DELAYED INTO users VALUES (1)", D, {"users", ANY}),
    ("LOAD DATA LOW_PRIORITY INFILE '/tmp/x' INTO TABLE users", D, {"users", ANY}),
    ("SELECT SQL_CALC_FOUND_ROWS * FROM users LIMIT 1", R, {"users"}),
    ("SELECT STRAIGHT_JOIN * FROM a JOIN b ON a.id = b.id", R, {"a", "b"}),
    ("SELECT DISTINCTROW a FROM users", R, {"users"}),
    ("SELECT SQL_SMALL_RESULT a FROM users GROUP BY a", R, {"users"}),
    # a real table named like a modifier: quoted, it is a name; unquoted where it could be one, fail closed
    ("UPDATE `ignore` SET a = 1", W, {"ignore"}),
    ("DELETE FROM `quick` WHERE a = 1", W, {"quick"}),
    ("UPDATE quick SET a = 1", D, {"quick", ANY}),
    ("SELECT 'IGNORE', 'LOW_PRIORITY'", R, {META}),
    ("UPDATE users SET note = 'LOW_PRIORITY'", W, {"users"}),
    # schema-qualified names keep their schema; the system schemas are keyed as such
    ("SELECT * FROM mysql.user", R, {"mysql.user"}),
    ("SELECT user, authentication_string FROM mysql.user", R, {"mysql.user"}),
    ("UPDATE mysql.user SET plugin = 'x'", W, {"mysql.user"}),
    ("DELETE FROM mysql.db", W, {"mysql.db"}),
    ("INSERT INTO mysql.user SELECT * FROM users", W, {"mysql.user", "users"}),
    ("SELECT * FROM information_schema.tables", R, {"information_schema.tables"}),
    ("SELECT table_name FROM INFORMATION_SCHEMA.COLUMNS WHERE table_schema = 'shop'", R,
     {"information_schema.columns"}),
    ("SELECT * FROM performance_schema.threads", R, {"performance_schema.threads"}),
    ("SELECT * FROM sys.session", R, {"sys.session"}),
    ("SELECT * FROM shop.users", R, {"shop.users"}),
    ("SELECT * FROM shop.users JOIN users ON shop.users.id = users.id", R, {"shop.users", "users"}),
    ("UPDATE shop.users SET a = 1", W, {"shop.users"}),
    ("DROP TABLE shop.users", D, {"shop.users"}),
    ("TRUNCATE TABLE archive.logs", D, {"archive.logs"}),
    ("SELECT * FROM `Shop`.`Users`", R, {"shop.users"}),
    ("INSERT INTO logs SELECT * FROM mysql.user", W, {"logs", "mysql.user"}),
    ("WITH u AS (SELECT * FROM mysql.user) SELECT * FROM u", R, {"mysql.user"}),
    # objects that are not tables: any table may be touched
    ("DROP DATABASE shop", D, {ANY}),
    ("DROP DATABASE IF EXISTS shop", D, {ANY}),
    ("CREATE DATABASE scratch", D, {ANY}),
    ("DROP SCHEMA shop", D, {ANY}),
    ("CREATE SCHEMA IF NOT EXISTS s2", D, {ANY}),
    ("ALTER DATABASE shop CHARACTER SET utf8mb4", D, {ANY}),
    ("DROP PROCEDURE purge_all", D, {ANY}),
    ("DROP PROCEDURE IF EXISTS shop.purge_all", D, {ANY}),
    ("DROP FUNCTION f", D, {ANY}),
    ("CREATE FUNCTION f() RETURNS INT RETURN 1", D, {ANY}),
    ("DROP EVENT nightly", D, {ANY}),
    ("DROP TRIGGER users_bi", D, {ANY}),
    ("CREATE VIEW v AS SELECT * FROM users", D, {ANY}),
    ("DROP VIEW v", D, {ANY}),
    ("CREATE USER 'eve'@'%' IDENTIFIED BY 'x'", D, {ANY}),
    ("DROP USER 'eve'@'%'", D, {ANY}),
    ("CREATE INDEX ix ON users (email)", D, {"users"}),
    ("CREATE TEMPORARY TABLE t (a INT)", D, {"t"}),
    # functions: builtins are reads; stored, user-defined or side-effect ones may write anything
    ("SELECT f(1)", W, {ANY}),
    ("SELECT shop.f(1)", W, {ANY}),
    ("SELECT f(a) FROM users", W, {"users", ANY}),
    ("SELECT * FROM users WHERE is_admin(id)", W, {"users", ANY}),
    ("UPDATE users SET score = recompute(id)", W, {"users", ANY}),
    ("SELECT UPPER(name), LOWER(email), LENGTH(name) FROM users", R, {"users"}),
    ("SELECT COUNT(*), SUM(total), AVG(total), MIN(total), MAX(total) FROM orders", R, {"orders"}),
    ("SELECT NOW(), CURDATE(), UNIX_TIMESTAMP()", R, {META}),
    ("SELECT CONCAT(a, b), COALESCE(a, 0), IFNULL(b, 1) FROM t", R, {"t"}),
    ("SELECT DATE_FORMAT(created, '%Y') FROM orders", R, {"orders"}),
    ("SELECT JSON_EXTRACT(doc, '$.a'), JSON_UNQUOTE(doc) FROM docs", R, {"docs"}),
    ("SELECT MID(name, 1, 2), FIND_IN_SET('a', tags) FROM users", R, {"users"}),
    ("SELECT GROUP_CONCAT(name) FROM users", R, {"users"}),
    ("SELECT ROUND(ABS(x), 2) FROM t", R, {"t"}),
    ("SELECT BENCHMARK(1000000, MD5('x'))", W, {ANY}),
    ("SELECT RELEASE_LOCK('x')", W, {ANY}),
    ("SELECT LAST_INSERT_ID()", W, {ANY}),
    ("SELECT UUID_SHORT()", W, {ANY}),
    ("SELECT NEXTVAL(seq)", W, {ANY}),
    ("SELECT LOAD_FILE('/etc/passwd') FROM users", W, {"users", ANY}),
]

# ── Families: every modifier of each statement verb, on plain, qualified and system tables ──────
_TARGETS = [("users", "users"), ("`orders`", "orders"), ("shop.items", "shop.items"), ("mysql.user", "mysql.user")]
_FAMILIES = {  # verb pattern → the modifiers MySQL accepts there
    "UPDATE {m} {t} SET a = 1": ["LOW_PRIORITY", "IGNORE", "LOW_PRIORITY IGNORE"],
    "INSERT {m} INTO {t} VALUES (1)": ["LOW_PRIORITY", "DELAYED", "HIGH_PRIORITY", "IGNORE", "LOW_PRIORITY IGNORE"],
    "DELETE {m} FROM {t} WHERE id = 1": ["LOW_PRIORITY", "QUICK", "IGNORE", "LOW_PRIORITY QUICK IGNORE"],
}
# Rule: a write on exactly the table named (the modifier never becomes a key).
SQL_CORPUS += [(pattern.format(m=m, t=t), W, {key}) for pattern, mods in _FAMILIES.items()
               for m in mods for t, key in _TARGETS]
# Rule: plain reads of one table, with every SELECT modifier, are reads of exactly that table.
SQL_CORPUS += [(f"SELECT {m} * FROM {t}", R, {key})
               for m in ("HIGH_PRIORITY", "SQL_NO_CACHE", "SQL_CALC_FOUND_ROWS", "STRAIGHT_JOIN", "DISTINCTROW",
                         "SQL_BUFFER_RESULT")
               for t, key in _TARGETS]
# Rule: a call of an unknown (stored or user-defined) function is a write on `*` and the tables read.
SQL_CORPUS += [(f"SELECT {f}(id) FROM {t}", W, {key, ANY})
               for f in ("my_udf", "shop.total_for", "calc_discount") for t, key in _TARGETS]
# Rule: known side-effect-free builtins keep a read a read.
SQL_CORPUS += [(f"SELECT {f} FROM {t}", R, {key})
               for f in ("UPPER(name)", "CRC32(name)", "STRCMP(a, b)", "TIMEDIFF(a, b)", "INET_NTOA(ip)")
               for t, key in _TARGETS]
# Rule: CREATE/DROP of objects that are not tables are ddl on `*` alone, whatever their name.
SQL_CORPUS += [(f"DROP {kind} {name}", D, {ANY})
               for kind in ("DATABASE", "SCHEMA", "PROCEDURE", "FUNCTION", "EVENT", "TRIGGER", "VIEW")
               for name in ("users", "shop.users")]
