"""Normal use never changes a tracked file: `git status` of the checkout is clean after a session.

The test copies the tracked files of this checkout into a fresh git repository and uses that copy as
a user does after `git clone`: agentctl edits the configuration, `agent-mcp.py` runs without
--config-dir (the checkout is the config dir), a turn edits the system prompt, `!llm_timeout`
writes the models file, `agentctl repair` saves a broken file aside.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import config
from tests.conftest import ROOT, AgentServer, ConfigDir, free_port
from tests.fakes.backend import text, tool_call
from tests.turns import answer, run_turn

GIT = ["git", "-c", "user.name=agent-mcp tests", "-c", "user.email=tests@agent-mcp.invalid",
       "-c", "init.defaultBranch=main"]


def _git(where: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=where, capture_output=True, text=True, check=True, timeout=60).stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A fresh clone-like copy of the tracked files, committed, with nothing else in it."""
    if shutil.which("git") is None:
        pytest.fail("git is needed to check that normal use leaves the checkout clean", pytrace=False)
    tracked = [line for line in _git(ROOT, "ls-files", "-z").split("\0") if line]
    copy = tmp_path / "agent-mcp"
    for name in tracked:
        source = ROOT / name
        if source.is_file():  # a file deleted in the work tree but not yet in the index is left out
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    _git(copy, "init", "-q")
    _git(copy, "add", "-A")
    _git(copy, "commit", "-q", "-m", "as cloned")
    return copy


def _agentctl(copy: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, str(copy / "agentctl.py"), *args], cwd=copy, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_session_of_normal_use_leaves_git_status_clean(checkout: Path, fake_openai) -> None:
    cfg = ConfigDir(checkout)  # the checkout is the config dir, as for `make run`
    _agentctl(checkout, "port-set", "plugin_client_shellpy", str(cfg.port))
    _agentctl(checkout, "port-set", "plugin_client_api", str(free_port()))
    _agentctl(checkout, "model-add", "fake", "--model-id", "fake-gpt", "--type", "OPENAI", "--host",
              fake_openai.base_url, "--timeout", "20")
    _agentctl(checkout, "model", "fake")
    _agentctl(checkout, "gate-set", "update_system_prompt", "write", "true")
    _agentctl(checkout, "disable", "plugin_search_ddgs")

    server = AgentServer(cfg, {"SESSION_STORE": "sqlite"}, checkout=checkout).start()
    try:
        fake_openai.script(tool_call("update_system_prompt", {"section": "behavior", "operation": "append",
                                                              "content": "Always answer in haiku."}), text("Done."))
        assert answer(run_turn(server, "user", "change your behaviour")) == "Done."
        assert "fake" in answer(run_turn(server, "user", "!llm_timeout fake 30"))
        run_turn(server, "user", "!autogate search true")
    finally:
        log = server.stop()
    assert "Traceback" not in log
    assert '"llm_call_timeout": 30,' in (checkout / config.MODELS_FILE).read_text()  # 30 stays 30, not 30.0
    (checkout / config.MODELS_FILE).write_text("{not json")
    _agentctl(checkout, "repair", config.MODELS_FILE)

    # Everything landed in the checkout's own copies …
    assert "Always answer in haiku." in (checkout / ".system_prompt" / ".system_prompt_behavior").read_text()
    assert json.loads((checkout / config.MODELS_FILE).read_text())["models"]["local"]  # repaired from defaults/
    assert list(checkout.glob(f"{config.MODELS_FILE}.broken-*"))
    assert (checkout / "data" / "sessions.sqlite3").exists()
    # … and none in a tracked file: nothing modified, nothing untracked that git would show.
    assert _git(checkout, "status", "--porcelain", "--untracked-files=all") == ""
    shipped = checkout / "defaults" / ".system_prompt" / ".system_prompt_behavior"
    assert "Always answer in haiku." not in shipped.read_text()
