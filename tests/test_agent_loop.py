"""Every turn ends with an answer (issue 27): repeated calls, the round limit, unusable text calls.

The fake backend plays the habits of small local models (tests/fakes/backend.py: `repeat()`,
`fenced_call()`, `broken_call()`); assertions look at what it received.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import openai
import pytest
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel

import agents
import models
from config import MAX_TOOL_ITERATIONS
from shell_client import ShellClient
from tests.conftest import AgentServer, ConfigDir, free_port, gemini_model, openai_model
from tests.fakes.backend import RecordedRequest, broken_call, error, fenced_call, repeat, text, tool_call
from tests.runtime import ALL_OPEN, Recorder, add_plugin_tools, runtime, turn


class _City(BaseModel):
    city: str


@pytest.fixture(params=["native", "text"])
async def lrt(request, tmp_path, fake_openai):
    """A runtime with one weather tool, on a native-tool model or a `tool_mode: text` one."""
    async with runtime(tmp_path, {"m": openai_model(fake_openai, tool_mode=request.param)}, gates=ALL_OPEN) as rt:
        recorder = Recorder()
        add_plugin_tools(rt, "plugin_test_weather", [recorder.tool("get_weather", _City, reply="sunny, 21 C")],
                         {"get_weather": {"type": "search"}})
        rt.recorder = recorder  # type: ignore[attr-defined]
        rt.mode = request.param  # type: ignore[attr-defined]
        yield rt


def _first_call(mode: str, city: str = "Paris"):
    """The model's first call of get_weather, as the mode writes it."""
    if mode == "native":
        return tool_call("get_weather", {"city": city})
    return text(f'<tool_code>{{"tool_name": "get_weather", "arguments": {{"city": "{city}"}}}}</tool_code>')


def _offers_tools(request: RecordedRequest) -> bool:
    body = request.json
    return bool(body.get("tools")) or "<tool_code>" in body["messages"][0]["content"]


def _statuses(events: list[Any]) -> list[str]:
    return [e.data["text"] for e in events if e.name == "status"]


def _check_history(history: list[dict[str, Any]]) -> None:
    """Every tool call has its result right after it; the turn ends with an assistant message with text."""
    for i, msg in enumerate(history):
        ids = [c["id"] for c in msg.get("tool_calls", [])]
        if ids:
            answered = [m.get("tool_call_id") for m in history[i + 1:i + 1 + len(ids)]]
            assert answered == ids, history
    assert history[-1]["role"] == "assistant" and history[-1]["content"] and not history[-1].get("tool_calls")


async def test_a_model_that_repeats_its_call_gets_one_final_request_without_tools(lrt, fake_openai) -> None:
    fake_openai.script(_first_call(lrt.mode), repeat(), repeat(), repeat())
    out, events = await turn(lrt, "weather in Paris?")
    assert lrt.recorder.calls == [("get_weather", {"city": "Paris"})]
    sent = fake_openai.requests
    assert len(sent) == 4 and [_offers_tools(r) for r in sent] == [True, True, True, False]
    # The first repeat got the result again with the order to answer; the second one ended the offer of tools.
    note = sent[2].json["messages"][-1]["content"]
    assert "You already have this result of get_weather" in note and "answer the user now" in note
    assert "sunny, 21 C" in note
    final = sent[3].json
    assert "tools" not in final and "tool_choice" not in final
    assert all("tool_calls" not in m and m["role"] != "tool" for m in final["messages"])
    assert "<tool_code>" not in final["messages"][0]["content"] and "## Tools" not in final["messages"][0]["content"]
    assert final["messages"][-1]["role"] == "user" and "weather in Paris?" in final["messages"][-1]["content"]
    # The question with the tool's result, once (not the repeat notes), as the last user message.
    assert final["messages"][-1]["content"].startswith("weather in Paris?\n\nWhat the tools returned:\n"
                                                       "[get_weather]:\nsunny, 21 C")
    assert [m["role"] for m in final["messages"]] == ["system", "user"]
    assert out.startswith("The tool returned: sunny, 21 C"), out
    assert any(s.startswith("[final answer] the model repeated its call of get_weather") for s in _statuses(events))
    assert not [e for e in events if e.name == "error"]
    history = lrt.sessions.get("c1").history
    _check_history(history)
    assert history[-1]["content"] == out


