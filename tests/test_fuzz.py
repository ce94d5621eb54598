"""A request fuzz over every route of every client plugin: no answer ≥ 500, no traceback in the log.

Every client plugin is loaded (shell endpoint, API, proxy, Slack against the fake Slack, MCP
server) on a fake OpenAI backend, and each plugin's app is built the way agent-mcp.py builds it
(`build_app`, so whatever guard it adds is in front). Requests go in-process through a small ASGI
driver rather than over sockets: 1,000 requests take seconds instead of a minute, and SSE answers
(which never end) are cut right after their headers. httpx.ASGITransport cannot do that: it
buffers the whole body, so an SSE route would hang it.

Hypothesis draws the requests: real routes (from each plugin's own `get_routes`) and mutations
of them, any method, query strings, headers (Host, tokens, content types, Last-Event-ID, Accept
and their garbage versions), and bodies: each route's real JSON with fields swapped for random
JSON, random JSON of any shape, nesting up to 100,000 levels, huge strings, invalid UTF-8 and lone surrogates
(escaped in JSON strings, raw in bytes), bodies cut short by a client that goes away (fewer bytes
than Content-Length), huge and non-UTF-8 headers, and forwarded identity headers (open-webui's,
X-Forwarded-For) with and without the proxy's forwarder key. Most requests carry a valid Host and
the right token, so they reach the handlers. Derandomized and without an example database, so
every run sends the same requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp_types import CLIENT_CAPABILITIES_META_KEY, CLIENT_INFO_META_KEY, PROTOCOL_VERSION_META_KEY
from mcp_types.version import LATEST_PROTOCOL_VERSION as MODERN
from starlette.routing import Mount, Route

import build
import state
from config import load_config
from plugins._proxy_identity import key_digest
from tests.conftest import ConfigDir, free_port, openai_model
from tests.fakes.openai_backend import FakeOpenAI
from tests.fakes.slack import APP_TOKEN, BOT_TOKEN, FakeSlack
from tests.runtime import entry

pytestmark = pytest.mark.slow

EXAMPLES = 1000
#: A guard against a hanging handler (then the test fails and names the request); no timing is asserted.
REQUEST_LIMIT = 20
SHELL_TOKEN, API_KEY, ADMIN_KEY, PROXY_TOKEN, SLACK_TOKEN = (
    "shell-token-fuzz-0001",
    "api-key-fuzz-000001",
    "admin-key-fuzz-00001",
    "proxy-token-fuzz-001",
    "slack-token-fuzz-01",
)
MCP_HUMAN, MCP_AGENT = "mcp-human-token-fuzz-0001", "mcp-agent-token-fuzz-0001"
#: The proxy's per-user keys: a user's and a forwarder's (trusted from the driver's 127.0.0.1).
PROXY_USER, PROXY_FORWARDER = "proxy-user-key-fuzz-01", "proxy-forwarder-key-fuzz-01"
PLUGINS = ("plugin_client_shellpy", "plugin_client_api", "plugin_proxy_llama", "plugin_client_slack",
           "plugin_client_mcp")
STREAMING = ("text/event-stream", "application/x-ndjson")

agent_mcp = entry()


# ── The server under test ───────────────────────────────────────────────────────────────────


@dataclass
class Target:
    """One plugin's app as agent-mcp serves it, its port, its credentials and its route templates."""

    name: str
    app: Any
    port: int
    auth: dict[str, str]
    paths: list[tuple[str, list[str]]]


def _templates(plugin: Any) -> list[tuple[str, list[str]]]:
    out = []
    for r in plugin.get_routes():
        if isinstance(r, Route):
            out.append((r.path, sorted(r.methods or ["GET"])))
        elif isinstance(r, Mount):  # the MCP SDK's app: its endpoint is /mcp
            out.append((r.path + "/mcp", ["DELETE", "GET", "POST"]))
    return out


