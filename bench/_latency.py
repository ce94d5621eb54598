"""What the gate-latency benchmarks share: percentiles, their table, and the command line (`--gates N`)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Sequence


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