async def test_the_round_limit_gives_a_final_answer_not_an_error(lrt, fake_openai) -> None:
    calls = [_first_call(lrt.mode, f"City{i}") for i in range(MAX_TOOL_ITERATIONS)]
    fake_openai.script(*calls, text("Across all cities: ", "sunny, 21 C."))
    out, events = await turn(lrt, "weather everywhere?")
    assert out == "Across all cities: sunny, 21 C." and len(lrt.recorder.calls) == MAX_TOOL_ITERATIONS
    assert not [e for e in events if e.name == "error"]
    assert any(f"still calling tools after {MAX_TOOL_ITERATIONS} rounds" in s for s in _statuses(events))
    final = fake_openai.requests[-1].json
    assert "tools" not in final and "<tool_code>" not in final["messages"][0]["content"]
    assert [_offers_tools(r) for r in fake_openai.requests].count(False) == 1
    _check_history(lrt.sessions.get("c1").history)


async def test_a_final_reply_that_is_still_a_call_gives_the_tool_results(lrt, fake_openai) -> None:
    again = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    fake_openai.script(_first_call(lrt.mode), repeat(), repeat(), text(again))
    out, events = await turn(lrt, "weather in Paris?")
    assert out.startswith("The model gave no answer; here is what the tools returned:\n- get_weather: sunny, 21 C")
    assert '"arguments"' not in out
    assert any("the model wrote no answer" in s for s in _statuses(events))
    _check_history(lrt.sessions.get("c1").history)


async def test_only_a_failing_model_ends_the_turn_with_an_error(lrt, fake_openai) -> None:
    fake_openai.script(_first_call(lrt.mode), repeat(), repeat(), error(400, "bad request"))
    _, events = await turn(lrt, "weather in Paris?")
    assert [e.name for e in events].count("error") == 1 and lrt.sessions.get("c1").history == []


async def test_an_empty_answer_after_a_tool_result_is_asked_for_again(lrt, fake_openai) -> None:
    fake_openai.script(_first_call(lrt.mode), text(" "), text("Sunny, 21 C in Paris."))
    out, events = await turn(lrt, "weather in Paris?")
    assert out.strip() == "Sunny, 21 C in Paris." and "tools" not in fake_openai.requests[-1].json
    assert any("answer after the tool results was empty" in s for s in _statuses(events))


async def test_the_chat_model_waits_for_a_slow_model_as_long_as_llm_call_timeout(tmp_path, fake_openai) -> None:
    # LangChain's default of 120 s between streamed chunks cut a slow local model's prompt processing short:
    # its clock is off, models.stream_once's (llm_call_timeout per chunk) is the only one.
    async with runtime(tmp_path, {"slow": openai_model(fake_openai, llm_call_timeout=900)}, gates=ALL_OPEN) as rt:
        assert models.chat_model(rt.llms, rt.config, "slow").stream_chunk_timeout is None


async def test_a_model_is_built_once_at_its_first_use_off_the_event_loop(tmp_path, fake_openai, monkeypatch) -> None:
    built_in: list[str] = []
    build = models.chat_model

    def recorded(*args: Any) -> Any:
        built_in.append(threading.current_thread().name)
        return build(*args)

    monkeypatch.setattr(models, "chat_model", recorded)
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, gates=ALL_OPEN) as rt:
        assert rt.llms == {}  # nothing built with the runtime
        first = await asyncio.gather(*(models.built_model(rt.llms, rt.config, "fake") for _ in range(3)))
        assert first[0] is first[1] is first[2] is rt.llms["fake"]
        assert fake_openai.requests == []  # the dry streamed call is answered in memory
    assert built_in and threading.main_thread().name not in built_in


