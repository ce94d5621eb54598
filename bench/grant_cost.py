#!/usr/bin/env python3
"""What a grant costs per tool call: matching the session's grants and appending to the audit log.

One runtime in one process (a temporary data dir, the real SQLite audit file). The same `db_query`
call runs through the tool pipeline (`rt.pipeline.execute`) two ways, interleaved call by call: allowed by
gate-defaults (the baseline: no grant lookup, nothing audited) and allowed by a grant of its session (the lookup
among `--grants` other grants of that session, the use counted and written, one audit record
appended with its hash). Prints p50 and p99 of both and of the difference.

    python bench/grant_cost.py [--calls 3000] [--grants 50]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from langchain_core.tools import StructuredTool
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import audit_log
import build
import client_classes
import decisions
import grants
import routes
import state
import stores
from audit_chain import AuditRecord
from config import load_config
from tests.conftest import ConfigDir

OPEN = {"db": {"*": {"read": True, "write": True}}, "tools": {"*": {"read": True, "write": True}}}
GATED = {"db": {}, "tools": {}}


class _Sql(BaseModel):
    sql: str


async def _ok(sql: str) -> str:
    return "1 row"


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def _runtime(directory: Path, gates: dict) -> state.Runtime:
    cfg = ConfigDir(directory)
    cfg.models = {"fake": {"type": "OPENAI", "model_id": "fake", "host": "http://127.0.0.1:9/v1", "env_key": "K"}}
    cfg.gates = gates
    cfg.env = {"K": "k"}
    rt = await build.build_runtime(load_config(cfg.write().path), store=stores.MemoryStore())
    rt.tools.register_plugin_tools("bench", {"lc": [StructuredTool.from_function(
        coroutine=_ok, name="db_query", description="SQL", args_schema=_Sql)]})
    rt.tools.register_gate_tools("bench", {"db_query": {"type": "db"}})
    await rt.sessions.get_or_create("s", "fake")
    return rt


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("open", "gated"):
            (Path(tmp) / name).mkdir()
        base = await _runtime(Path(tmp) / "open", OPEN)
        granted = await _runtime(Path(tmp) / "gated", GATED)
        try:
            store = granted.gate.grants
            assert store is not None
            given = [grants.new_grant("s", grants.Decision(decisions.TIMED, "bench", 60), "db_query", "db",
                                      [f"table_{n}"], "write")  # other grants of the session the lookup passes over
                     for n in range(args.grants)]
            given.append(grants.new_grant("s", grants.Decision(decisions.SESSION, "bench"), "db_query", "db",
                                          ["users"], "write"))
            for grant in given:  # each backed by its grant record, as the gate gives them (audit-verify checks)
                call = AuditRecord.call("s", "db_query", "write", grant.keys)
                grant.audit_seq = store.audit(call.grant("bench", "granted", grant.id))
                store.add(grant)
            calls = {"baseline": (base, routes.Request("s", client_classes.UNKNOWN).turn()),
                     "grant": (granted, routes.Request("s", client_classes.UNKNOWN).turn())}
            for rt, turn in calls.values():
                turn.session = rt.sessions.get("s")
            times: dict[str, list[float]] = {name: [] for name in calls}
            sql = {"sql": "UPDATE users SET name = 'x' WHERE id = 1"}
            for i in range(args.calls + 100):
                for name, (rt, turn) in calls.items():
                    started = time.perf_counter()
                    outcome = await rt.pipeline.execute(turn, "db_query", sql)
                    elapsed = time.perf_counter() - started
                    assert outcome.status == "ok", outcome.text
                    if i >= 100:  # warm-up
                        times[name].append(elapsed)
            await store.flush()
            records = audit_log.verify_file(granted.config.data_dir() / grants.AUDIT_FILE).head.count
            assert records == args.calls + 100 + len(given)
        finally:
            await build.close_runtime(base)
            await build.close_runtime(granted)
    added = [g - b for g, b in zip(times["grant"], times["baseline"], strict=True)]
    print(f"{args.calls} calls each, {args.grants + 1} grants in the session; times per tool call (ms)")
    print("| path | p50 | p99 |\n|---|---|---|")
    for name, values in (*times.items(), ("added by the grant", added)):
        print(f"| {name} | {statistics.median(values) * 1e3:.3f} | {_percentile(values, 99) * 1e3:.3f} |")
    print(f"audit chain verified: {records} records")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--grants", type=int, default=50)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
