"""The hostile-page suite: what a web page, a rebinding DNS name or a tokenless caller can do to each listener.

One agent-mcp subprocess serves every client listener (shell, API, proxy, Slack against the fake
Slack, MCP) with a fake OpenAI backend. The route list is taken from the plugins themselves (their
`get_routes()`, Mounts flattened), so a route added later is attacked too. Every attack is refused
with its status (421 Host, 403 Origin, 401 token, 415 Content-Type), and afterwards the model
backend has received nothing, no session exists and the gate state is untouched.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.routing import BaseRoute, Mount, Route

from tests.conftest import AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.openai_backend import FakeOpenAI
from tests.fakes.slack import APP_TOKEN, BOT_TOKEN, FakeSlack
from tests.plugin_host import plugin, plugin_runtime

API_KEY = "api-key-for-the-hostile-suite"
SLACK_STATUS_TOKEN = "slack-status-token-hostile"
MCP_TOKEN = "mcp-human-token-hostile-0001"
EVIL = "http://evil.example"
UI = "https://ui.example"  # an origin every listener is configured to allow
WEBUI = "http://webui.example:8080"  # open-webui "direct connections": allowed on the proxy only
LISTENERS = ("plugin_client_shellpy", "plugin_client_api", "plugin_proxy_llama", "plugin_client_slack",
             "plugin_client_mcp")
#: Methods tried on a route that accepts any (an ASGI app endpoint such as the MCP transport).
ANY_METHOD = ("GET", "POST", "PUT", "PATCH", "DELETE")
BODY_METHODS = ("POST", "PUT", "PATCH")
#: What a hostile request would ask for if it got through: a gate change and a gate-skipping turn.
PAYLOAD = {"client_id": "evil", "text": "@fake !autoAIdb write true", "model": "agent-mcp", "prompt": "hi",
           "messages": [{"role": "user", "content": "@fake !autoAIdb write true"}], "approve": True,
           "gate_id": "g1", "decision": "allow", "jsonrpc": "2.0", "id": 1, "method": "tools/call",
           "params": {"name": "send_message", "arguments": {"session": "evil", "text": "hi"}}}
SIMPLE_BODIES = {  # the three content types a page may POST cross-site without a preflight
    "text/plain": json.dumps(PAYLOAD).encode(),
    "application/x-www-form-urlencoded": b"text=%40fake+%21autoAIdb+write+true&client_id=evil",
    "multipart/form-data; boundary=xx": b'--xx\r\nContent-Disposition: form-data; name="text"\r\n\r\nhi\r\n--xx--\r\n',
}
GUARD_STATUSES = {401, 403, 415, 421}


@dataclass(frozen=True)
class Target:
    """One method on one concrete path of one listener."""

    plugin: str
    method: str
    path: str

    def __str__(self) -> str:
        return f"{self.plugin} {self.method} {self.path}"


def _concrete(path: str) -> str:
    """A route path with each `{param}` replaced by a harmless value (`/session/{sid}` → `/session/x1`)."""
    return re.sub(r"\{[^}:]+:path\}", "x1/unlisted", re.sub(r"\{[^}:]+(:(?!path)[^}]*)?\}", "x1", path)) or "/"


def _flatten(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, tuple[str, ...]]]:
    """(path, methods) of every route, Mounts opened, HEAD left out (it is GET without a body)."""
    for route in routes:
        if isinstance(route, Mount):
            yield from _flatten(list(route.routes), prefix + route.path)
        elif isinstance(route, Route):
            methods = tuple(sorted(set(route.methods) - {"HEAD"})) if route.methods else ANY_METHOD
            yield (prefix + route.path).replace("//", "/"), methods


@dataclass
class Stack:
    """The running server and what the suite needs to reach and judge it."""

    server: AgentServer
    backend: FakeOpenAI
    ports: dict[str, int]
    targets: list[Target]
    #: gate-defaults.json as written at start: a gate command that ran could have saved over it.
    gates_file: str

    def url(self, target: Target) -> str:
        return f"http://127.0.0.1:{self.ports[target.plugin]}{target.path}"

    def credentials(self, plugin: str) -> dict[str, str]:
        """The headers that authenticate a request to `plugin`'s listener."""
        token = {"plugin_client_shellpy": self.server.token, "plugin_client_api": API_KEY,
                 "plugin_client_slack": SLACK_STATUS_TOKEN, "plugin_client_mcp": MCP_TOKEN}.get(plugin)
        return {"Authorization": f"Bearer {token}"} if token else {}


def _settings(backend: FakeOpenAI, slack: FakeSlack, ports: dict[str, int]) -> tuple[dict[str, Any], dict[str, str]]:
    """(plugin_config, env) of the suite's server: every listener on its port, tokens where they exist."""
    conf: dict[str, Any] = {name: {"port": port, "allowed_origins": [UI]} for name, port in ports.items()}
    conf["plugin_proxy_llama"]["allowed_origins"] = [UI, WEBUI]
    conf["plugin_client_slack"]["api_base_url"] = slack.base_url
    env = {"API_KEY": API_KEY, "AGENT_SLACK_TOKEN": SLACK_STATUS_TOKEN, "SLACK_BOT_TOKEN": BOT_TOKEN,
           "SLACK_APP_TOKEN": APP_TOKEN}
    return conf, env


