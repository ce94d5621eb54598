"""Rules for the test suite itself: no assertion that cannot fail, no test reading the checkout's live
config, missing system programs skip (or fail when AGENT_TEST_REQUIRE names them), and no sleep or
deadline loop in place of waiting for what the test needs (tests/waiting.py)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from tests import needs
from tests.conftest import redis_test_url
from tests.source import parse

TESTS = Path(__file__).resolve().parent


def _always_true(node: ast.expr) -> bool:
    """An expression that is true whatever the code under test does: `True`, a non-empty constant, or an
    `or` with such an operand (`x == y or True`)."""
    if isinstance(node, ast.Constant):
        return bool(node.value)
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
        return any(_always_true(value) for value in node.values)
    return False


def assertions_that_cannot_fail(source: str, name: str) -> list[str]:
    """`file:line` of every `assert` in `source` whose test is always true."""
    return [f"{name}:{node.lineno}" for node in ast.walk(parse(source))
            if isinstance(node, ast.Assert) and _always_true(node.test)]


def test_the_checker_catches_what_it_is_for() -> None:
    bad = "def t():\n    assert True\n    assert x == 1 or True\n    assert (a or 'y')\n    assert 1\n"
    good = "def t():\n    assert x\n    assert x or y\n    assert not True or x\n    assert False, 'no'\n"
    assert assertions_that_cannot_fail(bad, "bad.py") == ["bad.py:2", "bad.py:3", "bad.py:4", "bad.py:5"]
    assert assertions_that_cannot_fail(good, "good.py") == []


def test_no_assertion_in_the_suite_is_always_true() -> None:
    found = [hit for path in sorted(TESTS.rglob("*.py"))
             for hit in assertions_that_cannot_fail(path.read_text(), str(path.relative_to(TESTS.parent)))]
    assert found == [], f"assertions that cannot fail (assert True, assert … or True): {found}"


def test_a_missing_program_skips_with_its_reason(monkeypatch) -> None:
    monkeypatch.delenv("AGENT_TEST_REQUIRE", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"nginx-that-does-not-exist is not installed .*REQUIRE=nginx"):
        needs.program("nginx-that-does-not-exist", "nginx", "nginx-light")


@pytest.mark.parametrize("require", ["nginx", "redis,nginx", "ALL", " nginx "])
def test_a_required_program_that_is_missing_fails(monkeypatch, require) -> None:
    monkeypatch.setenv("AGENT_TEST_REQUIRE", require)
    with pytest.raises(pytest.fail.Exception, match="AGENT_TEST_REQUIRE names nginx"):
        needs.program("nginx-that-does-not-exist", "nginx", "nginx-light")


def test_requiring_another_program_still_skips_this_one(monkeypatch) -> None:
    monkeypatch.setenv("AGENT_TEST_REQUIRE", "mariadb")
    with pytest.raises(pytest.skip.Exception):
        needs.absent("redis-server", "no Redis")


def test_a_misspelt_requirement_is_an_error_not_a_skip(monkeypatch) -> None:
    monkeypatch.setenv("AGENT_TEST_REQUIRE", "ngnix")
    with pytest.raises(pytest.UsageError, match="ngnix"):
        needs.absent("nginx", "no nginx")


def test_ci_requires_every_program() -> None:
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert f"AGENT_TEST_REQUIRE={','.join(dict.fromkeys(needs.NAMES.values()))} make test" in ci


def test_the_tests_redis_is_not_database_0_and_keeps_a_given_prefix(monkeypatch) -> None:
    import tests.conftest as conftest

    if "TEST_REDIS_URL" not in os.environ:
        assert conftest.TEST_REDIS == "redis://127.0.0.1:6379/15"
    monkeypatch.setattr(conftest, "TEST_REDIS", "redis://h:1/3?prefix=ci-newcomer:")
    assert redis_test_url("t1:") == "redis://h:1/3?prefix=ci-newcomer:t1:"
    monkeypatch.setattr(conftest, "TEST_REDIS", "redis://h:1/3")
    assert redis_test_url("t1:") == "redis://h:1/3?prefix=t1:"


# ── Waiting: for a condition, in one place ─────────────────────────────────────────────────

#: Where a sleep or a clock-watching loop is the behaviour, not a wait: `path::function` → why.
TIMED_ON_PURPOSE = {
    "tests/waiting.py": "the one waiting helper: it polls its condition against a generous deadline",
    "tests/test_scale.py::test_a_task_cancelled_during_a_redis_call_ends_there":
        "cancels the Redis calls at 40 moments a few µs apart: the delay is the test's parameter",
    "tests/test_scale.py::loop": "stands for an instance's heartbeat, which sleeps between beats",
    "tests/test_proxy_llama.py::poll": "paces a /health poller that measures how long the server takes to answer",
    "tests/test_routes.py::slow_save": "a session store that really takes time, as SQLite does",
    "tests/fakes/slack.py::wait_for": "waits on a condition variable (woken by every change); the clock only bounds it",
}

_SLEEPERS = {"time", "asyncio", "anyio", "trio"}
_CLOCKS = {"monotonic", "time", "perf_counter", "monotonic_ns"}


def _is_sleep(node: ast.AST) -> bool:
    """`time.sleep(x)` / `asyncio.sleep(x)` with x not the constant 0 (`sleep(0)` only lets other tasks run)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sleep"
            and isinstance(node.func.value, ast.Name) and node.func.value.id in _SLEEPERS
            and not (len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0))


