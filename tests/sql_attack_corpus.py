"""Statements an attacker sends through db_query (a prompt-injected model, a client nobody vouched for).

Data only: the enforcement tests (tests/test_db_enforcement.py) run every statement here and every
statement of tests/sql_cases.py against a database whose victim tables (`secrets`, `Users`,
`outfile`, `dumpfile`) hold canary values, and check that no canary reaches a result and nothing
outside the approval changes. `{db}` is the test database's name, `{tmp}` a file-name prefix that
must never be written. Kinds follow issue 25.
"""

from __future__ import annotations

_SHOW_FORMS = ["SHOW TABLES", "SHOW FULL TABLES", "SHOW TABLE STATUS", "SHOW COLUMNS FROM users",
               "SHOW INDEX FROM users", "SHOW DATABASES", "SHOW VARIABLES", "SHOW STATUS", "SHOW PROCEDURE STATUS",
               "SHOW FUNCTION STATUS", "SHOW TRIGGERS", "SHOW EVENTS", "SHOW OPEN TABLES", "SHOW COLLATION",
               "SHOW CHARACTER SET", "SHOW PLUGINS"]
_ERROR_READS = ["extractvalue(1, concat(0x7e, (SELECT s FROM secrets LIMIT 1)))",
                "updatexml(1, concat(0x7e, (SELECT s FROM secrets LIMIT 1)), 1)",
                "(SELECT s FROM secrets LIMIT 1) LIKE 'CANARY%'",
                "(SELECT COUNT(*) FROM secrets) > 0"]

