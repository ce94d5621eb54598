"""What one `db_query` call may do, as MariaDB privileges, and the accounts that carry them.

The gate decides a call may run and records what its decision covers on the turn
(`turns.DbAccess`). This module turns that into privileges on the agent database and holds the
accounts `agentctl db-setup` made (agentctl_db.py), all named after the agent's database:

- N RUNNER accounts (`<base>_r1` … `<base>_rN`). Runner k holds nothing but USAGE and one role,
  `<base>_role<k>`, with no default role; one call at a time runs on it. Before a call, role k is
  filled with exactly that call's privileges. So a statement that switches roles (a compound
  statement, an executable comment, `EXECUTE IMMEDIATE`, a stored program) can reach no role but
  its own, and its own holds this call's privileges, nothing of another or an earlier call.
- The GRANTOR account holds only EXECUTE on two procedures of the admin schema `<base>_adm`:
  `refill(k, spec)` sets role k's privileges to a list of (privileges, table) on the agent database
  (privilege words from a fixed list, names quoted by the procedure, only roles 1…N), and
  `tables()` lists the agent database's tables. They run as the DEFINER account, which is locked
  (no one can log in as it) and holds ALL on the agent database WITH GRANT OPTION and SELECT on
  `mysql.db` / `mysql.tables_priv` (to revoke what a role holds). So the stored grantor password
  can neither create, alter, rename, drop nor re-key any account or role, nor grant anything to
  anyone but this agent's N roles, nor anything outside the agent database.
- Several instances may share the accounts: a runner is claimed with `GET_LOCK('<base>_slot<k>')`
  on the claimer's grantor connection (agent code only), held while that instance uses it; whoever
  claims a runner first ends every other session of it (a call another instance abandoned), then
  refills its role.

Operations → privileges: read → SELECT; write → SELECT, INSERT, UPDATE, DELETE; ddl → write's plus
CREATE, DROP, ALTER, INDEX (TRUNCATE needs DROP); `*` (any table) → SELECT on the whole agent
database for a read, and for anything else the table privileges of ddl plus CREATE TEMPORARY
TABLES and LOCK TABLES on it (never EXECUTE, TRIGGER, CREATE VIEW, routines or events: stored
objects would run later with whatever role k holds then). `__meta__` (names and columns, no rows)
→ REFERENCES on the database and on each table: MariaDB lets SHOW TABLES, SHOW CREATE TABLE,
DESCRIBE, SHOW COLUMNS and SHOW INDEX through with it and refuses every row. REFERENCES also lets a
table be given a FOREIGN KEY to another, and inserting into it would then tell which key values
exist there: so in a set that may CREATE or ALTER, the `__meta__` part is left out. `!db` (typed by
an administrator) gets ALL on the agent database.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sql import ANY_TABLE, DDL, META, READ, WRITE, table_key

#: Strongest first: the standing set gives a table the strongest operation the policy allows.
RANKED_OPS = (DDL, WRITE, READ)
PRIVILEGES = {
    READ: ("SELECT",),
    WRITE: ("SELECT", "INSERT", "UPDATE", "DELETE"),
    DDL: ("SELECT", "INSERT", "UPDATE", "DELETE", "CREATE", "DROP", "ALTER", "INDEX"),
}
#: What a model call approved for "any table" may do beyond a read: table work, no stored objects.
ANY_TABLE_WRITE = (*PRIVILEGES[DDL], "CREATE TEMPORARY TABLES", "LOCK TABLES")
META_PRIVILEGE = "REFERENCES"
ALL = "ALL PRIVILEGES"
#: Every privilege word `refill` accepts (the procedure checks each against this list too).
GRANTABLE = (*ANY_TABLE_WRITE, META_PRIVILEGE, ALL)
#: Privileges that let a statement add a FOREIGN KEY (which REFERENCES would then open).
_SHAPE_CHANGING = frozenset({"CREATE", "ALTER", ALL})
DEFAULT_RUNNERS = 4
MAX_RUNNERS = 64
_PASSWORD = re.compile(r"\s+IDENTIFIED\s+(BY|VIA|WITH)\b.*$", re.IGNORECASE | re.DOTALL)
#: Oldest MariaDB with roles, COM_RESET_CONNECTION, ACCOUNT LOCK and JSON_VALUE.
MIN_VERSION = (10, 4, 2)


@dataclass(frozen=True, order=True)
class TableGrant:
    """Privileges on one object: `schema`.`table`, or the whole schema when `table` is ""."""

    schema: str
    table: str
    privileges: tuple[str, ...]


#: A privilege set: what one call may do, as grants (empty: nothing at all).
Privileges = frozenset[TableGrant]


def quote(name: str) -> str:
    """A MariaDB identifier in backquotes."""
    return "`" + name.replace("`", "``") + "`"


def literal(value: str) -> str:
    """A SQL string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# ── Names ───────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Names:
    """The accounts, roles, schema and locks of one agent database (and instance name), never fixed server-wide."""

    db: str
    instance: str
    base: str
    runners: int

    @property
    def grantor(self) -> str:
        return f"{self.base}_g"

    @property
    def definer(self) -> str:
        return f"{self.base}_def"

    @property
    def admin_schema(self) -> str:
        return f"{self.base}_adm"

    def runner(self, k: int) -> str:
        return f"{self.base}_r{k}"

    def role(self, k: int) -> str:
        return f"{self.base}_role{k}"

    def lock(self, k: int) -> str:
        return f"{self.base}_slot{k}"

    def slots(self) -> range:
        return range(1, self.runners + 1)

    def accounts(self) -> list[str]:
        """Every account name (not roles), runners first."""
        return [*(self.runner(k) for k in self.slots()), self.grantor, self.definer]