def _reads_clock(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CLOCKS
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "time")


def timed_waits(source: str, name: str) -> list[str]:
    """`name::function:line` of every sleep, and of every `while` loop that reads the clock (a hand-written
    deadline), in `source` (`function` is the innermost one around it, or `<module>`)."""
    found: list[str] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name)
                continue
            if _is_sleep(child):
                found.append(f"{name}::{function}:{child.lineno} sleeps")
            if isinstance(child, ast.While) and any(_reads_clock(n) for n in ast.walk(child)):
                found.append(f"{name}::{function}:{child.lineno} loops on the clock")
            visit(child, function)

    visit(parse(source), "<module>")
    return found


def test_the_wait_checker_catches_what_it_is_for() -> None:
    bad = ("import time, asyncio\n"
           "def t():\n    time.sleep(0.1)\n"
           "async def u():\n    await asyncio.sleep(0.5)\n"
           "def v():\n    deadline = time.monotonic() + 5\n    while time.monotonic() < deadline:\n        pass\n")
    good = ("import time, asyncio\n"
            "async def t():\n    await asyncio.sleep(0)\n"
            "def u():\n    started = time.monotonic()\n    return time.monotonic() - started\n")
    assert timed_waits(bad, "b.py") == ["b.py::t:3 sleeps", "b.py::u:5 sleeps", "b.py::v:8 loops on the clock"]
    assert timed_waits(good, "g.py") == []


def test_the_suite_waits_for_conditions_not_for_time() -> None:
    """A sleep to let something happen fails on a slow machine and wastes time on a fast one; so does a
    hand-written deadline loop beside tests/waiting.py. Wait with `until` / `until_sync` / `within_sync`."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        name = str(path.relative_to(TESTS.parent))
        if name in TIMED_ON_PURPOSE:
            continue
        found += [hit for hit in timed_waits(path.read_text(), name)
                  if hit.rsplit(":", 1)[0] not in TIMED_ON_PURPOSE]
    assert found == [], ("wait for the condition with tests/waiting.py instead (or, if the time is the "
                         f"behaviour under test, add the function to TIMED_ON_PURPOSE with why): {found}")


def test_every_exception_to_the_waiting_rule_is_still_there() -> None:
    """An allow-list entry whose function lost its sleep (or went) is removed, so the list stays short."""
    used = set()
    for path in sorted(TESTS.rglob("*.py")):
        name = str(path.relative_to(TESTS.parent))
        hits = timed_waits(path.read_text(), name)
        used |= {name} if name in TIMED_ON_PURPOSE and hits else set()
        used |= {hit.rsplit(":", 1)[0] for hit in hits}
    assert sorted(set(TIMED_ON_PURPOSE) - used) == []


def test_source_parses_in_a_fresh_interpreter_when_this_ones_ast_state_is_broken(monkeypatch) -> None:
    import ast

    source = "import os\n\ndef f(x):\n    return [y for y in x if y]\n"
    expected = ast.dump(ast.parse(source))

    def broken(*_args: object, **_kwargs: object) -> ast.Module:
        raise SystemError("AST constructor recursion depth mismatch (before=0, after=1)")

    monkeypatch.setattr(ast, "parse", broken)
    assert ast.dump(parse(source)) == expected
