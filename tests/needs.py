"""What a test needs from the machine (nginx, Redis, MariaDB, Prometheus, bubblewrap), and what happens when it
is absent.

On a fresh machine (`make test` after the README's quick start) such a test is skipped, with the
reason shown in pytest's summary (`-ra`). A name listed in `AGENT_TEST_REQUIRE` (comma-separated:
`nginx`, `redis`, `mariadb`, `prometheus`, `bubblewrap`, or `all`) turns that skip into a failure: `.ci/run`
names them all, so CI can never pass by skipping them.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

#: Every name AGENT_TEST_REQUIRE accepts, with the other spellings a reader may use for it.
NAMES = {"nginx": "nginx", "redis": "redis", "redis-server": "redis", "mariadb": "mariadb", "mariadbd": "mariadb",
         "mysql": "mariadb", "prometheus": "prometheus",
         "bubblewrap": "bubblewrap", "bwrap": "bubblewrap"}


def required() -> set[str]:
    """The names AGENT_TEST_REQUIRE asks for; an unknown name is an error, not a silent skip."""
    asked = {part.strip().lower() for part in os.environ.get("AGENT_TEST_REQUIRE", "").split(",") if part.strip()}
    if "all" in asked:
        return set(NAMES.values())
    unknown = sorted(asked - NAMES.keys())
    if unknown:
        raise pytest.UsageError(f"AGENT_TEST_REQUIRE names {', '.join(unknown)}: use nginx, redis, mariadb, "
                                "prometheus, bubblewrap or all")
    return {NAMES[name] for name in asked}


def absent(what: str, why: str) -> NoReturn:
    """Skip this test because `what` (nginx, redis, mariadb) is missing, or fail when it is required."""
    name = NAMES[what]
    if name in required():
        pytest.fail(f"{why} (AGENT_TEST_REQUIRE names {name}, so this is a failure, not a skip)", pytrace=False)
    pytest.skip(f"{why}; set AGENT_TEST_REQUIRE={name} to fail instead of skipping")


def program(name: str, what: str, install: str) -> str:
    """The path of a system program (also looked for in /usr/sbin), or skip/fail saying how to install it."""
    found = shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/bin")
    if not found:
        absent(what, f"{name} is not installed (Debian: sudo apt-get install -y {install})")
    return found
