"""Server CPU per proxied stream, two trees side by side: the fixed cost of a request, measured finely.

`bench/proxy_overhead.py` reads each server's CPU over 20 streams a round, in 10 ms ticks: too coarse for
changes of a few percent. This starts one proxy server from each tree on the same instant fake OpenAI
backend and streams through them in alternating blocks (the order turning every block), each block long
enough for hundreds of ticks, and prints each server's CPU per stream and the first token's p50:

    python bench/proxy_cpu.py BASELINE_TREE [--tree .] [--blocks 10] [--per-block 200] [--tokens 1]

With `--tokens 1` the figure is a stream's own cost, apart from its tokens (issue 31).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.proxy_overhead import Target, start_proxy  # noqa: E402
from bench.turn_overhead import cpu_seconds  # noqa: E402
from tests.fakes.backend import tokens  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402


async def measure(trees: list[Path], blocks: int, per_block: int, n_tokens: int, warmup: int = 30) -> None:
    with FakeOpenAI(default_reply=lambda req: tokens(n_tokens)) as backend, tempfile.TemporaryDirectory() as tmp:
        servers, targets = [], []
        for tree in trees:
            server, url = start_proxy(backend, Path(tmp), tree)
            servers.append(server)
            targets.append(Target(str(tree), url, "agent-mcp:latest"))
        try:
            for target in targets:
                for _ in range(warmup):
                    await target.stream()
            cpu = [0.0] * len(trees)
            firsts: list[list[float]] = [[] for _ in trees]
            for block in range(blocks):
                order = range(len(trees)) if block % 2 == 0 else reversed(range(len(trees)))
                for i in order:
                    before = cpu_seconds(servers[i].proc.pid)  # type: ignore[union-attr]  # started: proc is set
                    for _ in range(per_block):
                        firsts[i].append((await targets[i].stream())[0])
                    cpu[i] += cpu_seconds(servers[i].proc.pid) - before  # type: ignore[union-attr]  # started: proc is set
        finally:
            for target in targets:
                await target.client.close()
            for server in servers:
                server.stop()
    n = blocks * per_block
    for tree, used, first in zip(trees, cpu, firsts, strict=True):
        print(f"{tree}: {used / n * 1e3:.3f} ms server CPU per {n_tokens}-token stream ({n} streams), "
              f"first token p50 {statistics.median(first) * 1e3:.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("baseline", type=Path, help="the other tree (e.g. `git archive main | tar -x -C /tmp/base`)")
    p.add_argument("--tree", type=Path, default=ROOT)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--per-block", type=int, default=200)
    p.add_argument("--tokens", type=int, default=1)
    args = p.parse_args()
    print(f"load average {open('/proc/loadavg').read().split()[:3]}")
    asyncio.run(measure([args.baseline.resolve(), args.tree.resolve()], args.blocks, args.per_block, args.tokens))


if __name__ == "__main__":
    main()
