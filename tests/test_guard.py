"""guard.py in process: the Host/Origin/token/JSON checks through httpx.ASGITransport, the token file, settings."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import guard
from shell_client import default_token_file, find_token

PORT = 8765
TOKEN = "t0ken-for-the-guard-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


class Recorder:
    """A one-route app that records every request reaching it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def endpoint(self, request: Request) -> JSONResponse:
        self.seen.append((request.method, request.url.path))
        return JSONResponse({"ok": True})

    def app(self) -> Starlette:
        methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
        return Starlette(routes=[Route("/{path:path}", self.endpoint, methods=methods)])


@pytest.fixture
async def guarded() -> AsyncIterator[tuple[httpx.AsyncClient, Recorder]]:
    """A guarded app on 127.0.0.1:8765 with a token, one extra host name and a few allowed origins."""
    rec = Recorder()
    app = guard.Guard(rec.app(), plugin="plugin_x", bind="127.0.0.1", port=PORT, token=TOKEN,
                      allowed_hosts=["agent.example", "box.lan:9000", "wild.lan:*"],
                      allowed_origins=["https://chat.example", "http://dev.lan:*"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://127.0.0.1:{PORT}") as http:
        yield http, rec


async def test_host_names_the_listener_or_is_refused_with_421(guarded: Any) -> None:
    http, rec = guarded
    passing = ["127.0.0.1", f"127.0.0.1:{PORT}", "localhost", "LOCALHOST:1234", "[::1]", f"[::1]:{PORT}",
               "agent.example", "agent.example:443", "box.lan:9000", "wild.lan:1"]
    for host in passing:
        assert (await http.get("/x", headers={**AUTH, "Host": host})).status_code == 200, host
    refused = ["rebind.evil.example", f"rebind.evil.example:{PORT}", "box.lan", "box.lan:9001", "127.0.0.2",
               "localhost.evil.example", "agent.example.evil", "0.0.0.0", ""]
    for host in refused:
        r = await http.get("/x", headers={**AUTH, "Host": host})
        assert r.status_code == 421, host
        assert "allowed_hosts of plugin_config.plugin_x" in r.json()["error"]
    assert len(rec.seen) == len(passing)


async def test_bind_address_counts_but_a_wildcard_bind_adds_no_name() -> None:
    for bind, host, status in [("192.168.1.5", "192.168.1.5:8765", 200), ("0.0.0.0", "0.0.0.0:8765", 421),
                               ("::", "[::]:8765", 421), ("::1", "[::1]:8765", 200), ("fd00::5", "[fd00::5]", 200),
                               ("box.lan", "BOX.lan:8765", 200), ("0.0.0.0", "192.168.1.5:8765", 421)]:
        app = guard.Guard(Recorder().app(), plugin="p", bind=bind, port=PORT)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as http:
            assert (await http.get("/", headers={"Host": host})).status_code == status, (bind, host)


async def test_origins_same_origin_and_configured_pass_others_get_403(guarded: Any) -> None:
    http, rec = guarded
    passing = [f"http://127.0.0.1:{PORT}", f"http://localhost:{PORT}", f"http://[::1]:{PORT}",
               "https://chat.example", "HTTPS://Chat.Example", "http://dev.lan:3000"]
    for origin in passing:
        r = await http.get("/x", headers={**AUTH, "Origin": origin})
        assert r.status_code == 200, origin
        assert r.headers["access-control-allow-origin"] == origin and r.headers["vary"] == "Origin"
    refused = ["null", "http://evil.example", "http://localhost:3000", "http://127.0.0.1", "https://chat.example:8443",
               "http://dev.lan:3000.evil.example", "http://dev.lan:", "file://", "garbage", ""]
    for origin in refused:
        r = await http.get("/x", headers={**AUTH, "Origin": origin})
        assert r.status_code == 403, origin
        assert "allowed_origins of plugin_config.plugin_x" in r.json()["error"]
        assert "access-control-allow-origin" not in r.headers
    # An origin equal to the (allowed) Host is same-origin: a page served under the same name.
    same = await http.get("/x", headers={**AUTH, "Host": "agent.example", "Origin": "https://agent.example"})
    assert same.status_code == 200
    assert len(rec.seen) == len(passing) + 1


async def test_star_allows_any_origin_but_null() -> None:
    rec = Recorder()
    app = guard.Guard(rec.app(), plugin="p", bind="127.0.0.1", port=PORT, allowed_origins=["*"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://127.0.0.1:{PORT}") as http:
        assert (await http.get("/", headers={"Origin": "https://anything.example"})).status_code == 200
        assert (await http.get("/", headers={"Origin": "null"})).status_code == 403
    assert len(rec.seen) == 1


async def test_preflight_is_answered_for_allowed_origins_only(guarded: Any) -> None:
    http, rec = guarded
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type, x-custom"}
    ok = await http.options("/v1/chat/completions", headers={**ask, "Origin": "https://chat.example"})
    assert ok.status_code == 204  # without a token: browsers send none on a preflight
    assert ok.headers["access-control-allow-origin"] == "https://chat.example"
    assert "POST" in ok.headers["access-control-allow-methods"]
    allowed_headers = [h.strip().lower() for h in ok.headers["access-control-allow-headers"].split(",")]
    assert {"authorization", "content-type", "x-custom"} <= set(allowed_headers)
    denied = await http.options("/v1/chat/completions", headers={**ask, "Origin": "http://evil.example"})
    assert denied.status_code == 403 and "access-control-allow-origin" not in denied.headers
    # OPTIONS without Access-Control-Request-Method is an ordinary request: token first.
    assert (await http.options("/x", headers={"Origin": "https://chat.example"})).status_code == 401
    assert rec.seen == []


async def test_token_is_required_and_refusals_to_allowed_origins_carry_cors(guarded: Any) -> None:
    http, rec = guarded
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": TOKEN}):
        assert (await http.get("/x", headers=headers)).status_code == 401, headers
    r = await http.get("/x", headers={"Origin": "https://chat.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://chat.example"
    assert rec.seen == []


async def test_bodies_must_be_json(guarded: Any) -> None:
    http, rec = guarded
    simple = [("text/plain", b'{"text": "hi"}'), ("application/x-www-form-urlencoded", b"text=hi"),
              ("multipart/form-data; boundary=x", b"--x--"), ("application/json-seq", b"{}"),
              ("text/json", b"{}"), ("", b"{}")]
    for method in ("POST", "PUT", "PATCH", "DELETE", "GET"):
        for ctype, body in simple:
            headers = {**AUTH, **({"Content-Type": ctype} if ctype else {})}
            r = await http.request(method, "/x", content=body, headers=headers)
            assert r.status_code == 415, (method, ctype)
            assert "Content-Type: application/json" in r.json()["error"]
    for method in ("POST", "PUT", "PATCH"):  # no body, no type: still refused
        assert (await http.request(method, "/x", headers=AUTH)).status_code == 415
    assert rec.seen == []
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON ;charset=UTF-8"):
        assert (await http.post("/x", content=b"{}", headers={**AUTH, "Content-Type": ctype})).status_code == 200
    for method in ("GET", "HEAD", "DELETE", "OPTIONS"):
        assert (await http.request(method, "/x", headers=AUTH)).status_code == 200
    assert len(rec.seen) == 7


async def test_checks_run_in_order_host_origin_token_type(guarded: Any) -> None:
    http, rec = guarded
    form = {"Content-Type": "text/plain"}
    evil = {"Origin": "http://evil.example"}
    assert (
        await http.post("/x", content=b"a", headers={**form, **evil, "Host": "rebind.evil.example"})
    ).status_code == 421
    assert (await http.post("/x", content=b"a", headers={**form, **evil})).status_code == 403
    assert (await http.post("/x", content=b"a", headers=form)).status_code == 401
    assert (await http.post("/x", content=b"a", headers={**form, **AUTH})).status_code == 415
    assert (await http.post("/x", content=b"{}", headers={**JSON, **AUTH})).status_code == 200
    assert rec.seen == [("POST", "/x")]


async def test_websocket_with_a_foreign_host_is_closed_before_the_app() -> None:
    rec = Recorder()
    app = guard.Guard(rec.app(), plugin="p", bind="127.0.0.1", port=PORT)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/", "headers": [(b"host", b"rebind.evil.example")], "query_string": b""}
    await app(scope, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}] and rec.seen == []


# ── Settings ──────────────────────────────────────────────────────────────────────────────────


class _Listener(guard.ListenerSettings):
    pass


def test_listener_settings_normalise_and_reject_what_cannot_match() -> None:
    ok = _Listener(allowed_hosts=[" Agent.Example ", "box:9000", "w:*", "[::1]:80"],
                   allowed_origins=["https://Chat.Example", "http://dev:*", "*", "chrome-extension://abc"])
    assert ok.allowed_hosts == ["agent.example", "box:9000", "w:*", "[::1]:80"]
    assert ok.allowed_origins[0] == "https://chat.example"
    for field, value, message in [
        ("allowed_hosts", "http://agent.example", "not a host name"),
        ("allowed_hosts", "agent.example/path", "not a host name"),
        ("allowed_origins", "chat.example", "not an origin"),
        ("allowed_origins", "https://chat.example/", "no trailing slash"),
        ("allowed_origins", "null", "'null' cannot be allowed"),
    ]:
        with pytest.raises(ValidationError, match=message):
            _Listener.model_validate({field: [value]})


# ── The token file ────────────────────────────────────────────────────────────────────────────


def test_token_file_is_created_private_once_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "data" / "shell-token"
    token = guard.ensure_token_file(path)
    assert len(token) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert guard.ensure_token_file(path) == token == guard.read_token_file(path)
    path.write_text("operator-chosen\n")
    assert guard.ensure_token_file(path) == "operator-chosen"


def test_token_file_that_others_can_read_or_we_do_not_own_is_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "shell-token"
    guard.ensure_token_file(path)
    os.chmod(path, 0o640)
    with pytest.raises(guard.TokenFileError, match=f"readable by other users.*run chmod 600 {path}"):
        guard.ensure_token_file(path)
    os.chmod(path, 0o600)
    real = os.getuid()
    monkeypatch.setattr(guard.os, "getuid", lambda: real + 1)
    with pytest.raises(guard.TokenFileError, match=f"{path} belongs to another user"):
        guard.read_token_file(path)


def test_token_file_problems_name_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(guard.TokenFileError, match="does not exist: start agent-mcp once"):
        guard.read_token_file(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.touch(mode=0o600)
    with pytest.raises(guard.TokenFileError, match="is empty: delete it"):
        guard.read_token_file(empty)
    (tmp_path / "target").write_text("x")
    os.chmod(tmp_path / "target", 0o600)
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(guard.TokenFileError, match=r"cannot read .*link"):  # a planted symlink is not followed
        guard.read_token_file(tmp_path / "link")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(guard.TokenFileError, match=r"cannot create .*set AGENT_SHELL_TOKEN"):
        guard.ensure_token_file(tmp_path / "a-file" / "shell-token")


def test_shell_finds_its_token_flag_then_env_then_file(tmp_path: Path) -> None:
    env = {"AGENT_DATA_DIR": str(tmp_path)}
    assert default_token_file(env) == tmp_path / "shell-token"
    token, hint = find_token(None, env)
    assert token is None and hint is not None and "does not exist" in hint
    written = guard.ensure_token_file(tmp_path / "shell-token")
    token, hint = find_token(None, env)
    assert token == written and hint is not None and str(tmp_path / "shell-token") in hint
    assert find_token(None, {**env, "AGENT_SHELL_TOKEN": "from-env"}) == ("from-env", None)
    assert find_token("from-flag", {**env, "AGENT_SHELL_TOKEN": "from-env"}) == ("from-flag", None)
    os.chmod(tmp_path / "shell-token", 0o644)
    token, hint = find_token(None, env, tmp_path / "shell-token")
    assert token is None and hint is not None and "chmod 600" in hint
