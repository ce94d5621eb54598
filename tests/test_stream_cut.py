"""Honest endings (issue 40): a model stream that ends before its finish reason is an error, never an answer.

A fake backend sends part of an answer and ends the stream without a finish reason (cleanly, or by dropping
the connection), in each wire format agent-mcp reads (OpenAI chat, Gemini). In-process: the turn reports an
error, keeps the partial answer in the history marked as cut off, and the next request shows the mark; the
model's tool calls of a cut reply never run. Over real sockets (one agent-mcp subprocess): the API's
AgentClient and result JSON, the proxy through the real openai and ollama packages, the shell's events,
the log's WARNING line and `/metrics`.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

import agents
import routes
from api_client import AgentClient, AgentError
from shell_client import ShellClient
from tests.conftest import AgentServer, ConfigDir, free_port, gemini_model, openai_model
from tests.fakes.backend import FakeBackend, cut, text, tool_call
from tests.fakes.gemini_backend import FakeGemini
from tests.fakes.openai_backend import FakeOpenAI
from tests.runtime import ALL_OPEN, Recorder, add_plugin_tools, ask, runtime, turn

GEMINI_KEY = {"FAKE_GEMINI_KEY": "fake-gemini-key"}
CUT_OFF = "the answer was cut off"


class _City(BaseModel):
    city: str


def _model(wire: str, openai_backend: FakeOpenAI, gemini_backend: FakeGemini, **extra: Any) -> dict[str, Any]:
    return openai_model(openai_backend, **extra) if wire == "openai" else gemini_model(gemini_backend, **extra)


def _sent_texts(backend: FakeBackend) -> list[str]:
    """The texts of every message of the backend's last request, in either wire format."""
    body = backend.requests[-1].json
    if "messages" in body:
        return [str(m.get("content")) for m in body["messages"]]
    return [p.get("text", "") for c in body["contents"] for p in c.get("parts", [])]


def _errors(events: list[Any]) -> list[dict[str, Any]]:
    return [e.data for e in events if e.name == "error"]


# ── In-process: the turn ───────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("abrupt", [False, True], ids=["clean-end", "connection-dropped"])
@pytest.mark.parametrize("wire", ["openai", "gemini"])
async def test_a_cut_stream_is_an_error_and_its_partial_answer_is_kept_marked(tmp_path, fake_openai, fake_gemini,
                                                                             wire, abrupt) -> None:
    backend = fake_openai if wire == "openai" else fake_gemini
    async with runtime(tmp_path, {"m": _model(wire, fake_openai, fake_gemini)}, env=GEMINI_KEY) as rt:
        backend.script(cut("alpha ", "be", abrupt=abrupt))
        out, events = await turn(rt, "say alpha beta")
        # What came was streamed as it came. A dropped connection may lose what was in flight with it: aiohttp
        # raises the broken body before handing out the bytes read with its end.
        assert out == "alpha be" if not abrupt else "alpha be".startswith(out)
        [error] = _errors(events)
        assert error["kind"] == "cut" and error["message"].startswith(f"model 'm' at {backend.base_url}: {CUT_OFF}")
        assert ("connection to the backend broke" if abrupt else "ended without the model's finish reason") \
            in error["message"]
        assert (f"the {len(out)} characters that came are kept, marked as cut off" if out else
                "no answer text had come") in error["message"]
        assert [e.name for e in events][-2:] == ["error", "done"]
        assert len(backend.requests) == 1  # output had come (or may have): never sent again
        history = rt.sessions.get("c1").history
        assert history == [{"role": "user", "content": "say alpha beta"}, agents.cut_answer(out)]
        assert history[-1]["cut"] is True and history[-1]["content"].endswith(agents.CUT_MARK)
        shown = history[-1]["content"]
        if not abrupt:
            assert shown == f"alpha be\n\n{agents.CUT_MARK}"

        backend.script(text("beta, ", "sorry."))
        out, events = await turn(rt, "go on")
        assert out == "beta, sorry." and not _errors(events)
        sent = _sent_texts(backend)
        assert shown in sent  # the next request shows the answer as cut off
        assert sent.index("say alpha beta") < sent.index(shown) < sent.index("go on")