class Server:
    """Every client plugin loaded into one runtime, on the running event loop."""

    def __init__(self, tmp: Any, backend: FakeOpenAI, slack: FakeSlack):
        self.slack = slack
        cfg = ConfigDir(tmp)
        cfg.models = {"fake": openai_model(backend)}
        cfg.plugins = list(PLUGINS)
        ports = {name: free_port() for name in PLUGINS}
        cfg.port = ports["plugin_client_shellpy"]
        cfg.plugin_config = {name: {"port": port} for name, port in ports.items()}
        cfg.plugin_config["plugin_client_slack"].update(api_base_url=slack.base_url, ping_interval=1)
        cfg.plugin_config["plugin_proxy_llama"].update(
            user_keys={key_digest(PROXY_USER): "fuzzer", key_digest(PROXY_FORWARDER): "owui"}, forwarders=["owui"],
            trusted_proxies=["127.0.0.1"])
        cfg.env = {"AGENT_SHELL_TOKEN": SHELL_TOKEN, "API_KEY": API_KEY, "API_ADMIN_KEY": ADMIN_KEY,
                   "AGENT_PROXY_TOKEN": PROXY_TOKEN, "AGENT_SLACK_TOKEN": SLACK_TOKEN,
                   "SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_APP_TOKEN": APP_TOKEN, "API_GATE_TIMEOUT": "1"}
        cfg.write()
        (tmp / "mcp-tokens.json").write_text(json.dumps({"tokens": {
            "owner": {"role": "human", "token": MCP_HUMAN},
            "worker": {"role": "agent", "session": "worker", "token": MCP_AGENT}}}))
        (tmp / "mcp-tokens.json").chmod(0o600)  # it holds tokens: agent-mcp refuses it readable by others
        self.config = load_config(tmp)
        self.rt: state.Runtime | None = None
        self.targets: list[Target] = []

    async def start(self) -> None:
        # The real store (SQLite in the temporary data dir), as a user runs it.
        self.rt = rt = await build.build_runtime(self.config)
        assert rt.plugins is not None
        for name in PLUGINS:
            report = await rt.plugins.load(name)
            assert report.status == "loaded", report.line()
        bearer = {
            "plugin_client_shellpy": SHELL_TOKEN,
            "plugin_client_api": API_KEY,
            "plugin_proxy_llama": PROXY_TOKEN,
            "plugin_client_slack": SLACK_TOKEN,
            "plugin_client_mcp": MCP_HUMAN,
        }
        for plugin in rt.plugins.client_plugins():
            name = plugin.PLUGIN_NAME
            self.targets.append(
                Target(
                    name,
                    agent_mcp.build_app(rt, plugin, plugin.get_config()),
                    plugin.get_config()["port"],
                    {"authorization": f"Bearer {bearer[name]}"},
                    _templates(plugin),
                )
            )
        assert sorted(t.name for t in self.targets) == sorted(PLUGINS)
        await self.slack.until(lambda: self.slack.connections >= 1)  # so /slack/health is healthy

    async def stop(self) -> None:
        if self.rt is None:
            return
        await build.close_runtime(self.rt)



@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    problem: str = ""  # an exception that escaped the app, or a hang


