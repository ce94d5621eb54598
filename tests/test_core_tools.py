"""Core tools (system prompt, delegation) and the prompt / delegation commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

import models
from tests.conftest import openai_model
from tests.fakes.backend import hang, text, tool_call
from tests.runtime import ALL_OPEN, Recorder, add_plugin_tools, execute, runtime, turn, with_events


@pytest.fixture
async def crt(tmp_path, fake_openai):
    models = {
        "fake": openai_model(fake_openai, tool_call_available=True, description="the fake"),
        "helper": openai_model(fake_openai, tool_call_available=True, llm_call_timeout=2),
        "locked": openai_model(fake_openai),
    }
    async with runtime(tmp_path, models) as rt:
        yield rt


async def call(rt, name: str, **args) -> str:
    return await execute(rt, "c1", name, args)


def prompt_file(rt, name: str) -> Path:
    return rt.prompt.directory / f".system_prompt_{name}"


async def test_update_system_prompt_every_operation(crt) -> None:
    crt.gate.set_override(
        await crt.sessions.get_or_create("c1", "fake"), "tools", "update_system_prompt", "write", True
    )
    before = crt.prompt.find("behavior").body
    assert (await call(crt, "update_system_prompt", section="behavior", operation="append", content="Be brief.")
            ).startswith("Section 'behavior' updated (append)")
    assert crt.prompt.find("behavior").body == before + "\n\nBe brief."
    assert "Be brief." in crt.prompt.assemble() and "Be brief." in prompt_file(crt, "behavior").read_text()
    await call(crt, "update_system_prompt", section="behavior", operation="prepend", content="Rule zero.")
    assert crt.prompt.find("behavior").body.startswith("Rule zero.\n\n")
    await call(crt, "update_system_prompt", section="behavior", operation="replace", content="Be terse.",
               target="Be brief.")
    assert crt.prompt.find("behavior").body.endswith("Be terse.")
    await call(crt, "update_system_prompt", section="behavior", operation="delete", target="terse")
    assert "terse" not in crt.prompt.find("behavior").body
    index = str([s.name for s in crt.prompt.sections].index("behavior"))
    out = await call(crt, "update_system_prompt", section=index, operation="overwrite", content="Only this.")
    assert out.startswith("Prompt update rejected:") and "confirm_overwrite" in out
    await call(crt, "update_system_prompt", section=index, operation="overwrite", content="Only this.",
               confirm_overwrite=True)
    assert prompt_file(crt, "behavior").read_text() == "## behavior: How to answer\nOnly this.\n"
    assert crt.prompt.load().find("behavior").body == "Only this."


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"section": "tools", "operation": "append", "content": "x"}, "is a container"),
        (
            {"section": "nope", "operation": "append", "content": "x"},
            "Section 'nope' not found. Available sections: 0:",
        ),
        ({"section": "behavior", "operation": "append"}, "append needs content"),
        ({"section": "behavior", "operation": "prepend"}, "prepend needs content"),
        ({"section": "behavior", "operation": "replace", "content": "x", "target": "not there"}, "needs a target"),
        ({"section": "behavior", "operation": "delete"}, "delete needs a target"),
        ({"section": "behavior", "operation": "delete", "target": "no such line"}, "no line of section"),
        ({"section": "behavior", "operation": "overwrite", "confirm_overwrite": True}, "overwrite needs content"),
    ],
)
async def test_update_system_prompt_errors(crt, args, message) -> None:
    crt.gate.set_override(
        await crt.sessions.get_or_create("c1", "fake"), "tools", "update_system_prompt", "write", True
    )
    before = {p.name: p.read_text() for p in crt.prompt.directory.iterdir()}
    out = await call(crt, "update_system_prompt", **args)
    assert out.startswith("Prompt update rejected:") and message in out, out
    assert {p.name: p.read_text() for p in crt.prompt.directory.iterdir()} == before


async def test_unknown_operation_is_an_argument_error(crt) -> None:
    out = await call(crt, "update_system_prompt", section="behavior", operation="shred")
    assert out.startswith("ERROR: invalid arguments for update_system_prompt: operation")


async def test_update_system_prompt_is_gated_by_default(crt) -> None:
    await crt.sessions.get_or_create("c1", "fake")
    out, events = await with_events(crt, "c1", call(crt, "update_system_prompt", section="behavior",
                                                    operation="append", content="x"), answer="reject")
    (gate_event,) = [e for e in events if e.name == "gate"]
    assert gate_event.data["tool_args"]["operation_type"] == "write" and gate_event.data["tables"] == []
    assert out.startswith("TOOL CALL REJECTED") and "x" not in crt.prompt.find("behavior").body.split("\n")


async def test_tree_with_a_loop_and_a_duplicate(crt) -> None:
    d = crt.prompt.directory
    (d / ".system_prompt").write_text("Root.\n[SECTIONS]\nbehavior: How\nloop-a: A\nshared: S\n")
    (d / ".system_prompt_loop-a").write_text("## loop-a: A\n[SECTIONS]\nloop-b: B\nshared: again\n")
    (d / ".system_prompt_loop-b").write_text("[SECTIONS]\nloop-a: back\n")
    (d / ".system_prompt_shared").write_text("Shared text.")
    out, _ = await turn(crt, "!sysprompt reload")
    assert "circular reference to 'loop-a'" in out and "duplicate section name 'shared'" in out
    listing = await call(crt, "read_system_prompt")
    assert "loop-a [container]" in listing and "loop-b [container]" in listing
    looped = next(i for i, s in enumerate(crt.prompt.sections) if s.error and "circular" in s.error)
    assert "[SECTION ERROR: circular reference" in await call(crt, "read_system_prompt", section=str(looped))
    crt.gate.set_override(crt.sessions.get("c1"), "tools", "update_system_prompt", "write", True)
    broken = str(len(crt.prompt.sections) - 1)  # the duplicate's placeholder comes last
    out = await call(crt, "update_system_prompt", section=broken, operation="append", content="x")
    assert out.startswith("Prompt update rejected:") and "broken" in out
    assert (await call(crt, "update_system_prompt", section="shared", operation="append", content="More.")
            ).startswith("Section 'shared' updated")


PROMPT_COMMANDS = [  # (command, how its output starts)
    ("!sysprompt", "--- Current system prompt ---\nYou are agent-mcp"),
    ("!sysprompt now", "ERROR: Invalid arguments"),
    ("!read_system_prompt", "--- Cached system prompt ---\nYou are agent-mcp"),
    ("!read_system_prompt behavior", "--- Section: behavior ---\n## behavior: How to answer\n"),
    ("!read_system_prompt 0", "--- Section: 0 ---\n## behavior: How to answer\n"),
    ("!read_system_prompt nope", "Section 'nope' not found.\n\nAvailable sections:\n  [0] behavior: How to answer"),
]


async def test_prompt_commands(crt) -> None:
    for command, start in PROMPT_COMMANDS:
        out, _ = await turn(crt, command)
        assert out.startswith(start), (command, out[:200])
    prompt_file(crt, "behavior").write_text("## behavior: How to answer\nEdited on disk.\n")
    out, _ = await turn(crt, "!sysprompt reload")
    assert out.startswith("System prompt reloaded from disk (") and "Edited on disk." in crt.prompt.assemble()


async def test_read_system_prompt_tool_reports_unknown_sections(crt) -> None:
    out = await call(crt, "read_system_prompt", section="nope")
    assert out.startswith("ERROR: Section 'nope' not found")


async def test_llm_list_shows_models_without_hosts(crt, fake_openai) -> None:
    await crt.sessions.get_or_create("c1", "fake")
    out = await call(crt, "llm_list")
    assert "- fake (this session's model): OPENAI fake-gpt; delegation YES, timeout 10 s, max_context 50" in out
    assert "- locked: OPENAI fake-gpt; delegation no" in out and "the fake" in out
    assert fake_openai.base_url not in out and "127.0.0.1" not in out


async def test_llm_clean_text(crt, fake_openai) -> None:
    fake_openai.script(text("A ", "summary."))
    assert await call(crt, "llm_clean_text", model="helper", prompt="Summarise: long text") == "A summary."
    sent = fake_openai.requests[-1].json
    assert sent["messages"] == [{"role": "user", "content": "Summarise: long text"}] and "tools" not in sent
    out = await call(crt, "llm_clean_text", model="locked", prompt="x")
    assert "does not accept delegation" in out and "!llm_call locked true" in out
    assert (await call(crt, "llm_clean_text", model="nope", prompt="x")).startswith("ERROR: unknown model 'nope'")
    fake_openai.script(hang(5))
    out = await call(crt, "llm_clean_text", model="helper", prompt="x")
    assert out.startswith("ERROR: llm_clean_text: model 'helper'") and "within 2" in out


class _Word(BaseModel):
    word: str


async def test_llm_clean_tool_native_and_text_calls(crt, fake_openai) -> None:
    recorder = Recorder()
    add_plugin_tools(
        crt, "plugin_test_shout", [recorder.tool("shout", _Word, reply="SHOUTED")], {"shout": {"type": "search"}}
    )
    crt.gate.set_override(await crt.sessions.get_or_create("c1", "fake"), "tools", "shout", "read", True)
    fake_openai.script(tool_call("shout", {"word": "hey"}), text("It shouted."))
    out = await call(crt, "llm_clean_tool", model="helper", tool="shout", arguments="shout hey")
    assert out == 'helper called shout({"word": "hey"}).\nIt shouted.'
    first, second = fake_openai.requests[-2:]
    assert [t["function"]["name"] for t in first.json["tools"]] == ["shout"]
    assert first.json["messages"][-1] == {"role": "user", "content": "shout hey"}
    assert second.json["messages"][-1]["role"] == "tool" and second.json["messages"][-1]["content"].startswith(
        "SHOUTED"
    )
    # A local model that writes the call as text works too.
    fake_openai.script(text('<tool_call>{"name": "shout", "arguments": {"word": "ho"}}</tool_call>'), text("Done."))
    out = await call(crt, "llm_clean_tool", model="helper", tool="shout", arguments="shout ho")
    assert out.endswith("Done.") and recorder.calls[-1] == ("shout", {"word": "ho"})
    assert fake_openai.requests[-1].json["messages"][-1]["content"].startswith("[Tool result for shout]:\nSHOUTED")
    # No call: the model's words come back; delegation tools cannot be delegated; gates still apply.
    fake_openai.script(text("I would rather not."))
    assert "did not call shout; it answered: I would rather not." in await call(
        crt, "llm_clean_tool", model="helper", tool="shout", arguments="x")
    assert "cannot be delegated" in await call(crt, "llm_clean_tool", model="helper", tool="llm_clean_text",
                                               arguments="x")
    assert "does not accept delegation" in await call(crt, "llm_clean_tool", model="locked", tool="shout",
                                                      arguments="x")
    crt.gate.set_override(crt.sessions.get("c1"), "tools", "shout", "read", False)
    fake_openai.script(tool_call("shout", {"word": "no"}), text("It was rejected."))
    out, events = await with_events(crt, "c1", call(crt, "llm_clean_tool", model="helper", tool="shout",
                                                    arguments="x"), answer="reject")
    assert [e for e in events if e.name == "gate"] and out.endswith("It was rejected.")
    assert fake_openai.requests[-1].json["messages"][-1]["content"].startswith("TOOL CALL REJECTED")
    assert len(recorder.calls) == 2


async def test_llm_call_and_llm_timeout_commands_persist(crt, tmp_path) -> None:
    out, _ = await turn(crt, "!llm_call")
    assert "LLM tool_call_available status:" in out and "locked         tool_call=NO  timeout=10s" in out
    out, _ = await turn(crt, "!llm_call locked true")
    assert out.startswith("tool_call_available=enabled set for locked\nChanges persisted to")
    assert crt.config.models["locked"].tool_call_available is True
    saved = json.loads((tmp_path / "llm-models.json").read_text())["models"]
    assert saved["locked"]["tool_call_available"] is True and saved["fake"]["description"] == "the fake"
    out, _ = await turn(crt, "!llm_call false")
    assert "set for all models: fake, helper, locked" in out
    assert not any(m.tool_call_available for m in crt.config.models.values())
    out, _ = await turn(crt, "!llm_call nosuch true")
    assert out.startswith("ERROR: Unknown model 'nosuch'")
    out, _ = await turn(crt, "!llm_call locked perhaps")
    assert out.startswith("ERROR: Invalid arguments")
    before = models.chat_model(crt.llms, crt.config, "helper")
    out, _ = await turn(crt, "!llm_timeout helper 7.5")
    assert out.startswith("llm_call_timeout=7.5s set for helper\nChanges persisted to")
    after = models.chat_model(crt.llms, crt.config, "helper")  # the model's own calls use the new timeout too
    assert after is not before and (before.request_timeout, after.request_timeout) == (2, 7.5)
    assert json.loads((tmp_path / "llm-models.json").read_text())["models"]["helper"]["llm_call_timeout"] == 7.5
    out, _ = await turn(crt, "!llm_timeout")
    assert "helper         timeout=7.5s" in out
    for bad in ("!llm_timeout -1", "!llm_timeout helper soon", "!llm_timeout inf", "!llm_timeout a b c"):
        out, _ = await turn(crt, bad)
        assert out.startswith("ERROR: Invalid arguments") and "positive number" in out, bad


async def test_help_lists_every_command_and_tool(crt) -> None:
    out, _ = await turn(crt, "!help")
    for command in ("!autoAIdb", "!autogate", "!autoAISysPrompt", "!ratelimit", "!sysprompt", "!read_system_prompt",
                    "!llm_call", "!llm_timeout", "!model", "!session"):
        assert command in out, command
    for tool, kind in (("update_system_prompt", "system"), ("llm_clean_tool", "llm_call"), ("llm_list", "system")):
        assert re.search(rf"\n  {tool} +\[{kind}\] ", out), tool
    assert "Gates:" in out and "allow for this session" in out


async def test_gate_tool_declarations_are_validated(tmp_path, fake_openai) -> None:
    from registry import ToolRegistrationError

    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, gates=ALL_OPEN) as rt:
        tool = Recorder().tool("thing", _Word)
        rt.tools.register_plugin_tools("plugin_x", {"lc": [tool]})
        for bad, why in (
            ({"operation": "read"}, "needs a 'type'"),
            ({"type": "db", "operation": "delete"}, "operation"),
            ("db", "needs a 'type'"),
        ):
            with pytest.raises(ToolRegistrationError, match=why):
                rt.tools.register_gate_tools("plugin_x", {"thing": bad})
        rt.tools.register_gate_tools("plugin_x", {"thing": {"type": "drive", "operation": lambda a: "write"}})
        assert rt.tools.entry("thing").gate["type"] == "drive"