@pytest.mark.parametrize("wire", ["openai", "gemini"])
async def test_a_cut_tool_call_never_runs_and_the_turn_so_far_is_kept(tmp_path, fake_openai, fake_gemini,
                                                                      wire) -> None:
    backend = fake_openai if wire == "openai" else fake_gemini
    async with runtime(tmp_path, {"m": _model(wire, fake_openai, fake_gemini)}, env=GEMINI_KEY,
                       gates=ALL_OPEN) as rt:
        recorder = Recorder()
        add_plugin_tools(rt, "plugin_test_weather", [recorder.tool("get_weather", _City, reply="sunny")],
                         {"get_weather": {"type": "search"}})
        backend.script(tool_call("get_weather", {"city": "Paris"}),
                       cut(reply=tool_call("get_weather", {"city": "Rome"}, text_before="Now Rome: ")))
        _, events = await turn(rt, "weather in Paris and Rome?")
        assert recorder.calls == [("get_weather", {"city": "Paris"})]  # the cut call's arguments were never run
        [error] = _errors(events)
        assert error["kind"] == "cut" and CUT_OFF in error["message"]
        history = rt.sessions.get("c1").history
        # The first round (its call and result) stays; the cut reply is its text, marked, without its call.
        assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
        assert history[1]["tool_calls"][0]["args"] == {"city": "Paris"} and history[2]["content"].startswith("sunny")
        assert history[-1] == agents.cut_answer("Now Rome: ") and "tool_calls" not in history[-1]


async def test_a_cut_answer_held_back_as_a_possible_text_call_is_shown_before_the_error(tmp_path,
                                                                                       fake_openai) -> None:
    async with runtime(tmp_path, {"m": openai_model(fake_openai, tool_mode="text")}, gates=ALL_OPEN) as rt:
        add_plugin_tools(rt, "plugin_test_weather", [Recorder().tool("get_weather", _City, reply="sunny")],
                         {"get_weather": {"type": "search"}})
        partial = 'Checking. <tool_code>{"tool_name": "get_wea'
        fake_openai.script(cut("Checking. ", '<tool_code>{"tool_name": ', '"get_wea'))
        out, events = await turn(rt, "weather?")
        assert out == partial  # the client saw what the history keeps, then the error
        assert [e.name for e in events][-2:] == ["error", "done"]
        assert rt.sessions.get("c1").history[-1] == agents.cut_answer(partial)


async def test_an_answer_with_its_finish_reason_is_no_cut(tmp_path, fake_openai, fake_gemini) -> None:
    models = {"o": openai_model(fake_openai), "g": gemini_model(fake_gemini)}
    async with runtime(tmp_path, models, env=GEMINI_KEY) as rt:
        for key, backend in (("o", fake_openai), ("g", fake_gemini)):
            backend.script(text("alpha ", "beta"))
            out, events = await turn(rt, f"@{key} say alpha beta", client_id=f"c-{key}")
            assert out == "alpha beta" and not _errors(events)
            assert rt.sessions.get(f"c-{key}").history[-1] == {"role": "assistant", "content": "alpha beta"}


async def test_a_connection_dropped_after_the_finish_reason_loses_nothing_of_the_answer(tmp_path,
                                                                                        fake_gemini) -> None:
    """Gemini's last piece carries the text and the finish reason together: once its text is seen, the finish
    reason has come, and the connection is dropped then (the test holds the cut until that moment)."""
    async with runtime(tmp_path, {"g": gemini_model(fake_gemini)}, env=GEMINI_KEY) as rt:
        seen = threading.Event()
        fake_gemini.script(cut("alpha ", "beta", finished=True, abrupt=True, hold=seen))
        sub = rt.hub.subscribe("c1", rt.hub.last_id("c1"))
        await routes.submit(rt, ask(rt, "c1", "say alpha beta", {"interactive": True}))
        events, out = [], ""
        async for ev in sub:
            events.append(ev)
            out += ev.data.get("text", "") if ev.name == "tok" else ""
            if out == "alpha beta":
                seen.set()
            if ev.name == "done":
                break
        await sub.aclose()
        assert seen.is_set() and out == "alpha beta" and not _errors(events)
        assert rt.sessions.get("c1").history[-1] == {"role": "assistant", "content": "alpha beta"}


# ── Over real sockets: the API, the proxy, the shell, the log and /metrics ─────────────────