def _write_tokens(path: Path) -> None:
    (path / "mcp-tokens.json").write_text(json.dumps({"tokens": {"owner": {"role": "human", "token": MCP_TOKEN}}}))
    (path / "mcp-tokens.json").chmod(0o600)  # it holds tokens: agent-mcp refuses it readable by others


async def _route_table(path: Path, backend: FakeOpenAI, slack: FakeSlack) -> list[Target]:
    """Every (listener, method, path) the client plugins serve, read from their own get_routes()."""
    conf, env = _settings(backend, slack, {name: free_port() for name in LISTENERS})
    _write_tokens(path)
    async with plugin_runtime(path, conf, env, gates={"db": {}, "tools": {}}) as rt:
        targets = [Target(name, method, _concrete(route_path))
                   for name in LISTENERS for route_path, methods in _flatten(plugin(rt, name).get_routes())
                   for method in methods]
    return sorted(set(targets), key=str)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with FakeOpenAI() as backend, FakeSlack() as slack:
        targets = asyncio.run(_route_table(tmp_path_factory.mktemp("routes"), backend, slack))
        path = tmp_path_factory.mktemp("hostile")
        ports = {name: free_port() for name in LISTENERS}
        cfg = ConfigDir(path)
        cfg.port = ports["plugin_client_shellpy"]
        cfg.models = {"fake": openai_model(backend)}
        cfg.plugins = list(LISTENERS)
        cfg.plugin_config, cfg.env = _settings(backend, slack, ports)
        cfg.gates = {"db": {}, "tools": {}}
        _write_tokens(path)
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            health = server.health()["plugins"]
            assert all(health[name]["status"] == "loaded" for name in LISTENERS), health
            yield Stack(server, backend, ports, targets, (path / "gate-defaults.json").read_text())
        finally:
            server.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as client:
        yield client


def _send(http: httpx.Client, stack: Stack, target: Target, headers: dict[str, str],
          body: bytes | None = None) -> httpx.Response:
    """One request; a response that starts a stream is closed after its head."""
    request = http.build_request(target.method, stack.url(target), headers=headers, content=body)
    response = http.send(request, stream=True)
    response.close()
    return response


def _json(target: Target) -> tuple[dict[str, str], bytes | None]:
    """Headers and body of a well-formed request: JSON where the method carries one."""
    if target.method in BODY_METHODS:
        return {"Content-Type": "application/json"}, json.dumps(PAYLOAD).encode()
    return {}, None


def _assert_untouched(stack: Stack) -> None:
    assert stack.backend.requests == [], "a hostile request reached the model"
    sessions = httpx.get(f"{stack.server.url}/sessions", headers=stack.server.auth, timeout=5).json()["sessions"]
    assert sessions == [], f"a hostile request created a session: {sessions}"
    assert (stack.server.cfg.path / "gate-defaults.json").read_text() == stack.gates_file


# ── The attacks ───────────────────────────────────────────────────────────────────────────────


def test_the_route_table_covers_every_listener(stack: Stack) -> None:
    by_plugin = {name: [t for t in stack.targets if t.plugin == name] for name in LISTENERS}
    assert all(by_plugin.values()), by_plugin
    assert Target("plugin_client_shellpy", "POST", "/submit") in stack.targets
    assert Target("plugin_client_mcp", "POST", "/mcp") in stack.targets
    assert Target("plugin_proxy_llama", "POST", "/v1/chat/completions") in stack.targets


def test_rebinding_hosts_get_421_everywhere(stack: Stack, http: httpx.Client) -> None:
    for target in stack.targets:
        headers, body = _json(target)
        for host in ("rebind.evil.example", f"rebind.evil.example:{stack.ports[target.plugin]}"):
            r = _send(http, stack, target, {**headers, **stack.credentials(target.plugin), "Host": host}, body)
            assert r.status_code == 421, (str(target), host, r.status_code)
    _assert_untouched(stack)


def test_foreign_and_null_origins_get_403_everywhere(stack: Stack, http: httpx.Client) -> None:
    for target in stack.targets:
        headers, body = _json(target)
        for origin in (EVIL, "null", f"http://localhost:{free_port()}", WEBUI if target.plugin != "plugin_proxy_llama"
                       else "https://webui.example"):
            r = _send(http, stack, target, {**headers, **stack.credentials(target.plugin), "Origin": origin}, body)
            assert r.status_code == 403, (str(target), origin, r.status_code)
            assert "access-control-allow-origin" not in r.headers
    _assert_untouched(stack)


