#!/usr/bin/env python3
"""What enforcement costs per db_query call: a leased runner, its role refilled when the set changes, a clean
session — vs the classifier alone on one account, same run.

Real MariaDB (127.0.0.1:3306, root without password; MYSQL_ADMIN_USER/MYSQL_ADMIN_PASS override).
One run makes its own database and, with the real `agentctl db-setup --runners 8`, its accounts,
plus an account with ALL on the database (the classifier-only baseline, a pool of 8), then runs
`SELECT … FROM users WHERE id = ?` through `database.Database.run`, the two interleaved round by
round, at 1 and at 8 concurrent calls: with one privilege set (a runner's role is refilled only
when a call needs another set) and with two sets alternating (a refill on most calls). Prints p50
and p99 of each and the time added; drops everything it made.

    python bench/db_enforcement.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pymysql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentctl
import agentctl_db
import db_roles
import turns
from database import ACCOUNTS_FILE, Database, DatabaseSettings, read_accounts

HOST, PORT = "127.0.0.1", 3306
ADMIN = (os.environ.get("MYSQL_ADMIN_USER", "root"), os.environ.get("MYSQL_ADMIN_PASS", ""))
USERS = turns.DbAccess("policy", allows=lambda key, op: key == "users" or (key == "__meta__" and op == "read"))
ORDERS = turns.DbAccess("approval", frozenset({("users", "read"), ("orders", "read")}))


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def _timed(database: Database, sql: str, access: turns.DbAccess) -> float:
    started = time.perf_counter()
    outcome = await database.run(sql, access)
    assert outcome.error is None, outcome.error
    return time.perf_counter() - started


async def _measure(enforced: Database, alone: Database, *, calls: int, concurrent: int,
                   sets: tuple[turns.DbAccess, ...]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"classifier only": [], "enforced": []}
    rounds = calls // concurrent
    for i in range(rounds + 20):
        for name, database in (("classifier only", alone), ("enforced", enforced)):
            batch = [_timed(database, f"SELECT name FROM users WHERE id = {(i * concurrent + j) % 1000 + 1}",
                            sets[(i + j) % len(sets)]) for j in range(concurrent)]
            elapsed = await asyncio.gather(*batch)
            if i >= 20:  # warm-up: connections made, runners claimed
                times[name].extend(elapsed)
    return times


async def run(calls: int) -> None:
    suffix = secrets.token_hex(4)
    db = f"bench_dbenforce_{suffix}"
    names = db_roles.names_for(db, runners=8)
    classic = (f"bench_all_{suffix}", secrets.token_hex(12))
    admin = pymysql.connect(host=HOST, port=PORT, user=ADMIN[0], password=ADMIN[1], autocommit=True)
    cur = admin.cursor()
    config = Path(tempfile.mkdtemp(prefix="bench-db-"))
    try:
        cur.execute(f"CREATE DATABASE `{db}`")
        cur.execute(f"CREATE TABLE `{db}`.users (id INT PRIMARY KEY, name VARCHAR(40))")
        cur.execute(f"CREATE TABLE `{db}`.orders (id INT PRIMARY KEY)")
        cur.execute(f"INSERT INTO `{db}`.users SELECT seq, CONCAT('u', seq) FROM `{db}`.seq_1_to_1000")
        (config / ".env").write_text(f"MYSQL_DB={db}\nMYSQL_HOST={HOST}\nMYSQL_PORT={PORT}\n")
        with contextlib.redirect_stdout(io.StringIO()):
            setup = ["--config-dir", str(config), "db-setup", "--runners", "8", "--admin-user", ADMIN[0],
                     "--admin-password", ADMIN[1]]
            assert await asyncio.to_thread(agentctl.main, setup) == 0
        cur.execute("CREATE USER %s@'%%' IDENTIFIED BY %s", classic)
        cur.execute(f"GRANT ALL ON `{db}`.* TO %s@'%%'", (classic[0],))
        base = {"MYSQL_HOST": HOST, "MYSQL_PORT": str(PORT), "MYSQL_DB": db}
        accounts = read_accounts(config / "data" / ACCOUNTS_FILE)
        enforced = Database(DatabaseSettings.from_env({**base, **accounts}))
        alone = Database(DatabaseSettings.from_env({**base, "MYSQL_USER": classic[0], "MYSQL_PASS": classic[1]})
                         .model_copy(update={"pool_size": 8}))
        assert await enforced.enforce() is None, enforced.problem
        assert await alone.enforce() is not None
        print(f"{calls} calls per path and row, interleaved round by round, one SELECT by primary key; "
              "ms per db_query call")
        print("| concurrent calls | privilege sets | classifier only p50 / p99 | enforced p50 / p99 | "
              "added p50 / p99 |\n|---|---|---|---|---|")
        for concurrent in (1, 8):
            for label, sets in (("one", (USERS,)), ("two, alternating", (USERS, ORDERS))):
                times = await _measure(enforced, alone, calls=calls, concurrent=concurrent, sets=sets)
                a, e = times["classifier only"], times["enforced"]
                print(f"| {concurrent} | {label} | {statistics.median(a) * 1e3:.2f} / {_percentile(a, 99) * 1e3:.2f} | "
                      f"{statistics.median(e) * 1e3:.2f} / {_percentile(e, 99) * 1e3:.2f} | "
                      f"{(statistics.median(e) - statistics.median(a)) * 1e3:.2f} / "
                      f"{(_percentile(e, 99) - _percentile(a, 99)) * 1e3:.2f} |")
        await enforced.close()
        await alone.close()
    finally:
        cur.execute(f"DROP DATABASE IF EXISTS `{db}`")
        agentctl_db.remove_setup(cur, names)
        cur.execute("DROP USER IF EXISTS %s@'%%'", (classic[0],))
        admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    asyncio.run(run(parser.parse_args().calls))


if __name__ == "__main__":
    main()
