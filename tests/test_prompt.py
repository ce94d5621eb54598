"""prompt.py: the section tree, addressing, loop and duplicate detection, edits."""

from pathlib import Path

import pytest

from config import DEFAULTS_DIR
from prompt import PromptError, PromptTree


def tree(d: Path, files: dict[str, str]) -> PromptTree:
    for name, text in files.items():
        (d / (".system_prompt" if name == "" else f".system_prompt_{name}")).write_text(text)
    return PromptTree(d).load()


BASIC = {
    "": "Main paragraph.\n[SECTIONS]\nintro: The intro\ntools: Tools\n\nnot a section line\n",
    "intro": "## intro: The intro\nBe nice.\n",
    "tools": "## tools: Tools\n[SECTIONS]\ntool-a: A\ntool-b: B\n",
    "tool-a": "Use A.",
    "tool-b": "## tool-b: B\nUse B.\n",
}


def test_tree_is_loaded_depth_first_and_assembled(tmp_path):
    t = tree(tmp_path, BASIC)
    assert [(s.name, s.depth, s.parent, s.is_container) for s in t.sections] == [
        ("intro", 0, None, False),
        ("tools", 0, None, True),
        ("tool-a", 1, "tools", False),
        ("tool-b", 1, "tools", False),
    ]
    text = t.assemble()
    assert text.startswith("Main paragraph.")
    assert "## intro: The intro\nBe nice." in text
    assert "### tool-a: A\nUse A." in text and "## tools: Tools" in text
    assert t.problems == []


def test_addressing_by_name_and_index(tmp_path):
    t = tree(tmp_path, BASIC)
    assert t.find(2).name == "tool-a" and t.find("tool-b").name == "tool-b"
    assert t.render("tool-a") == "### tool-a: A\nUse A."
    assert "container of: tool-a, tool-b" in t.render("tools")
    with pytest.raises(PromptError, match=r"Section 'nope' not found. Available sections: 0:intro"):
        t.find("nope")


def test_loop_and_duplicate_are_reported_not_followed(tmp_path):
    t = tree(tmp_path, {
        "": "Root\n[SECTIONS]\na: A\nb: B\n",
        "a": "[SECTIONS]\nb: B again\nc: C\n",
        "b": "Leaf b",
        "c": "[SECTIONS]\na: back to a\n",
    })
    assert any("circular reference to 'a'" in p for p in t.problems)
    assert any("duplicate section name 'b'" in p for p in t.problems)
    assert "[SECTION ERROR: circular reference" in t.assemble()
    with pytest.raises(PromptError, match="broken"):
        t.apply(len(t.sections) - 1, "append", "x")


def test_missing_root_is_created(tmp_path):
    t = PromptTree(tmp_path / "p").load()
    assert (tmp_path / "p" / ".system_prompt").exists() and "agent-mcp" in t.assemble()


def test_edits_rewrite_the_file_and_refuse_containers(tmp_path):
    t = tree(tmp_path, BASIC)
    t.apply("intro", "append", "Be brief.")
    assert t.find("intro").body == "Be nice.\n\nBe brief."
    assert (tmp_path / ".system_prompt_intro").read_text() == "## intro: The intro\nBe nice.\n\nBe brief.\n"
    assert "Be brief." in t.assemble()
    t.apply("intro", "replace", "Be kind.", target="Be nice.")
    t.apply("intro", "delete", target="brief")
    assert PromptTree(tmp_path).load().find("intro").body == "Be kind."
    with pytest.raises(PromptError, match="is a container"):
        t.apply("tools", "append", "x")
    with pytest.raises(PromptError, match="confirm_overwrite"):
        t.apply("intro", "overwrite", "new")
    t.apply("intro", "overwrite", "new", confirm_overwrite=True)
    assert t.find("intro").body == "new"
    with pytest.raises(PromptError, match="unknown operation"):
        t.apply("intro", "shred")


def test_tool_sections_are_sent_only_for_bound_tools():
    tree = PromptTree(DEFAULTS_DIR / ".system_prompt").load()
    full = tree.assemble()
    assert "## tool-db-query: db_query" in full and "## tool-ddgs-search: ddgs_search" in full
    core = tree.assemble(["get_system_info", "db_query"])
    assert "tool-db-query" in core and "tool-get-system-info" in core and "tool-ddgs-search" not in core
    assert "## behavior" in core and "## tools: The tools you have" in core  # non-tool sections stay
    llm = tree.assemble(["llm_list"])  # a section naming several tools stays when one is bound
    assert "tool-llm-delegation" in llm and "tool-db-query" not in llm
    assert len(tree.assemble([])) < len(core) < len(full)
