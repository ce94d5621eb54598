#!/usr/bin/env python3
"""What enforcement costs per db_query call: roles, a clean session, SET ROLE — vs the classifier alone.

Real MariaDB (127.0.0.1:3306, root without password; MYSQL_ADMIN_USER/MYSQL_ADMIN_PASS override).
One run makes its own database, a runner and a grantor (agentctl_db.setup_sql, the SQL of
`agentctl db-setup`) and an account with ALL on the database (the classifier-only baseline), then
runs the same `SELECT … FROM users WHERE id = ?` through `database.Database.run`, interleaved call
by call: enforced (reset, pinned sql_mode, SET ROLE of the call's role, USE) and classifier-only
(the same reset and settings, no role). Prints p50 and p99 of both and their ratio; drops
everything it made.

    python bench/db_enforcement.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

import pymysql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentctl_db
import turns
from database import Database, DatabaseSettings

HOST, PORT = "127.0.0.1", 3306


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _admin() -> pymysql.Connection:
    return pymysql.connect(host=HOST, port=PORT, user=os.environ.get("MYSQL_ADMIN_USER", "root"),
                           password=os.environ.get("MYSQL_ADMIN_PASS", ""), autocommit=True)


async def run(calls: int) -> None:
    suffix = secrets.token_hex(4)
    db, prefix = f"bench_dbenforce_{suffix}", f"bench_dbenforce_{suffix}_"
    runner, grantor, classic = ((f"bench_{who}_{suffix}", secrets.token_hex(12)) for who in ("r", "g", "all"))
    admin = _admin()
    cur = admin.cursor()
    try:
        cur.execute(f"CREATE DATABASE `{db}`")
        cur.execute(f"CREATE TABLE `{db}`.users (id INT PRIMARY KEY, name VARCHAR(40))")
        cur.execute(f"INSERT INTO `{db}`.users SELECT seq, CONCAT('u', seq) FROM `{db}`.seq_1_to_1000")
        for statement in agentctl_db.setup_sql(db=db, runner=runner[0], grantor=grantor[0], host="%",
                                               runner_password=runner[1], grantor_password=grantor[1]):
            cur.execute(statement)
        cur.execute("CREATE USER %s@'%%' IDENTIFIED BY %s", classic)
        cur.execute(f"GRANT ALL ON `{db}`.* TO %s@'%%'", (classic[0],))
        base = {"MYSQL_HOST": HOST, "MYSQL_PORT": str(PORT), "MYSQL_DB": db, "MYSQL_ROLE_PREFIX": prefix}
        enforced = Database(DatabaseSettings.from_env({**base, "MYSQL_USER": runner[0], "MYSQL_PASS": runner[1],
                                                       "MYSQL_GRANTOR_USER": grantor[0],
                                                       "MYSQL_GRANTOR_PASS": grantor[1]}))
        alone = Database(DatabaseSettings.from_env({**base, "MYSQL_USER": classic[0], "MYSQL_PASS": classic[1]}))
        assert await enforced.enforce() is None, enforced.problem
        assert await alone.enforce() is not None
        access = turns.DbAccess("policy", allows=lambda key, op: key == "users" or (key == "__meta__" and op == "read"))
        times: dict[str, list[float]] = {"classifier only": [], "enforced": []}
        for i in range(calls + 100):
            for name, database in (("classifier only", alone), ("enforced", enforced)):
                sql = f"SELECT name FROM users WHERE id = {i % 1000 + 1}"
                started = time.perf_counter()
                outcome = await database.run(sql, access)
                elapsed = time.perf_counter() - started
                assert outcome.error is None, outcome.error
                if i >= 100:  # warm-up: pools filled, the role made
                    times[name].append(elapsed)
        await enforced.close()
        await alone.close()
    finally:
        cur.execute(f"DROP DATABASE IF EXISTS `{db}`")
        cur.execute("SELECT User FROM mysql.user WHERE is_role = 'Y' AND User LIKE %s", (prefix + "%",))
        for (role,) in cur.fetchall():
            cur.execute("DROP ROLE IF EXISTS %s", (role,))
        for user, _ in (runner, grantor, classic):
            cur.execute("DROP USER IF EXISTS %s@'%%'", (user,))
        admin.close()
    added = [e - b for e, b in zip(times["enforced"], times["classifier only"], strict=True)]
    print(f"{calls} calls each, interleaved, one SELECT by primary key; times per db_query call (ms)")
    print("| path | p50 | p99 |\n|---|---|---|")
    for name, values in (*times.items(), ("added by enforcement", added)):
        print(f"| {name} | {statistics.median(values) * 1e3:.3f} | {_percentile(values, 99) * 1e3:.3f} |")
    ratio50 = statistics.median(times["enforced"]) / statistics.median(times["classifier only"])
    ratio99 = _percentile(times["enforced"], 99) / _percentile(times["classifier only"], 99)
    print(f"ratio enforced / classifier only: p50 {ratio50:.2f}, p99 {ratio99:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    asyncio.run(run(parser.parse_args().calls))


if __name__ == "__main__":
    main()
