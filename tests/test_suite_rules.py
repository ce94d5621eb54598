"""Rules for the test suite itself: no assertion that cannot fail, no test reading the checkout's live
config, and missing system programs skip (or fail when AGENT_TEST_REQUIRE names them)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from tests import needs
from tests.conftest import redis_test_url

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
    return [f"{name}:{node.lineno}" for node in ast.walk(ast.parse(source))
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
