"""What the gate-latency benchmarks share: a server config with one gated db tool and approvers, percentiles,
their table, and the command line (`--gates N`)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from tests.conftest import ConfigDir, one_tool_plugin, openai_model
from tests.fakes.openai_backend import FakeOpenAI

DB_PLUGIN = one_tool_plugin("plugin_test_db", "db_query", "sql", r'"1 row changed"', {"type": "db"}, "Run SQL.")


def gated_config(tmp: str, backend: FakeOpenAI, plugin: str, settings: dict[str, Any],
                 approvals: dict[str, Any]) -> ConfigDir:
    """The fake model, a `db_query` that every call gates, the client `plugin` and the `approvals` classes."""
    cfg = ConfigDir(Path(tmp))
    cfg.models = {"fake": openai_model(backend)}
    cfg.gates = {"db": {}, "tools": {}}
    cfg.add_plugin("plugin_test_db", DB_PLUGIN)
    cfg.plugins.append(plugin)
    cfg.plugin_config[plugin] = settings
    cfg.enabled_extra = {"approvals": {"classes": approvals}}
    return cfg


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(title: str, names: Sequence[str], rows: list[tuple[float, ...]]) -> None:
    """One line per measure: p50 and p99 in ms of column i of `rows` (seconds)."""
    print(title)
    for i, name in enumerate(names):
        values = [r[i] * 1000 for r in rows]
        print(f"  {name:<40} p50 {pct(values, 0.5):7.1f}   p99 {pct(values, 0.99):7.1f}")


def main(doc: str, run: Callable[[int], Awaitable[None]], gates: int = 100) -> None:
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--gates", type=int, default=gates)
    asyncio.run(run(parser.parse_args().gates))