API_KEY = "api-key-stream-cut-0123456789"
#: The model keys of the server below: an OpenAI-type one and a Gemini one.
WIRES = {"openai": "gpt", "gemini": "gem"}


@dataclass
class Server:
    server: AgentServer
    backends: dict[str, FakeBackend]
    api: str
    proxy: str
    metrics: str

    def log(self) -> str:
        return "".join(self.server._lines)

    def cuts(self) -> dict[str, float]:
        """agent_mcp_model_stream_cut_total by model, and as `errors:<model>` model_errors_total of kind stream_cut,
        as /metrics says (parsed by prometheus_client)."""
        page = httpx.get(f"{self.metrics}/metrics", timeout=5)
        assert page.status_code == 200, page.text
        found = {}
        for family in text_string_to_metric_families(page.text):
            for s in family.samples:
                if s.name == "agent_mcp_model_stream_cut_total":
                    found[s.labels["model"]] = s.value
                elif s.name == "agent_mcp_model_errors_total" and s.labels["kind"] == "stream_cut":
                    found[f"errors:{s.labels['model']}"] = s.value
        return found


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[Server]:
    with FakeOpenAI() as gpt, FakeGemini() as gem:
        cfg = ConfigDir(tmp_path_factory.mktemp("cut"))
        cfg.models = {"gpt": openai_model(gpt), "gem": gemini_model(gem)}
        ports = {"plugin_client_api": free_port(), "plugin_proxy_llama": free_port(),
                 "plugin_client_metrics": free_port()}
        cfg.plugins += list(ports)
        cfg.plugin_config.update({name: {"port": port} for name, port in ports.items()})
        cfg.env = {"API_KEY": API_KEY, **GEMINI_KEY}
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        try:
            yield Server(server, {"openai": gpt, "gemini": gem}, url["plugin_client_api"],
                         url["plugin_proxy_llama"], url["plugin_client_metrics"])
        finally:
            out = server.stop()
            assert "Traceback" not in out and "Exception in ASGI application" not in out, out[-4000:]


@pytest.fixture(autouse=True)
def _fresh(request) -> None:
    if "srv" in request.fixturenames:
        for backend in request.getfixturevalue("srv").backends.values():
            backend.reset()


def _api_client(srv: Server) -> AgentClient:
    return AgentClient(srv.api, f"api-{uuid.uuid4().hex[:8]}", api_key=API_KEY)


@pytest.mark.slow
@pytest.mark.parametrize("wire", list(WIRES))
async def test_the_api_reports_a_cut_answer_as_an_error_with_its_partial_text(srv, wire) -> None:
    model, backend = WIRES[wire], srv.backends[wire]
    before = srv.cuts()
    backend.script(cut("alpha ", "be"))
    client = _api_client(srv)
    with pytest.raises(AgentError, match=f"Agent error: model '{model}' at <hidden>: {CUT_OFF}") as caught:
        await client.send(f"@{model} say alpha beta")
    assert caught.value.partial == "alpha be"
    backend.script(cut("alpha ", "be"))
    async with httpx.AsyncClient(timeout=30) as http:  # the result JSON of a waited turn
        r = await http.post(f"{srv.api}/api/v1/submit", headers={"Authorization": f"Bearer {API_KEY}"},
                            json={"text": f"@{model} say alpha beta", "client_id": "cut-wait", "wait": True})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "error" and body["partial"] == "alpha be", body
    assert CUT_OFF in body["error"] and body["text"] == body["error"]
    after = srv.cuts()
    assert after[model] == before.get(model, 0) + 2 and after[f"errors:{model}"] == before.get(f"errors:{model}", 0) + 2
    # One WARNING line per cut turn, the whole story in it.
    lines = [line for line in srv.log().splitlines() if CUT_OFF in line and f"model '{model}'" in line]
    assert len(lines) >= 2 and all("WARNING" in line for line in lines), lines