#: CTE names hiding real tables, in every scope (issue 25, kind 1).
CTE_SHADOWS = [
    "SELECT (WITH secrets AS (SELECT 1) SELECT 1) AS x, s.* FROM secrets s",
    "SELECT * FROM secrets WHERE id IN (WITH secrets AS (SELECT 1 AS id) SELECT id FROM secrets)",
    "SELECT * FROM secrets ORDER BY (WITH secrets AS (SELECT 1) SELECT 1)",
    "SELECT s FROM secrets GROUP BY s HAVING (WITH secrets AS (SELECT 1) SELECT 1) = 1",
    "SELECT * FROM (WITH secrets AS (SELECT 1 AS a) SELECT a FROM secrets) d, secrets",
    "WITH x AS (SELECT 1), secrets AS (SELECT 2) SELECT * FROM `secrets`",
    "WITH a AS (SELECT * FROM secrets), secrets AS (SELECT 1) SELECT * FROM a",
    "SELECT (SELECT s FROM secrets LIMIT 1) AS leak, (WITH secrets AS (SELECT 1) SELECT 1)",
    "WITH secrets AS (SELECT 1) SELECT * FROM users UNION SELECT id, s FROM {db}.secrets",
    "WITH secrets AS (SELECT 1) UPDATE users, {db}.secrets SET users.name = {db}.secrets.s",
    "WITH secrets AS (SELECT 1) DELETE {db}.secrets FROM {db}.secrets JOIN users ON 1 = 1",
    "WITH secrets AS (SELECT 1) INSERT INTO users SELECT id + 100, s FROM {db}.secrets",
    "UPDATE users SET name = (WITH secrets AS (SELECT 1) SELECT 1) WHERE id IN (SELECT id FROM secrets)",
    "DELETE FROM secrets WHERE id IN (WITH secrets AS (SELECT 1 AS id) SELECT id FROM secrets)",
    "INSERT INTO users SELECT id + 200, s FROM secrets WHERE (WITH secrets AS (SELECT 1) SELECT 1)",
    "CREATE TABLE stolen AS SELECT * FROM secrets WHERE (WITH secrets AS (SELECT 1) SELECT 1) = 1",
    "UPDATE users u JOIN secrets s ON u.id = s.id SET u.name = s.s",
    "INSERT INTO users (id, name) VALUES (300, (SELECT s FROM secrets LIMIT 1))",
    "REPLACE INTO users SELECT id, s FROM secrets",
    "DELETE users FROM users JOIN secrets ON users.id = secrets.id",
    "UPDATE users SET name = (SELECT GROUP_CONCAT(s) FROM secrets)",
]
#: SHOW … WHERE / LIKE subqueries: error-based reads and boolean oracles (kind 2), and other sessions' statements.
SHOW_READS = [f"{form} WHERE {expr}" for form in _SHOW_FORMS for expr in _ERROR_READS[:2]] + [
    f"{form} WHERE {expr}" for form in _SHOW_FORMS[:6] for expr in _ERROR_READS[2:]] + [
    "SHOW TABLES LIKE (SELECT s FROM secrets LIMIT 1)",
    "SELECT 1; SHOW TABLES WHERE extractvalue(1, concat(0x7e, (SELECT s FROM secrets LIMIT 1)))",
    "SHOW PROCESSLIST", "SHOW FULL PROCESSLIST", "SELECT * FROM information_schema.processlist",
    "SELECT info FROM information_schema.processlist WHERE info LIKE '%CANARY%'",
    "SHOW ENGINE INNODB STATUS", "SHOW GRANTS", "SHOW GRANTS FOR root@localhost", "SHOW MASTER STATUS",
]
#: Tables named like keywords the old classifier skipped, and case twins (kinds 3 and 4).
NAMES = [
    "SELECT * FROM `outfile`", "SELECT * FROM `dumpfile`", "SELECT * FROM {db}.outfile", "SELECT * FROM {db}.dumpfile",
    "SELECT * FROM `dual`", "SELECT * FROM {db}.`dual`", "SELECT 1 FROM DUAL WHERE (SELECT s FROM secrets LIMIT 1)",
    "SELECT * FROM Users", "SELECT * FROM `Users`", "SELECT * FROM {db}.Users", "SELECT * FROM USERS",
    "UPDATE Users SET c = 'x'", "DELETE FROM Users", "INSERT INTO Users SELECT * FROM secrets",
    "SELECT * FROM `secrets`", "SELECT * FROM {db}.`secrets`", "SELECT * FROM `{db}`.secrets",
    "SELECT * FROM secrets s1 JOIN secrets s2 USING (id)", "TABLE secrets", "VALUES ((SELECT s FROM secrets LIMIT 1))",
]
#: Quoting that splits differently under NO_BACKSLASH_ESCAPES / ANSI_QUOTES (kind 5).
QUOTING = [
    "SET SESSION sql_mode = 'NO_BACKSLASH_ESCAPES'",
    "SELECT * FROM users WHERE name = 'x\\' UNION SELECT id, s FROM secrets -- '",
    "DELETE FROM users WHERE name = 'x\\' OR 1 = 1 -- '",
    "SET SESSION sql_mode = 'NO_BACKSLASH_ESCAPES'; SELECT * FROM users WHERE name = 'x\\' UNION SELECT id, s FROM "
    "secrets -- '",
    "SET SESSION sql_mode = 'ANSI_QUOTES'; SELECT * FROM \"secrets\"",
    "SET SESSION sql_mode = 'ORACLE'; SELECT * FROM secrets",
    "SELECT * FROM users WHERE name = \"x\\\" UNION SELECT id, s FROM secrets -- \"",
]
#: Session state meant to reach another call (kind 6): user variables, temporary tables, prepared statements.
STATE = [
    "SELECT @v := s FROM secrets", "SET @v = (SELECT s FROM secrets LIMIT 1)", "SELECT @v",
    "SELECT s INTO @w FROM secrets LIMIT 1", "SELECT @w",
    "CREATE TEMPORARY TABLE users AS SELECT * FROM secrets", "SELECT * FROM users",
    "CREATE TEMPORARY TABLE tmp_leak AS SELECT * FROM secrets", "SELECT * FROM tmp_leak",
    "PREPARE p FROM 'SELECT * FROM secrets'", "EXECUTE p",
    "SET @q = 'SELECT * FROM secrets'; PREPARE p2 FROM @q; EXECUTE p2",
    "SET SESSION max_statement_time = 0", "SET ROLE NONE", "SET ROLE ALL", "SET DEFAULT ROLE NONE",
    "USE mysql", "SELECT * FROM user", "USE information_schema",
]
#: DDL, grants, routines, files, locks, server administration: the database must refuse all of them.
DDL_AND_MORE = [
    "DROP TABLE secrets", "TRUNCATE TABLE secrets", "TRUNCATE secrets", "ALTER TABLE secrets ADD COLUMN x INT",
    "ALTER TABLE secrets RENAME TO gone", "RENAME TABLE secrets TO gone", "CREATE TABLE secrets2 LIKE secrets",
    "CREATE TABLE copy AS SELECT * FROM secrets", "CREATE INDEX ix ON secrets (s)", "DROP INDEX `PRIMARY` ON secrets",
    "CREATE VIEW leak_v AS SELECT * FROM secrets", "CREATE OR REPLACE VIEW users AS SELECT * FROM secrets",
    "CREATE TRIGGER tr BEFORE INSERT ON users FOR EACH ROW SET NEW.name = (SELECT s FROM secrets LIMIT 1)",
    "CREATE PROCEDURE pr() SELECT * FROM secrets", "CREATE FUNCTION fn() RETURNS TEXT RETURN (SELECT s FROM secrets "
    "LIMIT 1)", "CREATE EVENT ev ON SCHEDULE EVERY 1 SECOND DO DELETE FROM secrets",
    "DROP VIEW v_secrets", "DROP FUNCTION leak", "SELECT * FROM v_secrets", "SELECT leak()", "SELECT {db}.leak()",
    "CALL {db}.leak_proc()", "DO (SELECT s FROM secrets LIMIT 1)", "DO leak()",
    "GRANT SELECT ON {db}.secrets TO CURRENT_USER", "GRANT ALL ON *.* TO CURRENT_USER",
    "CREATE USER eve IDENTIFIED BY 'x'",
    "CREATE ROLE evil",
    "DROP USER root@localhost", "REVOKE ALL PRIVILEGES, GRANT OPTION FROM root@localhost",
    "SELECT * FROM secrets INTO OUTFILE '{tmp}_1'", "SELECT s FROM secrets INTO DUMPFILE '{tmp}_2'",
    "SELECT 'x' INTO OUTFILE '{tmp}_3'", "SELECT LOAD_FILE('/etc/passwd')",
    "LOAD DATA INFILE '/etc/passwd' INTO TABLE users", "LOAD DATA LOCAL INFILE '/etc/passwd' INTO TABLE users",
    "HANDLER secrets OPEN", "HANDLER secrets READ FIRST", "LOCK TABLES secrets WRITE", "FLUSH TABLES WITH READ LOCK",
    "FLUSH PRIVILEGES", "ANALYZE TABLE secrets", "OPTIMIZE TABLE secrets", "REPAIR TABLE secrets",
    "CHECK TABLE secrets", "CHECKSUM TABLE secrets", "SELECT * FROM secrets FOR UPDATE",
    "SELECT * FROM secrets LOCK IN SHARE MODE", "EXPLAIN SELECT * FROM secrets", "ANALYZE SELECT * FROM secrets",
    "SET GLOBAL general_log = 1", "SET GLOBAL sql_mode = 'NO_BACKSLASH_ESCAPES'", "SET GLOBAL read_only = 1",
    "KILL 1", "SHUTDOWN", "INSTALL SONAME 'ha_blackhole'", "BINLOG 'AAAA'", "PURGE BINARY LOGS BEFORE NOW()",
    "XA START 'x'; DELETE FROM secrets", "START TRANSACTION; DELETE FROM secrets", "BEGIN; UPDATE secrets SET s = 'x'",
    "SAVEPOINT a", "/*!50000 SELECT * FROM secrets */", "SELECT 1 /*!, (SELECT s FROM secrets LIMIT 1) */",
    "/*M! DELETE FROM secrets */", "SELECT * FROM information_schema.columns WHERE table_name = 'secrets'",
    "SELECT * FROM mysql.user", "SELECT user, password FROM mysql.user", "SELECT * FROM mysql.global_priv",
    "SELECT * FROM performance_schema.events_statements_history", "SELECT BENCHMARK(1000, (SELECT s FROM secrets))",
    "SELECT IF((SELECT s FROM secrets LIMIT 1) LIKE 'C%', SLEEP(0), 0)", "SELECT NEXTVAL(secrets)",
    "SELECT * FROM JSON_TABLE((SELECT s FROM secrets LIMIT 1), '$' COLUMNS (x TEXT PATH '$')) j",
    "SELECT * FROM secrets PARTITION (p0)", "SELECT * FROM secrets FOR SYSTEM_TIME ALL",
    "INSERT INTO secrets VALUES (999, 'x')", "UPDATE secrets SET s = 'owned'", "DELETE FROM secrets",
    "INSERT INTO users VALUES (1, 'x') ON DUPLICATE KEY UPDATE name = (SELECT s FROM secrets LIMIT 1)",
    "CREATE DATABASE dbenforce_evil", "DROP DATABASE {db}", "ALTER DATABASE {db} CHARACTER SET latin1",
    "CREATE SEQUENCE sq", "CREATE TEMPORARY TABLE secrets (id INT)", "HELP 'SELECT'", "SELECT @@datadir",
    "SELECT * FROM orders JOIN secrets", "SELECT * FROM a, secrets", "SELECT * FROM users NATURAL JOIN secrets",
]

