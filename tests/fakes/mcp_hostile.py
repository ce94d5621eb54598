"""A hostile stdio MCP server written with the `mcp` SDK, for the fence tests: each tool tries one thing a
third-party server should not be able to do and says what happened.

    python -m tests.fakes.mcp_hostile

Tools: `read` (a file's text), `write` (create a file), `connect` (a TCP connection), `unix` (a Unix socket),
`allocate` (that many MiB, touched), `spin` (burn CPU), `environment` (every variable it sees), `argv` (on stderr too),
`limits` (its rlimits), `escape` (a user namespace, a writable /), `cwd`.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from typing import Any

from mcp.server.mcpserver import MCPServer


def _outcome(action: Any) -> dict[str, Any]:
    try:
        return {"ok": True, "detail": str(action())}
    except (OSError, MemoryError) as exc:
        return {"ok": False, "detail": f"{type(exc).__name__}: {exc}"}


def build_server() -> MCPServer:
    mcp = MCPServer("hostile", instructions="Tries what a fenced server must not do.")

    @mcp.tool()
    def read(path: str) -> dict[str, Any]:
        """Read a file."""
        return _outcome(lambda: open(path).read())

    @mcp.tool()
    def write(path: str) -> dict[str, Any]:
        """Create a file."""
        def act() -> str:
            with open(path, "w") as fh:
                fh.write("planted by the hostile MCP server\n")
            return "written"
        return _outcome(act)

    @mcp.tool()
    def connect(host: str, port: int) -> dict[str, Any]:
        """Open a TCP connection."""
        def act() -> str:
            socket.create_connection((host, port), timeout=5).close()
            return "connected"
        return _outcome(act)

    @mcp.tool()
    def unix(path: str) -> dict[str, Any]:
        """Connect to a Unix socket."""
        def act() -> str:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            return "connected"
        return _outcome(act)

    @mcp.tool()
    def allocate(mib: int) -> dict[str, Any]:
        """Allocate (and touch) that many MiB."""
        def act() -> str:
            block = bytearray(mib << 20)
            block[::4096] = b"x" * len(block[::4096])
            return f"allocated {len(block) >> 20} MiB"
        return _outcome(act)

    @mcp.tool()
    def spin(seconds: float) -> str:
        """Burn CPU for that long."""
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
        return "spun"

    @mcp.tool()
    def environment() -> dict[str, str]:
        """Every environment variable this process sees."""
        return dict(os.environ)

    @mcp.tool()
    def argv() -> dict[str, list[str]]:
        """This process's arguments (also printed on stderr, which agent-mcp logs)."""
        print(f"my arguments: {sys.argv}", file=sys.stderr, flush=True)
        return {"argv": sys.argv}

    @mcp.tool()
    def limits() -> dict[str, int]:
        """Its soft resource limits (-1: none)."""
        names = {"data": resource.RLIMIT_DATA, "cpu": resource.RLIMIT_CPU, "nproc": resource.RLIMIT_NPROC,
                 "nofile": resource.RLIMIT_NOFILE, "fsize": resource.RLIMIT_FSIZE}
        return {k: resource.getrlimit(v)[0] for k, v in names.items()}

    @mcp.tool()
    def escape(how: str) -> dict[str, Any]:
        """Try to leave the fence: "userns" (a user namespace of its own) or "remount" (make / writable)."""
        def act() -> str:
            if how == "userns":  # in a child: unshare(CLONE_NEWUSER) needs a single-threaded process
                code = ("import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                        "if libc.unshare(0x10000000):\n    sys.exit(os.strerror(ctypes.get_errno()))")
                child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
                if child.returncode:
                    raise OSError(child.stderr.strip())
            else:  # util-linux keeps the mount's locked flags, so only the missing capability can stop it
                child = subprocess.run(["mount", "-o", "remount,rw,bind", "/"], capture_output=True, text=True)
                if child.returncode:
                    raise OSError(child.stderr.strip())
            return f"{how}: done"
        return _outcome(act)

    @mcp.tool()
    def cwd() -> dict[str, str]:
        """Its working directory."""
        return {"cwd": os.getcwd()}

    return mcp


if __name__ == "__main__":
    if __package__:  # python -m tests.fakes.mcp_hostile
        from tests.fakes.cli import serve_in_thread
    else:  # python tests/fakes/mcp_hostile.py, as the fence tests start it: its own folder is on sys.path
        from cli import serve_in_thread  # type: ignore[import-not-found,no-redef]  # that folder, not a package
    sys.exit(serve_in_thread(lambda: build_server().run("stdio"), "mcp-hostile-stdio"))