def test_a_tools_schema_is_converted_once_and_is_langchains() -> None:
    @tool
    def lookup(city: str, days: int = 1) -> str:
        """The weather of a city."""
        return city

    schema, text_ = agents._schema(lookup)
    assert schema == convert_to_openai_tool(lookup) and json.loads(text_) == schema
    assert agents._schema(lookup)[0] is schema  # the next turn's is the same, not converted again


async def test_every_turn_sends_the_same_tool_schemas(nrt, fake_openai) -> None:
    fake_openai.script(text("one"), text("two"))
    await turn(nrt, "first")
    await turn(nrt, "second")
    first, second = (r.json["tools"] for r in fake_openai.requests[-2:])
    assert first == second and "get_weather" in {t["function"]["name"] for t in first}


# ── Text calls ─────────────────────────────────────────────────────────────────────────────


@pytest.fixture
async def nrt(tmp_path, fake_openai):
    async with runtime(tmp_path, {"m": openai_model(fake_openai)}, gates=ALL_OPEN) as rt:
        recorder = Recorder()
        add_plugin_tools(rt, "plugin_test_weather", [recorder.tool("get_weather", _City, reply="sunny")],
                         {"get_weather": {"type": "search"}})
        rt.recorder = recorder  # type: ignore[attr-defined]
        yield rt


@pytest.mark.parametrize("lang", ["json", "tool_call", ""])
async def test_a_fenced_call_runs(nrt, fake_openai, lang) -> None:
    fake_openai.script(fenced_call("get_weather", {"city": "Oslo"}, lang=lang, before="Let me check.\n",
                                   after="\nThis gives the weather."), text("Sunny in Oslo."))
    out, _ = await turn(nrt, "weather in Oslo?")
    assert nrt.recorder.calls == [("get_weather", {"city": "Oslo"})]
    assert "```" not in out and '"arguments"' not in out and out.endswith("Sunny in Oslo."), out
    assert fake_openai.requests[-1].json["messages"][-1]["content"].startswith("[Tool result for get_weather]:\nsunny")