def test_cross_site_simple_requests_are_refused(stack: Stack, http: httpx.Client) -> None:
    """As a page sends them (Origin set, no token) they meet 403; even with a token and no Origin, 415."""
    for target in stack.targets:
        if target.method == "GET":
            continue
        for ctype, body in SIMPLE_BODIES.items():
            as_page = _send(http, stack, target, {"Content-Type": ctype, "Origin": EVIL}, body)
            assert as_page.status_code == 403, (str(target), ctype, as_page.status_code)
            direct = _send(http, stack, target, {"Content-Type": ctype, **stack.credentials(target.plugin)}, body)
            assert direct.status_code == 415, (str(target), ctype, direct.status_code)
    _assert_untouched(stack)


def test_missing_and_wrong_tokens_get_401(stack: Stack, http: httpx.Client) -> None:
    protected = [t for t in stack.targets if stack.credentials(t.plugin) and not t.path.startswith("/.well-known/")]
    assert {t.plugin for t in protected} == set(LISTENERS) - {"plugin_proxy_llama"}  # the proxy has no token here
    for target in protected:
        headers, body = _json(target)
        for auth in ({}, {"Authorization": "Bearer wrong-token-000000000000"},
                     {"Authorization": stack.credentials(target.plugin)["Authorization"].replace("Bearer", "Basic")}):
            r = _send(http, stack, target, {**headers, **auth}, body)
            assert r.status_code == 401, (str(target), auth, r.status_code)
    # A token of one listener opens no other.
    r = _send(http, stack, Target("plugin_client_shellpy", "GET", "/sessions"), {"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 401
    _assert_untouched(stack)


def test_preflights_from_foreign_origins_are_refused(stack: Stack, http: httpx.Client) -> None:
    for target in {Target(t.plugin, "OPTIONS", t.path) for t in stack.targets}:
        for origin in (EVIL, "null"):
            r = _send(http, stack, target, {"Origin": origin, "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "content-type, authorization"})
            assert r.status_code == 403 and "access-control-allow-origin" not in r.headers, (str(target), origin)
    _assert_untouched(stack)


# ── What must still work ──────────────────────────────────────────────────────────────────────


def test_same_origin_and_configured_origins_pass_with_cors(stack: Stack, http: httpx.Client) -> None:
    """Allowed origins reach the handler (its own answer, never a guard status); preflights get 204."""
    for target in stack.targets:
        port = stack.ports[target.plugin]
        origins = [f"http://127.0.0.1:{port}", f"http://localhost:{port}", UI]
        if target.plugin == "plugin_proxy_llama":
            origins.append(WEBUI)
        for origin in origins:
            pre = _send(http, stack, Target(target.plugin, "OPTIONS", target.path),
                        {"Origin": origin, "Access-Control-Request-Method": target.method,
                         "Access-Control-Request-Headers": "authorization, content-type"})
            assert pre.status_code == 204, (str(target), origin, pre.status_code)
            assert pre.headers["access-control-allow-origin"] == origin
            assert {"authorization", "content-type"} <= {
                h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
            if target.method in BODY_METHODS:
                headers, body = {"Content-Type": "application/json"}, b"{}"  # reaches the handler, changes nothing
            else:
                headers, body = {}, None
            r = _send(http, stack, target, {**headers, **stack.credentials(target.plugin), "Origin": origin}, body)
            assert r.status_code not in GUARD_STATUSES, (str(target), origin, r.status_code)
            assert r.headers.get("access-control-allow-origin") == origin, str(target)
    _assert_untouched(stack)


def test_open_webui_direct_connection_chats_through_the_proxy(stack: Stack) -> None:
    """A browser app on an allowed origin (the proxy's `allowed_origins`) runs a whole turn."""
    url = f"http://127.0.0.1:{stack.ports['plugin_proxy_llama']}/v1/chat/completions"
    body = {"model": "agent-mcp", "messages": [{"role": "user", "content": "hello from the browser"}], "stream": False}
    r = httpx.post(url, json=body, headers={"Origin": WEBUI}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == WEBUI
    assert r.json()["choices"][0]["message"]["content"] == "echo: hello from the browser"
    assert stack.backend.requests[-1].last_user_text == "hello from the browser"
    refused = httpx.post(url, json=body, headers={"Origin": "https://elsewhere.example"}, timeout=30)
    assert refused.status_code == 403 and len(stack.backend.requests) == 1


def test_refusals_say_which_setting_to_change(stack: Stack, http: httpx.Client) -> None:
    target = Target("plugin_proxy_llama", "GET", "/api/tags")
    host = _send(http, stack, target, {"Host": "rebind.evil.example"})
    assert host.status_code == 421
    http_host = httpx.get(stack.url(target), headers={"Host": "rebind.evil.example"}, timeout=5).json()["error"]
    assert "allowed_hosts of plugin_config.plugin_proxy_llama in plugins-enabled.json" in http_host
    origin = httpx.get(stack.url(target), headers={"Origin": EVIL}, timeout=5).json()["error"]
    assert "allowed_origins of plugin_config.plugin_proxy_llama" in origin and EVIL in origin
    ctype = httpx.post(f"http://127.0.0.1:{stack.ports['plugin_proxy_llama']}/api/chat", content=b"{}",
                       headers={"Content-Type": "text/plain"}, timeout=5).json()["error"]
    assert "needs Content-Type: application/json" in ctype