@pytest.mark.slow
@pytest.mark.parametrize("wire", list(WIRES))
def test_the_openai_sdk_gets_an_api_error_and_never_stop(srv, wire) -> None:
    model, backend = WIRES[wire], srv.backends[wire]
    hi = [{"role": "user", "content": f"say alpha beta ({uuid.uuid4().hex[:8]})"}]  # a conversation of its own
    with openai.OpenAI(base_url=srv.proxy + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        backend.script(cut("alpha ", "be"))
        pieces, finishes = [], []
        with pytest.raises(openai.APIError, match=CUT_OFF) as caught:
            for chunk in client.chat.completions.create(model=f"{model}:latest", messages=hi, stream=True):
                pieces.append(chunk.choices[0].delta.content or "")
                finishes.append(chunk.choices[0].finish_reason)
        assert "".join(pieces) == "alpha be" and finishes == [None] * len(finishes)  # no `stop`, no [DONE]
        assert caught.value.body["type"] == "server_error" and caught.value.body["code"] == "backend_error"
        # The conversation sent back with the partial answer goes on in its session, which shows the answer cut off.
        backend.script(text("beta."))
        again = [*hi, {"role": "assistant", "content": "alpha be"}, {"role": "user", "content": "go on"}]
        answer = client.chat.completions.create(model=f"{model}:latest", messages=again)
        assert answer.choices[0].message.content == "beta." and answer.choices[0].finish_reason == "stop"
        assert f"alpha be\n\n{agents.CUT_MARK}" in _sent_texts(backend)

        backend.script(cut("alpha ", "be"))
        with pytest.raises(openai.InternalServerError, match=CUT_OFF) as whole:
            client.chat.completions.create(model=f"{model}:latest", messages=hi)
        assert whole.value.status_code == 502 and whole.value.code == "backend_error"


@pytest.mark.slow
def test_the_proxys_sse_ends_with_the_error_object_and_no_done(srv) -> None:
    srv.backends["openai"].script(cut("alpha ", "be"))
    body = {"model": "gpt:latest", "stream": True, "messages": [{"role": "user", "content": "say alpha beta"}]}
    r = httpx.post(f"{srv.proxy}/v1/chat/completions", json=body, timeout=30)
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert r.status_code == 200 and "[DONE]" not in events and '"finish_reason":"stop"' not in r.text.replace(" ", "")
    last = json.loads(events[-1])
    assert set(last) == {"error"} and CUT_OFF in last["error"]["message"] and last["error"]["code"] == "backend_error"
    texts = [json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]]
    assert "".join(texts) == "alpha be"


@pytest.mark.slow
@pytest.mark.parametrize("wire", list(WIRES))
def test_the_ollama_client_gets_a_response_error_and_never_done(srv, wire) -> None:
    model, backend = WIRES[wire], srv.backends[wire]
    hi = [{"role": "user", "content": "say alpha beta"}]
    with ollama.Client(host=srv.proxy, timeout=30) as client:
        backend.script(cut("alpha ", "be"))
        parts = []
        with pytest.raises(ollama.ResponseError, match=CUT_OFF):
            for part in client.chat(model=f"{model}:latest", messages=hi, stream=True):
                parts.append(part)
        assert "".join(p.message.content for p in parts) == "alpha be" and not any(p.done for p in parts)

        backend.script(cut("alpha ", "be"))
        with pytest.raises(ollama.ResponseError, match=CUT_OFF) as whole:
            client.chat(model=f"{model}:latest", messages=hi, stream=False)
        assert whole.value.status_code == 502

        backend.script(cut("alpha ", "be"))
        generated = []
        with pytest.raises(ollama.ResponseError, match=CUT_OFF):
            for part in client.generate(model=f"{model}:latest", prompt="say alpha beta", stream=True):
                generated.append(part)
        assert "".join(p.response for p in generated) == "alpha be" and not any(p.done for p in generated)


@pytest.mark.slow
async def test_the_shell_sees_the_error_event_after_the_partial_text(srv) -> None:
    srv.backends["openai"].script(cut("alpha ", "be", abrupt=True))
    events = []
    async with ShellClient(srv.server.url, str(uuid.uuid4()), token=srv.server.token) as shell:
        await shell.connect(max_wait=10)
        await shell.submit("say alpha beta")
        async for ev in shell.events():
            events.append(ev)
            if ev.name == "done":
                break
    assert "alpha be".startswith("".join(e.data.get("text", "") for e in events if e.name == "tok"))
    [error] = [e.data for e in events if e.name == "error"]
    assert error["kind"] == "cut" and "the connection to the backend broke before the answer's end" in \
        error["message"]
    assert re.search(r"model 'gpt' at http://127\.0\.0\.1:\d+/v1: the answer was cut off", error["message"])