def names_for(db: str, instance: str = "", runners: int = DEFAULT_RUNNERS) -> Names:
    """`amcp_<slug>_<6 hex>`: a base unique to (instance, database), short enough for any MariaDB name."""
    slug = re.sub(r"[^a-z0-9]", "", (instance or db).lower())[:12] or "db"
    digest = hashlib.sha256(f"{instance}\0{db}".encode()).hexdigest()[:6]
    return Names(db=db, instance=instance, base=f"amcp_{slug}_{digest}", runners=runners)


# ── Privilege sets ──────────────────────────────────────────────────────────────────────────


def _key_parts(key: str) -> list[str]:
    """The parts of a gate key (`name`, `schema.name`, a part in backquotes when it holds a dot; sql.table_key)."""
    parts, i = [], 0
    while i < len(key):
        if key[i] == "`":
            j, chars = i + 1, []
            while j < len(key) and not (key[j] == "`" and key[j + 1:j + 2] != "`"):
                chars.append(key[j])
                j += 2 if key[j] == "`" else 1
            parts.append("".join(chars))
            i = j + 1
        else:
            j = key.find(".", i)
            j = len(key) if j < 0 else j
            parts.append(key[i:j])
            i = j
        i += 1 if key[i:i + 1] == "." else 0
    return parts


def _table_of(key: str, db: str, case_sensitive: bool) -> str | None:
    """The table of the agent database a gate key names, or None (`*`, `__meta__`, any other schema)."""
    if key in (ANY_TABLE, META):
        return None
    parts = _key_parts(key)
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2 and ((parts[0] == db) if case_sensitive else (parts[0].lower() == db.lower())):
        return parts[1]
    return None  # another schema (a system one, or any other): the roles grant on the agent database only


def privileges_for(pairs: Iterable[tuple[str, str]], *, db: str, tables: Iterable[str],
                   case_sensitive: bool) -> Privileges:
    """The grants for (gate key, operation) pairs on agent database `db`, whose tables are `tables`."""
    wanted: dict[str, set[str]] = {}
    meta = False
    for key, op in pairs:
        if key == META:
            meta = True
        elif key == ANY_TABLE:
            wanted.setdefault("", set()).update(PRIVILEGES[READ] if op == READ else ANY_TABLE_WRITE)
        elif op in PRIVILEGES and (table := _table_of(key, db, case_sensitive)) is not None:
            wanted.setdefault(table, set()).update(PRIVILEGES[op])
    if meta and not any(p in _SHAPE_CHANGING for privs in wanted.values() for p in privs):
        for obj in ["", *tables]:
            wanted.setdefault(obj, set()).add(META_PRIVILEGE)
    return frozenset(TableGrant(db, table, (ALL,) if ALL in privs else tuple(sorted(privs)))
                     for table, privs in wanted.items())


def everything(db: str) -> Privileges:
    """`!db`: ALL on the agent database, nothing global."""
    return frozenset({TableGrant(db, "", (ALL,))})


def standing_pairs(allows: Callable[[str, str], bool], tables: Iterable[str], *, operations: Iterable[str],
                   case_sensitive: bool) -> list[tuple[str, str]]:
    """What a session's policy lets run unasked: each table of the agent database with the strongest
    operation `allows(key, op)` grants, plus `*` and `__meta__` when allowed (never a system schema)."""
    known = [op for op in RANKED_OPS if op in set(operations)]
    pairs = []
    for table in tables:
        op = next((op for op in known if allows(table_key(table, case_sensitive=case_sensitive), op)), None)
        if op is not None:
            pairs.append((table, op))
    any_op = next((op for op in known if allows(ANY_TABLE, op)), None)
    if any_op is not None:
        pairs.append((ANY_TABLE, any_op))
    if READ in known and allows(META, READ):
        pairs.append((META, READ))
    return pairs


def spec(privileges: Privileges) -> str:
    """The JSON `refill` takes: [[privileges, table], …], table "" for the whole database."""
    return json.dumps([[", ".join(g.privileges), g.table] for g in sorted(privileges)])