async def test_several_calls_in_one_message_with_trailing_prose_all_run(nrt, fake_openai) -> None:
    fake_openai.script(text('{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                            '{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                            "These calls return the weather of both cities."), text("Both sunny."))
    out, _ = await turn(nrt, "weather in Oslo and Rome?")
    assert [a["city"] for _, a in nrt.recorder.calls] == ["Oslo", "Rome"] and out.endswith("Both sunny.")
    results = fake_openai.requests[-1].json["messages"][-1]["content"]
    assert results.count("[Tool result for get_weather]") == 2


async def test_a_call_of_an_unknown_tool_gets_exactly_one_corrective_message(nrt, fake_openai) -> None:
    wrong = '```json\n{"name": "weather_lookup", "arguments": {"city": "Oslo"}}\n```'
    fake_openai.script(text(wrong), fenced_call("get_weather", {"city": "Oslo"}), text("Sunny in Oslo."))
    out, _ = await turn(nrt, "weather in Oslo?")
    assert out == "Sunny in Oslo." and nrt.recorder.calls == [("get_weather", {"city": "Oslo"})]
    corrections = [m["content"] for r in fake_openai.requests for m in r.json["messages"]
                   if "[Tool call error]" in str(m.get("content"))]
    assert len(set(corrections)) == 1
    message = corrections[0]
    assert "unknown tool 'weather_lookup'" in message and "- get_weather(city: string)" in message
    # The call its arguments fit, written out (the arguments fit get_weather alone).
    assert 'To call get_weather, write exactly:\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
           in message
    assert "weather_lookup" not in out


async def test_unusable_calls_after_the_correction_end_with_a_final_answer(nrt, fake_openai) -> None:
    wrong = '<tool_call>{"name": "weather_lookup", "arguments": {"city": "Oslo"}}</tool_call>'
    fake_openai.script(text(wrong), text(wrong), text("I cannot look that up."))
    out, events = await turn(nrt, "weather in Oslo?")
    assert out == "I cannot look that up." and nrt.recorder.calls == []
    sent = fake_openai.requests
    assert len(sent) == 3 and "tools" not in sent[-1].json
    assert sum("[Tool call error]" in str(m.get("content")) for m in sent[1].json["messages"]) == 1
    assert "What the tools returned:\n(nothing)" in sent[-1].json["messages"][-1]["content"]
    assert any("again after being told how to call" in s for s in _statuses(events))
    _check_history(nrt.sessions.get("c1").history)


async def test_a_text_call_with_invalid_arguments_twice_ends_with_a_final_answer(nrt, fake_openai) -> None:
    wrong = fenced_call("get_weather", {"town": "Oslo"})
    fake_openai.script(wrong, wrong, text("I could not look it up."))
    out, events = await turn(nrt, "weather in Oslo?")
    assert out == "I could not look it up." and nrt.recorder.calls == [] and len(fake_openai.requests) == 3
    assert "invalid arguments for get_weather" in fake_openai.requests[1].json["messages"][-1]["content"]
    assert "tools" not in fake_openai.requests[2].json
    assert any("again after being told how to call" in s for s in _statuses(events))


async def test_a_native_call_with_broken_arguments_is_corrected_once(nrt, fake_openai) -> None:
    fake_openai.script(broken_call("get_weather"), tool_call("get_weather", {"city": "Paris"}), text("Sunny."))
    out, _ = await turn(nrt, "weather in Paris?")
    assert out == "Sunny." and nrt.recorder.calls == [("get_weather", {"city": "Paris"})]
    second = fake_openai.requests[1].json["messages"]
    assert second[-1]["role"] == "tool" and "JSON object of arguments" in second[-1]["content"]
    _check_history(nrt.sessions.get("c1").history)


@pytest.mark.parametrize("reply", [
    'An example of the JSON the API takes: {"name": "get_weather", "arguments": {"city": "Oslo"}}.',
    'You would write {"name": "get_weather"} to ask, but I already know: sunny.',
    '```json\n{"name": "Oslo", "population": 709000}\n```',
    "Use <tool_code> tags like this when you write calls.",
])
async def test_prose_mentioning_json_is_not_run_nor_corrected(nrt, fake_openai, reply) -> None:
    fake_openai.script(text(reply))
    out, events = await turn(nrt, "tell me")
    assert out == reply and nrt.recorder.calls == [] and len(fake_openai.requests) == 1
    assert not any(s.startswith(("[tools]", "[final answer]")) for s in _statuses(events))


def test_the_final_conversation_is_plain_and_ends_with_the_question_and_results() -> None:
    final = agents._Final([("w", "sunny")], {})
    history = [{"role": "user", "content": "earlier?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "name": "w", "args": {"c": 1}}]},
               {"role": "tool", "tool_call_id": "a", "name": "w", "content": "rain"},
               {"role": "assistant", "content": "It rained."},
               {"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "b", "name": "w", "args": {"c": 1}}]},
               {"role": "tool", "tool_call_id": "b", "name": "w", "content": "sunny"}]
    out = final.conversation(history)
    assert out == [
        {"role": "user", "content": "earlier?\n\n[Tool result for w]:\nrain"},
        {"role": "assistant", "content": "It rained."},
        {"role": "user", "content": agents.FINAL_REQUEST.format(question="weather?", results="[w]:\nsunny")},
    ]


# ── Every client gets the final answer streamed ───────────────────────────────────────────────


async def test_the_final_answer_streams_to_the_shell_and_the_proxy(tmp_path, fake_openai) -> None:
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    port = free_port()
    cfg.plugins.append("plugin_proxy_llama")
    cfg.plugin_config["plugin_proxy_llama"] = {"port": port}
    server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
    try:
        habit = (tool_call("get_system_info", {}), repeat(), repeat(), repeat())
        fake_openai.script(*habit)
        async with ShellClient(server.url, "loop-shell", token=server.token) as shell:
            await shell.connect()
            await shell.submit("What time is it on the server?")
            events = []
            async for ev in shell.events():
                events.append(ev)
                if ev.name in ("done", "error"):
                    break
        answer = "".join(e.data.get("text", "") for e in events if e.name == "tok")
        assert answer.startswith("The tool returned: Local time: ") and events[-1].name == "done"
        assert any(e.name == "status" and e.data["text"].startswith("[final answer]") for e in events)
        assert "tools" not in fake_openai.requests[-1].json

        fake_openai.reset()
        fake_openai.script(*habit)
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="agent-mcp:latest", messages=[{"role": "user", "content": "What time is it?"}], stream=True)
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        said = "".join(pieces)  # the proxy shows status lines as quotes before the answer
        assert "> [final answer] the model repeated its call" in said
        assert said.rstrip().rpartition("\n\n")[2].startswith("The tool returned: Local time: "), said
        assert len(fake_openai.requests) == 4 and "tools" not in fake_openai.requests[-1].json
    finally:
        server.stop()


@pytest.mark.parametrize("described", [
    "To see the weather, you can use the `get_weather` function.",
    "You can call get_weather with the city name.",
])
async def test_a_model_that_describes_a_tool_instead_of_calling_it_is_told_once(nrt, fake_openai, described) -> None:
    """Qwen 1.5B answers "read it with read_system_prompt" with "you can use the `read_system_prompt` function"."""
    fake_openai.script(text(described), fenced_call("get_weather", {"city": "Oslo"}), text("Sunny in Oslo."))
    out, events = await turn(nrt, "weather in Oslo? use get_weather")
    # What it said stays on screen (it streamed), and the answer follows apart.
    assert nrt.recorder.calls == [("get_weather", {"city": "Oslo"})] and out == f"{described}\n\nSunny in Oslo."
    assert nrt.sessions.get("c1").history[-1]["content"] == "Sunny in Oslo."
    told = fake_openai.requests[1].json["messages"][-1]["content"]
    assert "you named get_weather but did not call it" in told and "- get_weather(city: string)" in told
    shown = '<tool_call>{"name": "get_weather", "arguments": {"city": "<string>"}}</tool_call>'
    assert f"To call get_weather, write exactly:\n{shown}" in told  # the call written out, not a generic shape
    assert told.endswith("Reply now with only that call; its result comes back to you.")  # no way out in prose
    assert any("named get_weather instead of calling it" in s for s in _statuses(events))
    _check_history(nrt.sessions.get("c1").history)


async def test_describing_a_tool_twice_or_after_a_result_is_an_answer(nrt, fake_openai) -> None:
    described = "You can use get_weather for that."
    fake_openai.script(text(described), text(described))
    out, _ = await turn(nrt, "weather?")
    assert out == f"{described}\n\n{described}" and nrt.recorder.calls == []
    assert len(fake_openai.requests) == 2  # told once only: the second description is the answer
    later = "Sunny. You can use get_weather again later."
    fake_openai.script(fenced_call("get_weather", {"city": "Rome"}), text(later))
    out, _ = await turn(nrt, "and Rome?")
    assert out == later and len(fake_openai.requests) == 4


async def test_a_call_without_its_tool_name_is_corrected_with_the_call_written_out(nrt, fake_openai) -> None:
    """Qwen 1.5B wrote {"arguments": {"section": "backups"}}: the correction gives back the exact call it meant."""
    nameless = '```json\n{"arguments": {"city": "Oslo"}}\n```'
    fake_openai.script(text(nameless), fenced_call("get_weather", {"city": "Oslo"}), text("Sunny in Oslo."))
    out, _ = await turn(nrt, "weather in Oslo?")
    assert out == "Sunny in Oslo." and nrt.recorder.calls == [("get_weather", {"city": "Oslo"})]
    told = fake_openai.requests[1].json["messages"][-1]["content"]
    assert "a call without a tool name (of get_weather? write its name)" in told
    assert 'write exactly:\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in told


@pytest.mark.parametrize("temperature", [None, 0.2])
async def test_a_model_entrys_temperature_is_sent_and_none_leaves_the_backends_default(
        tmp_path, fake_openai, fake_gemini, temperature) -> None:
    models = {"o": openai_model(fake_openai, temperature=temperature),
              "g": gemini_model(fake_gemini, temperature=temperature)}
    async with runtime(tmp_path, models, env={"FAKE_GEMINI_KEY": "k"}) as rt:
        for key, backend in (("o", fake_openai), ("g", fake_gemini)):
            backend.script(text("hi"))
            await turn(rt, "hello", client_id=f"c-{key}", payload={"model": key})
        assert fake_openai.requests[-1].json.get("temperature") == temperature  # unset: not sent at all
        if temperature is not None:  # unset: langchain-google-genai's own default
            assert fake_gemini.requests[-1].json["generationConfig"]["temperature"] == temperature


async def test_a_turn_whose_own_tool_traffic_overflows_the_window_ends_with_a_final_answer(tmp_path, fake_openai
                                                                                           ) -> None:
    """Qwen 0.5B ran away (a reply of thousands of tokens around its call): the next round did not fit the
    window, and the turn ended with an error. Now the final request carries the question and the results."""
    small = openai_model(fake_openai, context_tokens=2048, llm_tools=["get_weather"])
    async with runtime(tmp_path, {"m": small}, gates=ALL_OPEN) as rt:
        recorder = Recorder()
        add_plugin_tools(rt, "plugin_test_weather", [recorder.tool("get_weather", _City, reply="sunny, 21 C")],
                         {"get_weather": {"type": "search"}})
        runaway = "I will look it up. " + "The weather depends on many things. " * 400
        fake_openai.script(fenced_call("get_weather", {"city": "Oslo"}, before=runaway), text("Sunny, 21 C."))
        out, events = await turn(rt, "weather in Oslo?")
    assert recorder.calls == [("get_weather", {"city": "Oslo"})] and out.endswith("Sunny, 21 C.")
    assert len(fake_openai.requests) == 2 and "tools" not in fake_openai.requests[1].json  # straight to the final
    assert "sunny, 21 C" in fake_openai.requests[1].json["messages"][-1]["content"]
    assert any("no longer fit the model's context window" in s for s in _statuses(events))
    assert not [e for e in events if e.name == "error"]


async def test_when_not_even_the_results_fit_the_answer_is_what_the_tools_returned(tmp_path, fake_openai) -> None:
    async with runtime(tmp_path, {"m": openai_model(fake_openai, context_tokens=2048, llm_tools=["get_weather"])},
                       gates=ALL_OPEN) as rt:
        recorder = Recorder()
        add_plugin_tools(rt, "plugin_test_weather", [recorder.tool("get_weather", _City, reply="row " * 3000)],
                         {"get_weather": {"type": "search"}})
        runaway = "Checking. " + "The weather depends on many things. " * 400
        calls = "".join(f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}</tool_call>'
                        for c in ("Oslo", "Rome", "Lima"))
        fake_openai.script(text(runaway + calls), text("unused"))
        out, events = await turn(rt, "weather in Oslo, Rome and Lima?")
    # Three results of 4,000 characters each are more than the window: nothing more is asked of the model.
    assert len(recorder.calls) == 3 and len(fake_openai.requests) == 1
    assert not [e for e in events if e.name == "error"]
    assert "here is what the tools returned" in out and "- get_weather: row row" in out
    assert any("do not fit the window; showing what the tools returned" in s for s in _statuses(events))