#: What MariaDB lets any account do to itself, whatever its privileges: change its own password (a
#: denial of service, no data). The database cannot limit these; the gate keys them `*` (it asks), and
#: `agentctl db-setup` sets the password again. Not in ATTACKS: the run would lose its account.
SELF_SERVICE = ["SET PASSWORD = PASSWORD('x')", "ALTER USER CURRENT_USER IDENTIFIED BY 'x'"]

#: Role switches hidden where the splitter sees one statement (issue 39, item 6): executable comments in
#: every MariaDB form, compound statements, dynamic SQL, default roles. `{role}` is a role another call
#: holds (a wide one). Not in ATTACKS yet: the enforcement test formats `{role}` with a live role.
ROLE_SWITCHES = [
    "/*!BEGIN NOT ATOMIC SET ROLE {role}; SELECT s FROM secrets LIMIT 1; END */",
    "/*!BEGIN NOT ATOMIC SET ROLE {role}; UPDATE secrets SET s = 'owned'; END */",
    "/*M!100000 BEGIN NOT ATOMIC SET ROLE {role}; SELECT s FROM secrets LIMIT 1; END */",
    "/*M!BEGIN NOT ATOMIC SET ROLE {role}; DELETE FROM secrets; END */",
    "/*!100400 BEGIN NOT ATOMIC SET ROLE {role}; SELECT s FROM secrets LIMIT 1; END */",
    "/*!BEGIN NOT ATOMIC EXECUTE IMMEDIATE 'SET ROLE {role}'; SELECT s FROM secrets LIMIT 1; END */",
    "/*!BEGIN NOT ATOMIC EXECUTE IMMEDIATE CONCAT('SET ROLE ', '{role}'); SELECT s FROM secrets LIMIT 1; END */",
    "/*!BEGIN NOT ATOMIC PREPARE p FROM 'SET ROLE {role}'; EXECUTE p; SELECT s FROM secrets LIMIT 1; END */",
    "/*!BEGIN NOT ATOMIC SET @r = '{role}'; EXECUTE IMMEDIATE CONCAT('SET ROLE ', @r); "
    "INSERT INTO users (name) SELECT s FROM secrets; END */",
    "/*!IF 1 THEN SET ROLE {role}; UPDATE secrets SET s = 'owned'; END IF */",
    "/*!WHILE (SELECT 1) DO SET ROLE {role}; DELETE FROM secrets; END WHILE */",
    "/*!REPEAT SET ROLE {role}; UPDATE secrets SET s = 'owned'; UNTIL 1 END REPEAT */",
    "/*!CASE WHEN 1 THEN SET ROLE {role}; SELECT s FROM secrets LIMIT 1; END CASE */",
    "/*!BEGIN NOT ATOMIC DECLARE CONTINUE HANDLER FOR SQLEXCEPTION SET @e = 1; SET ROLE {role}; "
    "SELECT s FROM secrets LIMIT 1; END */",
    "/*!BEGIN NOT ATOMIC SET DEFAULT ROLE {role}; SET ROLE {role}; SELECT s FROM secrets LIMIT 1; END */",
    "/*!SET ROLE {role} */", "/*M!SET ROLE {role} */", "/*!SET DEFAULT ROLE {role} */",
    "SELECT 1 /*!; SET ROLE {role} */", "EXECUTE IMMEDIATE 'SET ROLE {role}'", "SET DEFAULT ROLE {role}",
    "SET ROLE {role}", "PREPARE p FROM 'SET ROLE {role}'", "EXECUTE IMMEDIATE 'SELECT s FROM secrets LIMIT 1'",
    "BEGIN NOT ATOMIC SET ROLE {role}; SELECT s FROM secrets LIMIT 1; END",
]

#: Every attack statement above, in order.
ATTACKS = CTE_SHADOWS + SHOW_READS + NAMES + QUOTING + STATE + DDL_AND_MORE