def without_password(grant_line: str) -> str:
    """A SHOW GRANTS line without its `IDENTIFIED BY PASSWORD '…'` part (for messages)."""
    return _PASSWORD.sub("", grant_line)


def mariadb_version(server_info: str) -> tuple[int, ...] | None:
    """(major, minor, patch) of a MariaDB server string (`5.5.5-10.11.19-MariaDB-…`), None for MySQL."""
    if "mariadb" not in server_info.lower():
        return None
    found = re.findall(r"(\d+)\.(\d+)\.(\d+)", server_info)
    real = [tuple(map(int, f)) for f in found if f != ("5", "5", "5")]
    return real[0] if real else None


# ── The admin schema (made by db-setup as an administrator) ─────────────────────────────────

_PRIV_WORDS = "|".join(GRANTABLE)


def procedures(names: Names, host: str) -> dict[str, str]:
    """name → CREATE statement of the admin schema's procedures (DEFINER: the locked definer account)."""
    adm, db = quote(names.admin_schema), literal(names.db)
    definer = f"{quote(names.definer)}@{quote(host)}"
    role = f"CONCAT({literal(names.base + '_role')}, k)"
    ident = "CONCAT('`', REPLACE({}, '`', '``'), '`')"
    refill = f"""CREATE DEFINER={definer} PROCEDURE {adm}.`refill`(IN k INT, IN grants LONGTEXT)
SQL SECURITY DEFINER MODIFIES SQL DATA
BEGIN
  DECLARE i INT DEFAULT 0;
  DECLARE n INT;
  DECLARE done INT DEFAULT 0;
  DECLARE r VARCHAR(80);
  DECLARE p TEXT;
  DECLARE t VARCHAR(64);
  DECLARE old_db VARCHAR(64);
  DECLARE dbs CURSOR FOR SELECT Db FROM mysql.db WHERE User = r AND Host = '';
  DECLARE tbls CURSOR FOR SELECT Db, Table_name FROM mysql.tables_priv WHERE User = r AND Host = '';
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET done = 1;
  IF k IS NULL OR k < 1 OR k > {names.runners} THEN
    SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'no such agent-mcp runner role';
  END IF;
  SET r = {role};
  IF (SELECT COUNT(*) FROM mysql.db WHERE User = r AND Host = '' AND Db <> {db}) +
     (SELECT COUNT(*) FROM mysql.tables_priv WHERE User = r AND Host = '' AND Db <> {db}) > 0 THEN
    SIGNAL SQLSTATE '45000'
      SET MESSAGE_TEXT = 'the role holds privileges outside the agent database: run agentctl db-setup';
  END IF;
  OPEN dbs;
  each_db: LOOP
    FETCH dbs INTO old_db;
    IF done THEN LEAVE each_db; END IF;
    EXECUTE IMMEDIATE CONCAT('REVOKE ALL PRIVILEGES ON ', {ident.format('old_db')}, '.* FROM ', {ident.format('r')});
  END LOOP;
  CLOSE dbs;
  SET done = 0;
  OPEN tbls;
  each_table: LOOP
    FETCH tbls INTO old_db, t;
    IF done THEN LEAVE each_table; END IF;
    EXECUTE IMMEDIATE CONCAT('REVOKE ALL PRIVILEGES ON ', {ident.format('old_db')}, '.', {ident.format('t')},
                             ' FROM ', {ident.format('r')});
  END LOOP;
  CLOSE tbls;
  SET n = JSON_LENGTH(grants);
  WHILE i < IFNULL(n, 0) DO
    SET p = JSON_VALUE(grants, CONCAT('$[', i, '][0]'));
    SET t = JSON_VALUE(grants, CONCAT('$[', i, '][1]'));
    IF p IS NULL OR t IS NULL OR p NOT REGEXP '^({_PRIV_WORDS})(, ({_PRIV_WORDS}))*$' THEN
      SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'not a privilege list agent-mcp grants';
    END IF;
    BEGIN
      -- a table that does not exist (and no CREATE in the list): the statement will fail on it anyway
      DECLARE CONTINUE HANDLER FOR 1146 BEGIN END;
      EXECUTE IMMEDIATE CONCAT('GRANT ', p, ' ON ', {ident.format(db)}, '.',
                               IF(t = '', '*', {ident.format('t')}), ' TO ', {ident.format('r')});
    END;
    SET i = i + 1;
  END WHILE;
END"""
    tables = f"""CREATE DEFINER={definer} PROCEDURE {adm}.`tables`()
SQL SECURITY DEFINER READS SQL DATA
SELECT TABLE_NAME, @@lower_case_table_names FROM information_schema.TABLES WHERE TABLE_SCHEMA = {db}"""
    return {"refill": refill, "tables": tables}


def setup_digest(setup_id: str) -> str:
    """What the admin schema keeps of the accounts file's setup id: proof of whose accounts these are."""
    return hashlib.sha256(f"agent-mcp db-setup\0{setup_id}".encode()).hexdigest()