async def send(app: Any, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
               body: bytes, port: int, cut: bool = False) -> Answer:
    """One request through the ASGI app; a streamed (SSE/NDJSON) answer is dropped after its headers.
    With `cut`, the client sends half its body and goes away (uvicorn's ClientDisconnect case)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": quote(path).encode(), "root_path": "",
             "query_string": query, "headers": headers, "server": ("127.0.0.1", port),
             "client": ("127.0.0.1", 50000), "state": {}}
    gone, finished = asyncio.Event(), asyncio.Event()
    answer = Answer(0, {})
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body[: len(body) // 2] if cut else body, "more_body": cut}
        if not cut:
            await gone.wait()
        return {"type": "http.disconnect"}

    async def send_(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
            if answer.headers.get("content-type", "").startswith(STREAMING):
                finished.set()  # the client reads the headers and leaves
                gone.set()
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")
            if not message.get("more_body"):
                finished.set()

    task = asyncio.ensure_future(app(scope, receive, send_))
    ended = asyncio.ensure_future(finished.wait())
    await asyncio.wait({task, ended}, timeout=REQUEST_LIMIT, return_when=asyncio.FIRST_COMPLETED)
    gone.set()
    if not ended.done():
        ended.cancel()
    done, _ = await asyncio.wait({task}, timeout=REQUEST_LIMIT)
    if not done:
        task.cancel()
        answer.problem = f"no complete answer within {REQUEST_LIMIT} s"
    elif task.exception() is not None:
        answer.problem = f"{type(task.exception()).__name__}: {task.exception()}"
    elif answer.status == 0:
        answer.problem = "the app ended without answering"
    return answer


# ── What to send ────────────────────────────────────────────────────────────────────────────

json_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10**20) |
                st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
random_json = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c,
                           max_size=4), max_leaves=16)
ids = st.sampled_from(["", "c1", "101", "api-x", "mcp-worker", "worker", "llama-127.0.0.1", "../etc/passwd",
                       "a" * 300, "é", "%00", "*", " "]) | st.text(max_size=12)
texts = st.sampled_from(["hello", "!help", "!session", "!model", "!models", "!autoAIdb", "!nosuch", "!",
                         "!help\n!session\nand a question", "@fake hi", "@nosuch hi", "", "   ", "### Task: title",
                         "x" * 250_000]) | st.text(max_size=40)
models = st.sampled_from(["", "fake", "fake:latest", "agent-mcp", "agent-mcp:latest", "nosuch", "a" * 500]) | st.text(
    max_size=10)


def _chat_messages(draw: Any) -> Any:
    return draw(st.sampled_from([[], [{"role": "user", "content": draw(texts)}],
                                 [{"role": "system", "content": "s"}, {"role": "user", "content": [
                                     {"type": "text", "text": draw(texts)}, {"type": "image_url"}]}],
                                 [{"role": "assistant", "content": None}], [{"content": "no role"}]]))


def _real_body(draw: Any, path: str) -> Any:
    """The JSON a well-behaved client would send to `path` (or {} where none is expected)."""
    if path.endswith("/submit"):
        return {"client_id": draw(ids), "text": draw(texts), "default_model": draw(models),
                "wait": draw(st.booleans()), "timeout": draw(st.sampled_from([0.5, 5, -1, 1e300]))}
    if path.endswith("/gate_response"):
        return {"gate_id": draw(ids), "decision": draw(st.sampled_from(["allow", "reject", "allow_session", "x"]))}
    if "/gate/" in path:
        return {"approve": draw(st.booleans())}
    if path.endswith(("/api/chat", "/chat/completions")):
        return {
            "model": draw(models),
            "messages": _chat_messages(draw),
            "stream": draw(st.booleans() | st.none()),
            "stream_options": {"include_usage": draw(st.booleans())},
            "keep_alive": draw(st.sampled_from([0, "5m"])),
        }
    if path.endswith("/api/generate"):
        return {"model": draw(models), "prompt": draw(texts), "stream": draw(st.booleans()), "keep_alive": "0"}
    if path.endswith("/api/show"):
        return {"model": draw(models), "name": draw(models)}
    if path.endswith("/mcp"):
        method = draw(st.sampled_from(["initialize", "ping", "tools/list", "tools/call", "resources/list",
                                       "resources/read", "resources/templates/list", "prompts/list",
                                       "notifications/initialized", "subscriptions/listen", "nosuch"]))
        params = draw(st.sampled_from([
            {}, {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "fuzz", "version": "1"}},
            {"name": draw(st.sampled_from(["send_message", "list_pending_approvals", "create_session",
                                           "delete_session", "answer_approval", "get_gate_policy",
                                           "set_gate_default", "nosuch"])),
             "arguments": {"session": draw(ids), "text": draw(texts), "message": draw(texts),
                           "gate_id": draw(ids), "decision": "reject", "wait": False}},
            {"uri": draw(st.sampled_from(["agentmcp://sessions", "agentmcp://approvals/pending",
                                          "agentmcp://sessions/mcp-worker/history", "agentmcp://x", "file:///etc"]))},
        ]))
        if draw(st.integers(0, 3)):  # the 2026 protocol's per-request envelope
            params = {**params, "_meta": {PROTOCOL_VERSION_META_KEY: MODERN, CLIENT_CAPABILITIES_META_KEY: {},
                                          CLIENT_INFO_META_KEY: {"name": "fuzz", "version": "1"}}}
        return {"jsonrpc": "2.0", "id": draw(st.integers(0, 3) | st.text(max_size=3)), "method": method,
                "params": params}
    return {}


def _mutated(draw: Any, value: Any) -> Any:
    """`value` with some fields dropped, added or replaced by random JSON (wrong types, shapes)."""
    if not isinstance(value, dict) or not value or not draw(st.booleans()):
        return value
    out = dict(value)
    for key in draw(st.lists(st.sampled_from(sorted(out)), max_size=3, unique=True)):
        if draw(st.booleans()):
            out[key] = draw(random_json)
        else:
            del out[key]
    if draw(st.booleans()):
        out[draw(st.text(max_size=8))] = draw(random_json)
    return out


def _deep(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def bodies(draw: Any, path: str) -> bytes:
    kind = draw(st.sampled_from(["real", "real", "real", "random", "deep", "deep-inside", "huge", "bytes",
                                 "empty", "text", "surrogate"]))
    if kind == "real":
        return json.dumps(_mutated(draw, _real_body(draw, path))).encode()
    if kind == "surrogate":  # a lone surrogate (escaped, as JSON allows) in one field of a real body
        real = _real_body(draw, path)
        key = draw(st.sampled_from(sorted(real) or ["model"]))
        bad = draw(st.sampled_from([r"\ud800", r"x\udfff", r"\udbff\u0041", r"\ud83d"]))
        return json.dumps({**real, key: "@@"}).encode().replace(b'"@@"', f'"{bad}"'.encode())
    if kind == "random":
        return json.dumps(draw(random_json)).encode()
    depth = draw(st.sampled_from([63, 64, 65, 200, 999, 5000, 100_000]))
    if kind == "deep":
        return _deep(depth, draw(st.sampled_from(["list", "dict"])))
    if kind == "deep-inside":  # a real body with one field nested deeply
        real = _real_body(draw, path)
        key = draw(st.sampled_from(sorted(real) or ["x"]))
        return json.dumps({**real, key: "@@"}).encode().replace(b'"@@"', _deep(depth, "list"))
    if kind == "huge":
        return json.dumps({**_real_body(draw, path), "text": "é" * draw(st.sampled_from([10**5, 2 * 10**6]))}).encode()
    if kind == "bytes":
        return draw(
            st.sampled_from(
                [
                    b'{"text": "\xff\xfe\xfd"}',
                    b"\xef\xbb\xbf{}",
                    b"\x00" * 10,
                    '{"text": "\ud800"}'.encode("utf-8", "surrogatepass"),
                ]
            )
        ) + draw(st.binary(max_size=20))
    if kind == "empty":
        return b""
    return draw(st.sampled_from([b"not json", b"{", b'{"a":1}{"b":2}', b"NaN", b"1e999999", b"9" * 5000, b"[]",
                                 b"null", b'"str"']))


def _fill(draw: Any, template: str) -> str:
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: quote(draw(ids), safe="") or "x", template)


@st.composite
def paths(draw: Any, target: Target) -> tuple[str, list[str]]:
    template, methods = draw(st.sampled_from(target.paths))
    path = _fill(draw, template)
    mutation = draw(st.sampled_from(["none"] * 20 + ["slash", "double", "suffix", "dots", "case", "random", "encoded"]))
    if mutation == "slash":
        path = path.rstrip("/") + "/"
    elif mutation == "double":
        path = "/" + path
    elif mutation == "suffix":
        path = path.rstrip("/") + "/" + draw(st.text(max_size=10))
    elif mutation == "dots":
        path = path + "/../../" + draw(st.sampled_from(["etc/passwd", "health", "api/v1/health", "mcp"]))
    elif mutation == "case":
        path = path.upper()
    elif mutation == "random":
        path = "/" + draw(st.text(max_size=30))
    elif mutation == "encoded":
        path = path + "%2F%00%ff"
    return path, methods


@st.composite
def queries(draw: Any) -> bytes:
    pairs = draw(st.lists(st.tuples(st.sampled_from(["client_id", "turn_id", "last_event_id", "model", "x"]) |
                                    st.text(max_size=5), ids | st.text(max_size=10)), max_size=3))
    raw = "&".join(f"{quote(k)}={quote(v)}" for k, v in pairs).encode()
    return draw(st.sampled_from([raw, raw, b"%ff%fe=%00", b"a=" + b"b" * 10_000, b"&&==&", b"model=%ED%A0%80"]))


def headers_for(draw: Any, target: Target, body: bytes) -> list[tuple[bytes, bytes]]:
    h: dict[str, str] = {}
    h["host"] = draw(st.sampled_from([f"127.0.0.1:{target.port}"] * 16 + [
        f"localhost:{target.port}", "evil.example", "", f"127.0.0.1:{target.port + 1}", "[::1]"]))
    auth = draw(st.sampled_from(["right"] * 16 + ["none", "wrong", "garbage", "mcp-agent"]))
    if auth == "right":
        h.update(target.auth)
    elif auth == "wrong":
        h["authorization"] = "Bearer wrong-token"
    elif auth == "garbage":
        h["authorization"] = draw(st.sampled_from(["Bearer", "Basic Zm9vOmJhcg==", "bearer  ", "\x7f" * 3, "x" * 9000]))
    elif auth == "mcp-agent":
        h["authorization"] = f"Bearer {MCP_AGENT}"
    h["content-type"] = draw(st.sampled_from(["application/json"] * 14 + [
        "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x", "", "application/json; charset=latin-1", "APPLICATION/JSON"]))
    h["accept"] = draw(st.sampled_from(["application/json, text/event-stream"] * 4 + ["*/*", "text/event-stream",
                                        "application/json", "", "text/html"]))
    if draw(st.booleans()):
        h["last-event-id"] = draw(st.sampled_from(["0", "5", "-1", "999999999999999999999", "abc", "1e5", " "]))
    if target.name == "plugin_client_mcp" and draw(st.integers(0, 2)):
        h["mcp-protocol-version"] = draw(st.sampled_from([MODERN, MODERN, "2025-11-25", "1999-01-01"]))
    if draw(st.integers(0, 19)) == 0:
        h["origin"] = draw(st.sampled_from([f"http://127.0.0.1:{target.port}", "http://evil.example", "null"]))
    if draw(st.integers(0, 4)) == 0:
        h["x-admin-key"] = draw(st.sampled_from([ADMIN_KEY, "wrong"]))
    if draw(st.integers(0, 4)) == 0:
        h[draw(st.sampled_from(["mcp-session-id", "mcp-protocol-version", "x-openwebui-chat-id", "user-agent"]))] = \
            draw(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20))
    if target.name == "plugin_proxy_llama" and draw(st.integers(0, 2)) == 0:  # who the caller says it is
        if draw(st.booleans()):
            h["authorization"] = f"Bearer {draw(st.sampled_from([PROXY_USER, PROXY_FORWARDER]))}"
        for name in draw(st.lists(st.sampled_from(["x-openwebui-user-id", "x-openwebui-chat-id", "x-forwarded-for",
                                                   "x-openwebui-user-name"]), max_size=3, unique=True)):
            h[name] = draw(st.sampled_from(["u1", "chat-1", "10.0.0.1", "10.0.0.1, 127.0.0.1", "not an ip", "",
                                            "a" * 500, "../../x", "é"]))
    if draw(st.integers(0, 29)) == 0:  # a huge header, or bytes that are no text
        h[draw(st.sampled_from(["x-openwebui-chat-id", "user-agent", "x-filler"]))] = draw(st.sampled_from(
            ["h" * 65_536, "\xff\xfe\xed\xa0\x80"]))
    if draw(st.integers(0, 19)) == 0:
        h["content-length"] = draw(st.sampled_from(["999999999999", "-1", "abc"]))
    else:
        h["content-length"] = str(len(body))
    return [(k.encode(), v.encode("latin-1", "replace")) for k, v in h.items()] + [
        (f"x-pad-{n}".encode(), b"p" * 100) for n in range(draw(st.sampled_from([0] * 29 + [400])))]


@dataclass
class Request:
    target: Target
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    cut: bool = False

    def __repr__(self) -> str:
        return (f"{'CUT ' if self.cut else ''}{self.method} {self.path}?{self.query[:80]!r} on {self.target.name} "
                f"headers={[(k, v[:60]) for k, v in self.headers]} body={self.body[:200]!r}…({len(self.body)} bytes)")


def requests(server: Server) -> st.SearchStrategy[Request]:
    @st.composite
    def build(draw: Any) -> Request:
        target = draw(st.sampled_from(server.targets))
        path, methods = draw(paths(target))
        method = draw(st.sampled_from(methods * 12 + ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]))
        body = draw(bodies(path)) if method not in ("GET", "HEAD") or draw(st.integers(0, 9)) == 0 else b""
        cut = bool(body) and draw(st.integers(0, 9)) == 0
        return Request(target, method, path, draw(queries()), headers_for(draw, target, body), body, cut)

    return build()


# ── The test ────────────────────────────────────────────────────────────────────────────────


def _failed(answer: Answer, req: Request) -> bool:
    """An answer the fuzz counts as a failure: an escaped exception, a hang, or a 5xx. Except one:
    /slack/health says 503 while Socket Mode reconnects (its documented health-check contract)."""
    if answer.problem:
        return True
    health = req.target.name == "plugin_client_slack" and answer.body.startswith(b'{"status":"disconnected"')
    return answer.status >= 500 and not (answer.status == 503 and health)


@dataclass
class Findings:
    """What went wrong: answers ≥ 500, escaped exceptions or hangs, log records at ERROR or with a traceback."""

    answers: list[str] = field(default_factory=list)
    records: list[logging.LogRecord] = field(default_factory=list)
    sent: int = 0


class _Catch(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]):
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.into.append(record)


@pytest.fixture
def slack(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSlack]:
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)  # slack-sdk ignores NO_PROXY
    with FakeSlack() as fake:
        yield fake


# The Slack client's threads use the global `random` (websocket masks) while Hypothesis draws, which
# it mistakes for a strategy using `random`; the strategies here never do.
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
def test_no_request_gets_a_5xx_or_a_traceback(tmp_path, fake_openai, slack) -> None:
    server = Server(tmp_path, fake_openai, slack)
    found = Findings()
    catch = _Catch(found.records)
    logging.getLogger().addHandler(catch)
    try:
        with asyncio.Runner() as runner:
            try:
                runner.run(server.start())
                @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
                          suppress_health_check=list(HealthCheck))
                @given(req=requests(server))
                def one(req: Request) -> None:
                    answer = runner.run(send(req.target.app, req.method, req.path, req.query, req.headers, req.body,
                                             req.target.port, req.cut))
                    found.sent += 1
                    if _failed(answer, req):
                        found.answers.append(f"{answer.status} {answer.problem} {answer.body[:300]!r} for {req!r}")

                one()
                # Let the turns the fuzz started finish (their failures would be logged too).
                runner.run(_settle(server))
            finally:
                runner.run(server.stop())
    finally:
        logging.getLogger().removeHandler(catch)
    assert found.sent >= EXAMPLES
    assert not found.answers, "\n".join(found.answers[:20])
    assert not found.records, "\n".join(
        f"{r.levelname} {r.name}: {r.getMessage()[:300]}" + (f" [{r.exc_info[0].__name__}]" if r.exc_info else "")
        for r in found.records[:20])


async def _settle(server: Server) -> None:
    assert server.rt is not None
    tasks = [t for group in server.rt.active_tasks.values() for t in group if not t.done()]
    if tasks:
        await asyncio.wait(tasks, timeout=REQUEST_LIMIT)


def test_a_body_cut_short_is_a_400_on_every_post_route(tmp_path, fake_openai, slack) -> None:
    """Every POST route of every listener (the MCP SDK's too), half a body and the client gone: a 4xx and
    one log line, never a 5xx or a traceback (the fuzz draws this case only now and then)."""
    server = Server(tmp_path, fake_openai, slack)
    records: list[logging.LogRecord] = []
    catch = _Catch(records)
    logging.getLogger().addHandler(catch)
    body = b'{"text": "hello", "client_id": "cut", "jsonrpc": "2.0", "id": 1, "method": "tools/list"}'
    tried = []
    try:
        with asyncio.Runner() as runner:
            try:
                runner.run(server.start())
                for target in server.targets:
                    for path, methods in target.paths:
                        if "POST" not in methods or "{" in path:
                            continue
                        headers = [(b"host", f"127.0.0.1:{target.port}".encode()),
                                   (b"content-type", b"application/json"),
                                   (b"accept", b"application/json, text/event-stream"),
                                   (b"content-length", str(len(body)).encode()),
                                   *((k.lower().encode(), v.encode()) for k, v in target.auth.items())]
                        answer = runner.run(send(target.app, "POST", path, b"", headers, body, target.port, cut=True))
                        tried.append(f"{target.name} {path}")
                        assert not answer.problem and 400 <= answer.status < 500, (target.name, path, answer)
            finally:
                runner.run(server.stop())
    finally:
        logging.getLogger().removeHandler(catch)
    assert any(t.startswith("plugin_client_mcp ") for t in tried) and len(tried) >= 5, tried
    assert not records, [f"{r.levelname} {r.name}: {r.getMessage()[:200]}" for r in records]
