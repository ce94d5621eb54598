"""The README's copy-paste recipes, run as a reader runs them, against a started server with the fake backend.

Each fenced block after a `<!-- recipe: NAME -->` line is extracted and run (sh with bash, python with
this interpreter) in the server's config dir, where `data/api-key`, `data/shell-token` and
`mcp-tokens.json` are; only the shipped port numbers are replaced by the test server's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, AgentServer, ConfigDir, free_port, openai_model

RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\n\s*```(sh|python)\n(.*?)\n\s*```", re.S)

#: What each recipe's output shows when it worked (the fake backend echoes: "echo: <message>").
EXPECTED = {
    "api-wait": ["complete", "echo: hello"],
    "api-stream": ["event: done", '"cancelled"'],
    "api-python": ["echo: hello", "echo: count to 5"],
    "proxy-curl": ["agent-mcp", "echo: hello"],
    "sdk-openai": ["echo: hello"],
    "sdk-ollama": ["echo: hello"],
    "mcp-python": ["echo: hello"],
    "health": ["status", "instances"],
    "slack": ["✓", "plugin_client_slack"],
}
#: Recipes that need a service this test does not start, and the test that covers that path instead.
ELSEWHERE = {"mysql": "tests/test_db_accounts.py (the recipe against real MariaDB, then a restart)",
             "mysql-db": "tests/test_db_accounts.py (after the mysql recipe, through the API with the admin key)"}


def recipes() -> dict[str, tuple[str, str]]:
    found = {name: (kind, body) for name, kind, body in RECIPE.findall((ROOT / "README.md").read_text())}
    return {name: (kind, "\n".join(line[2:] if line.startswith("  ") else line for line in body.splitlines())
                   if body.startswith("  ") else body) for name, (kind, body) in found.items()}


def test_every_recipe_is_run_or_named_as_covered_elsewhere() -> None:
    assert set(recipes()) == set(EXPECTED) | set(ELSEWHERE)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.fakes.openai_backend import FakeOpenAI

    with FakeOpenAI() as backend:
        cfg = ConfigDir(tmp_path_factory.mktemp("readme"))
        cfg.models = {"fake": openai_model(backend)}
        ports = {8765: cfg.port, 8767: free_port(), 11435: free_port(), 8768: free_port()}
        cfg.plugins += ["plugin_client_api", "plugin_proxy_llama", "plugin_client_mcp"]
        cfg.plugin_config.update({"plugin_client_api": {"port": ports[8767]},
                                  "plugin_proxy_llama": {"enabled": True, "port": ports[11435]},
                                  "plugin_client_mcp": {"enabled": True, "port": ports[8768]}})
        running = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            yield cfg.path, ports
        finally:
            running.stop()


def _run(name: str, where: Path, ports: dict[int, int]) -> str:
    kind, body = recipes()[name]
    for shipped, port in ports.items():
        body = body.replace(f"127.0.0.1:{shipped}", f"127.0.0.1:{port}")
    # `.venv/bin/python agentctl.py` is this interpreter and this checkout's agentctl, on the test's config dir.
    body = body.replace(".venv/bin/python agentctl.py", f"{sys.executable} {ROOT / 'agentctl.py'} --config-dir .")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENT_DATA_DIR": str(where / "data"), "API_ADMIN_KEY": ""}
    command = ["bash", "-euo", "pipefail", "-c", body] if kind == "sh" else [sys.executable, "-c", body]
    done = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"recipe {name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.mark.parametrize("name", [n for n in EXPECTED if n != "slack"])
def test_recipe_runs_against_the_server(server, name) -> None:
    where, ports = server
    out = _run(name, where, ports)
    for expected in EXPECTED[name]:
        assert expected in out, f"recipe {name}: {expected!r} not in its output:\n{out}"


def test_the_slack_recipe_switches_its_plugin_on(tmp_path) -> None:
    """The enabling half of the recipe (the service itself is the subject of the plugin's own tests)."""
    out = _slack_enable(tmp_path)
    for expected in EXPECTED["slack"]:
        assert expected in out


def _slack_enable(where: Path) -> str:
    body = recipes()["slack"][1]
    line = next(line for line in body.splitlines() if "agentctl.py enable" in line)
    return subprocess.run([sys.executable, str(ROOT / "agentctl.py"), "--config-dir", str(where),
                           *line.split("agentctl.py", 1)[1].split()], capture_output=True, text=True,
                          timeout=60).stdout
