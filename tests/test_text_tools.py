"""Text tool calls of local models (parsing, streaming, feeding back) and the router step."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field

from agents import AFTER_RESULTS
from sessions import trim_history
from tests.conftest import openai_model
from tests.fakes.backend import error, text, tool_call
from tests.runtime import ALL_OPEN, Recorder, add_plugin_tools, runtime, turn
from text_calls import TextCallFilter, find_text_calls, try_force_tool_calls


class _Weather(BaseModel):
    city: str
    days: int = Field(default=1)
    units: str | None = None


class _Sql(BaseModel):
    sql: str


async def _noop(**kwargs: Any) -> str:
    return "x"


TOOLS = {
    name: StructuredTool.from_function(coroutine=_noop, name=name, description=name, args_schema=schema)
    for name, schema in (("get_weather", _Weather), ("db_query", _Sql), ("read_file", _Sql))
}


def calls(reply: str) -> list[tuple[str, dict[str, Any]]]:
    found, _ = try_force_tool_calls(reply, TOOLS)
    return [(c["name"], c["args"]) for c in found]


PARIS = ("get_weather", {"city": "Paris"})

WELL_FORMED = [
    # Qwen 2.5 / Hermes: <tool_call> with JSON, one or several
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', [PARIS]),
    (
        'I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
        [PARIS, ("get_weather", {"city": "Rome", "days": 2})],
    ),
    # Qwen3-Coder: <function=…><parameter=…> XML inside <tool_call>, typed by the schema
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call>",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    ("<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>", [("get_weather", {"city": "42"})]),
    # Llama 3.1: <function=name>{json}</function>, <|python_tag|> and bare JSON with "parameters"
    ('<function=get_weather>{"city": "Paris"}</function>', [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
    ('  {"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}\n', [PARIS]),
    (
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "db_query", "arguments": {"sql": "SHOW TABLES"}}]',
        [PARIS, ("db_query", {"sql": "SHOW TABLES"})],
    ),
    # Gemma: ```tool_code with Python-style calls
    ('```tool_code\nget_weather(city="Paris")\n```', [PARIS]),
    (
        "```tool_code\nprint(default_api.get_weather(city='Paris', days=2))\n```",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    ('[get_weather(city="Paris")]'.join(["```tool_code\n", "\n```"]), [PARIS]),
    # fenced JSON, with prose around it
    ('Let me check.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n', [PARIS]),
    # seed 004's <tool_code>{"tool_name", "arguments"}</tool_code>
    (
        '<tool_code>{"tool_name": "read_file", "arguments": {"sql": "mcp.json"}}</tool_code>',
        [("read_file", {"sql": "mcp.json"})],
    ),
    # chat-template artefacts and encodings
    ('<tool_call>{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}</tool_call>', [PARIS]),
    ('{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}', [PARIS]),  # a whole reply, doubled
    # Qwen 1.5B echoing the tag its chat template lists tools in
    ('To read it:\n\n<tools>\n    {"name": "get_weather", "arguments": {"city": "Paris"}}\n</tools>', [PARIS]),
    ('{{"name": "get_weather", "arguments": {"city": "Paris"}}}}', [PARIS]),  # doubled unevenly (Qwen 1.5B)
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', [PARIS]),
    ('<tool_call>{"function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}</tool_call>', [PARIS]),
    # an unclosed tag at the end of the reply (the model stopped at its stop token)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', [PARIS]),
    # the JSON schema a small model copied into its call is unwrapped
    ('```json\n{"name": "get_weather", "arguments": {"properties": {"city": "Paris"}, "type": "object"}}\n```',
     [PARIS]),
    ('{"name": "get_weather", "arguments": {"properties": {"city": {"type": "string"}}, "type": "object"}}',
     [("get_weather", {})]),
    # duplicates are dropped
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',
        [PARIS],
    ),
]


@pytest.mark.parametrize(("reply", "expected"), WELL_FORMED, ids=[r[:40] for r, _ in WELL_FORMED])
def test_text_tool_call_formats(reply: str, expected: list[tuple[str, dict[str, Any]]]) -> None:
    assert calls(reply) == expected


MUST_NOT_RUN = [
    # prose is never SQL
    "SELECT * FROM users",
    "Update: I checked the table and everything is fine.",
    "Show me the tables? Sure: DESCRIBE users would list the columns.",
    "DELETE the old rows first, then we can talk.",
    # JSON inside prose without call syntax (could be echoed from a web page)
    'Here is an example payload: {"name": "get_weather", "arguments": {"city": "Paris"}} as you can see.',
    # unknown tools, wrong argument types, truncation, positional or non-literal Python arguments
    '<tool_call>{"name": "format_disk", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
    '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
    '```tool_code\nget_weather("Paris")\n```',
    '```tool_code\nget_weather(city=__import__("os").system("rm -rf /"))\n```',
    '```tool_code\nimport os\nget_weather(city="Paris")\n```',
    # ordinary code blocks
    '```python\nget_weather(city="Paris")\n```',
    '```json\n{"city": "Paris", "temperature": 21}\n```',
    '{"city": "Paris", "temperature": 21}',
    # one bad call poisons its block: nothing from it runs
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"oops": 1}]</tool_call>',
]


@pytest.mark.parametrize("reply", MUST_NOT_RUN, ids=[r[:40] for r in MUST_NOT_RUN])
def test_malformed_or_prose_replies_do_not_run(reply: str) -> None:
    assert calls(reply) == []


def test_a_reply_of_bare_arguments_is_a_problem_to_correct_not_a_call() -> None:
    """Qwen 1.5B, asked to read a prompt section, replied `{"section": "backups"}`: the arguments of one tool."""
    found = find_text_calls('{"city": "Paris", "days": 2}', TOOLS)
    assert found.calls == [] and found.problems == [
        'arguments without a tool name (a call of get_weather?): {"city": "Paris", "days": 2}']
    assert find_text_calls('{"sql": "SELECT 1"}', TOOLS).problems == []  # db_query or read_file: nobody's to guess
    # Arguments under "arguments" without a name (Qwen 1.5B, the same task, another sample).
    assert find_text_calls('```json\n{"arguments": {"city": "Paris"}}\n```', TOOLS).problems == [
        "a call without a tool name (of get_weather? write its name)"]
    assert find_text_calls('{"city": "Paris", "temperature": 21}', TOOLS).problems == []  # ordinary JSON


def test_a_correction_shows_the_generic_shape_when_no_tool_is_meant() -> None:
    from text_calls import correction
    told = correction(["unknown tool 'x'"], list(TOOLS.values()), text_mode=True)
    assert 'To call one, write exactly:\n<tool_code>{"tool_name": "<tool name>", "arguments"' in told
    told = correction(["x"], list(TOOLS.values()), text_mode=True, meant=("db_query", None))
    assert 'To call db_query, write exactly:\n<tool_code>{"tool_name": "db_query", "arguments": {"sql": "<string>"}}' \
           in told


def test_spans_cover_only_the_call_syntax() -> None:
    reply = 'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\nOne moment.'
    found, spans = try_force_tool_calls(reply, TOOLS)
    assert len(found) == 1 and found[0]["id"].startswith("text-")
    assert [reply[a:b] for a, b in spans] == [reply[reply.index("<tool_call>"):reply.index("\nOne")]]


def _stream(chunks: list[str]) -> tuple[list[str], str]:
    """What a client sees while the chunks stream, and at the end."""
    hold = TextCallFilter()
    shown = [hold.feed(c) for c in chunks]
    return shown, hold.finish(try_force_tool_calls("".join(chunks), TOOLS)[1])


def test_stream_filter_hides_calls_split_across_chunks() -> None:
    shown, rest = _stream(["Let me ", "check.\n<tool", '_call>{"name": "get_weather", ',
                           '"arguments": {"city": "Paris"}}</tool_call>', "\nDone."])
    assert "".join(shown) == "Let me check.\n" and rest == "Done."


def test_stream_filter_releases_held_text_that_is_no_call() -> None:
    shown, rest = _stream(["Use ", "<tool_code> tags ", "like this."])
    assert "".join(shown) == "Use " and rest == "<tool_code> tags like this."
    shown, rest = _stream(["  {", '"city": "Paris"}'])
    assert "".join(shown) == "" and rest == '  {"city": "Paris"}'
    shown, rest = _stream(["plain ", "answer <b", "old> text"])
    assert "".join(shown) + rest == "plain answer <bold> text" and "".join(shown) == "plain answer <bold> text"


def test_trim_history_never_starts_at_a_tool_result_message() -> None:
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<tool_call>…"},
               {"role": "user", "content": "[Tool result for x]: 1", "tool_results": True},
               {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
               {"role": "assistant", "content": "a2"}]
    assert trim_history(history, 4) == history[4:]


# ── In a turn ───────────────────────────────────────────────────────────────────────────────


class _City(BaseModel):
    city: str


@pytest.fixture
async def trt(tmp_path, fake_openai):
    async with runtime(tmp_path, {"fake": openai_model(fake_openai),
                                  "routed": openai_model(fake_openai, router=True)}, gates=ALL_OPEN) as rt:
        recorder = Recorder()
        add_plugin_tools(rt, "plugin_test_weather", [recorder.tool("get_weather", _City, reply="sunny")],
                         {"get_weather": {"type": "search"}})
        rt.recorder = recorder  # type: ignore[attr-defined]
        yield rt


async def test_text_call_runs_and_its_result_is_fed_back_as_a_user_message(trt, fake_openai) -> None:
    fake_openai.script(text("Checking.\n<tool", '_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',
                            "</tool_call>"), text("It is ", "sunny in Paris."))
    out, events = await turn(trt, "weather in Paris?")
    assert out == "Checking.\nIt is sunny in Paris." and "<tool_call>" not in out, [(e.name, e.data) for e in events]
    assert trt.recorder.calls == [("get_weather", {"city": "Paris"})]
    assert any(e.name == "status" and e.data["text"].startswith("[get_weather ▶]") for e in events)
    sent = fake_openai.requests[-1].json["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert "<tool_call>" in sent[2]["content"] and sent[3]["content"].startswith(
        "[Tool result for get_weather]:\nsunny"
    )
    assert sent[3]["content"].endswith(AFTER_RESULTS)  # a small model is told to answer now
    history = trt.sessions.get("c1").history
    assert [(m["role"], bool(m.get("tool_results"))) for m in history] == [
        ("user", False), ("assistant", False), ("user", True), ("assistant", False)]


async def test_a_repeated_identical_text_call_is_not_run_again(trt, fake_openai) -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    fake_openai.script(text(call), text(call), text("Sunny."))
    out, events = await turn(trt, "weather?")
    assert out == "Sunny." and len(trt.recorder.calls) == 1, [(e.name, e.data) for e in events]
    assert any("↺" in e.data.get("text", "") for e in events if e.name == "status")
    note = fake_openai.requests[-1].json["messages"][-1]["content"]
    assert "You already have this result of get_weather" in note and "answer the user now" in note


async def test_a_repeated_identical_native_call_is_not_run_again(trt, fake_openai) -> None:
    fake_openai.script(tool_call("get_weather", {"city": "Oslo"}), tool_call("get_weather", {"city": "Oslo"}),
                       tool_call("get_weather", {"city": "Rome"}), text("done"))
    out, _ = await turn(trt, "weather?")
    assert out == "done" and [a["city"] for _, a in trt.recorder.calls] == ["Oslo", "Rome"]


async def test_prose_is_an_answer_and_unknown_text_calls_never_run(trt, fake_openai) -> None:
    fake_openai.script(text("SELECT * FROM users is what you would run."))
    out, _ = await turn(trt, "how do I list users?")
    assert out == "SELECT * FROM users is what you would run." and len(fake_openai.requests) == 1
    # An unknown tool is never run: the model is told once which tools exist, then answers.
    fake_openai.script(text('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'), text("Nothing to clean."))
    out, _ = await turn(trt, "clean up")
    assert out == "Nothing to clean." and trt.recorder.calls == []
    assert "unknown tool 'rm_rf'" in fake_openai.requests[-1].json["messages"][-1]["content"]


async def test_router_no_unbinds_tools_yes_and_failure_bind_them(trt, fake_openai) -> None:
    await turn(trt, "!model routed")
    fake_openai.script(text("No."), text("Hello!"))
    out, _ = await turn(trt, "hi there")
    router, answer = fake_openai.requests[-2:]
    assert out == "Hello!" and "tools" not in answer.json
    assert (
        router.json["messages"][-1]["content"] == "hi there" and "get_weather" in router.json["messages"][0]["content"]
    )
    fake_openai.script(text("yes"), tool_call("get_weather", {"city": "Oslo"}), text("Cold."))
    out, _ = await turn(trt, "weather in Oslo?")
    assert out == "Cold." and "get_weather" in {t["function"]["name"] for t in fake_openai.requests[-2].json["tools"]}
    fake_openai.script(error(500, "router down"), text("Still here."))
    out, _ = await turn(trt, "anything")
    assert out == "Still here." and fake_openai.requests[-1].json.get("tools")
    # Without the option there is no router call.
    await turn(trt, "!model fake")
    before = len(fake_openai.requests)
    await turn(trt, "plain")
    assert len(fake_openai.requests) == before + 1


async def test_text_tool_mode_describes_tools_in_the_prompt_and_runs_tool_code(tmp_path, fake_openai) -> None:
    async with runtime(tmp_path, {"plain": openai_model(fake_openai, tool_mode="text")}, gates=ALL_OPEN) as rt:
        recorder = Recorder()
        add_plugin_tools(rt, "plugin_test_weather", [recorder.tool("get_weather", _City, reply="sunny")],
                         {"get_weather": {"type": "search"}})
        fake_openai.script(
            text('<tool_code>{"tool_name": "get_weather", "arguments": {"city": "Paris"}}</tool_code>'),
            text("Sunny in Paris."),
        )
        out, _ = await turn(rt, "weather in Paris?")
        assert out == "Sunny in Paris." and recorder.calls == [("get_weather", {"city": "Paris"})]
        first = fake_openai.requests[-2].json
        assert "tools" not in first  # nothing bound through the API
        system = first["messages"][0]["content"]
        assert "<tool_code>" in system and '- get_weather: Test tool get_weather.' in system
        assert 'arguments: {"city": <string>}' in system
        assert fake_openai.requests[-1].json["messages"][-1]["content"].startswith("[Tool result for get_weather]")
