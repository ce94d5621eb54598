"""A small MCP server written with the `mcp` SDK, for the MCP client tests: stdio or Streamable HTTP.

    python -m tests.fakes.mcp_server stdio
    python -m tests.fakes.mcp_server http --port 8931 [--token-env NAME]

Tools: `add` (structured result, read-only hint), `shout` (text), `fail` (an `isError` result),
`whoami` (pid and the environment variables the process can see), `grow` (adds the tool `extra`
and announces the change on both protocol eras), `book` (asks the client's user a form by elicitation —
a standalone request on 2025-11-25, `InputRequiredResult` rounds on 2026-07-28 — and says what came
back). Over HTTP, `--token-env` makes every request
need `Authorization: Bearer <value of that variable>`.
"""

from __future__ import annotations

import argparse
import hmac
import os
import sys
import threading
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import AcceptedElicitation, Context, Elicit, ElicitationResult, MCPServer, Resolve
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tests.fakes.cli import ENDED, StopSignals, serve_in_thread


class Seats(BaseModel):
    """The form `book` asks for."""

    seats: int = Field(description="How many seats", ge=1, le=9)
    window: bool = Field(default=False, description="A window seat")
    meal: Literal["veg", "meat"] = "veg"


def ask_seats(title: str) -> Elicit[Seats]:
    return Elicit(f"How many seats for '{title}'?", Seats)


def build_server(name: str) -> MCPServer:
    """The test server with its tools registered."""
    mcp = MCPServer(name, instructions="Test server for agent-mcp's MCP client.")

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @mcp.tool()
    def shout(text: str, times: int = 1) -> str:
        """Upper-case a text, repeated `times` times."""
        return " ".join([text.upper()] * times)

    @mcp.tool()
    def fail(reason: str) -> str:
        """Always fails with the given reason."""
        raise ToolError(f"failed on purpose: {reason}")

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
    def whoami(names: list[str]) -> dict[str, Any]:
        """The server's pid and which of the named environment variables it can see."""
        return {"pid": os.getpid(), "env": {n: os.environ.get(n) for n in names}}

    @mcp.tool(name="dotted.name-tool")
    def dotted(x: str = "") -> str:
        """A tool whose MCP name is not a Python identifier."""
        return f"dotted:{x}"

    @mcp.tool()
    def book(title: str, answer: Annotated[ElicitationResult[Seats], Resolve(ask_seats)]) -> str:
        """Book seats for a show: asks the user how many (elicitation)."""
        if isinstance(answer, AcceptedElicitation):
            return f"booked {title}: {answer.data.model_dump_json()}"
        return f"not booked: {answer.action}"

    @mcp.tool()
    async def grow(ctx: Context) -> str:
        """Add the tool `extra` and tell the client that the tool list changed."""

        def extra() -> str:
            """A tool added at run time."""
            return "extra!"

        if "extra" not in {t.name for t in await mcp.list_tools()}:
            mcp.add_tool(extra)
        await ctx.notify_tools_changed()  # 2026-07-28 clients: subscriptions/listen
        try:  # 2025-11-25 clients: notifications/tools/list_changed
            await ctx.request_context.session.send_tool_list_changed()
        except Exception as exc:  # a modern connection has no back channel for it
            print(f"legacy notification not sent: {exc!r}", file=sys.stderr)
        return "grown"

    return mcp


class _RequireBearer:
    """Pure ASGI: 401 unless `Authorization: Bearer <token>`."""

    def __init__(self, app: ASGIApp, token: str):
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not hmac.compare_digest(
            dict(scope["headers"]).get(b"authorization", b""), self.expected
        ):
            await JSONResponse({"error": "unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("transport", choices=["stdio", "http"])
    parser.add_argument("--name", default="test-server")
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--token-env", default=None)
    args = parser.parse_args(argv)
    mcp = build_server(args.name)
    if args.transport == "stdio":
        sys.exit(serve_in_thread(lambda: mcp.run("stdio"), "mcp-stdio"))
    import uvicorn

    app: ASGIApp = mcp.streamable_http_app()
    if args.token_env:
        app = _RequireBearer(app, os.environ[args.token_env])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    with StopSignals() as stop:  # uvicorn's own handlers would come late and only in the main thread

        def serve() -> None:
            try:
                server.run()
            finally:
                stop.ended()

        thread = threading.Thread(target=serve, name="mcp-http", daemon=True)
        thread.start()
        why = stop.wait()
        server.should_exit = True
        thread.join(10)
    sys.exit(1 if why == ENDED else 0)  # ended by itself: it could not start (uvicorn logged why)


if __name__ == "__main__":
    main()
