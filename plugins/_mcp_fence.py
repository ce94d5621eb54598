"""The fence of a stdio MCP server: resource limits, only its declared environment, and a bubblewrap sandbox
(no view of agent-mcp's config and data dirs and `.env`, a read-only filesystem but for its own dirs and a
private /tmp, no network unless its entry allows it)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from config import CODE_DIR
from plugins._mcp_servers import Limits, StdioServer

LAUNCHER = Path(__file__).with_name("_mcp_launch.py")
#: Where the sandbox has empty dirs of its own instead of the host's.
PRIVATE_DIRS = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), Path("/run"))
#: Files of a config dir that is also the program's checkout: hidden one by one (the code stays visible).
CONFIG_PATTERNS = (".env*", "*.json", "*.sqlite3", "*.key", "*.pem", ".system_prompt")
INSTALL_HINT = "apt-get install bubblewrap"
#: No user namespaces inside the sandbox (a nested one would give the server capabilities there): bwrap 0.8+.
NO_NESTED_USERNS = ("--disable-userns",)


class FenceError(Exception):
    """A server cannot be started fenced as its entry asks; the message says what to change."""


@dataclass(frozen=True)
class Host:
    """What fencing needs to know of this agent-mcp: its dirs and the bubblewrap found at start."""

    config_dir: Path
    data_dir: Path
    #: The bwrap that works here, or None.
    bwrap: str | None
    #: Why there is no sandbox (not installed, or it cannot create namespaces here); "" when there is one.
    no_sandbox: str = ""
    #: Secret files of agent-mcp kept outside its dirs (`AGENT_*_FILE` settings, e.g. the audit key).
    secret_files: tuple[Path, ...] = ()
    #: Flags this bwrap takes beyond the common ones (found by `find_sandbox`).
    bwrap_flags: tuple[str, ...] = NO_NESTED_USERNS


@dataclass(frozen=True)
class Launch:
    """How one server is started: the command line the MCP SDK runs, and what the fence is."""

    command: str
    args: list[str]
    cwd: Path
    sandboxed: bool
    #: One line for the log and `!mcp`: sandboxed or not, network, limits.
    summary: str


def _namespaces(network: str, extra: tuple[str, ...]) -> list[str]:
    # --unshare-user, not the "-try" of --unshare-all: without a user namespace of its own, no sandbox.
    return ["--unshare-all", "--unshare-user", *(["--share-net"] if network == "host" else []), *extra,
            "--die-with-parent", "--cap-drop", "ALL"]


async def _probe(exe: str, extra: tuple[str, ...]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        exe, *_namespaces("none", extra), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    return proc.returncode or 0, (err.decode(errors="replace").strip().splitlines() or ["no reason given"])[-1]


async def find_sandbox(path: str | None) -> tuple[str | None, str, tuple[str, ...]]:
    """(bwrap, "", its extra flags) when bubblewrap is installed and can make a sandbox here, else (None, why
    not, ())."""
    exe = shutil.which("bwrap", path=path)
    if exe is None:
        return None, f"bubblewrap is not installed ({INSTALL_HINT})", ()
    extra: tuple[str, ...] = NO_NESTED_USERNS
    try:
        code, last = await _probe(exe, extra)
        if code != 0 and "Unknown option" in last:  # older than 0.8: nested user namespaces stay possible
            extra = ()
            code, last = await _probe(exe, extra)
    except (OSError, TimeoutError) as exc:
        return None, f"{exe} does not run here ({exc})", ()
    if code != 0:
        return None, (f"{exe} cannot create a sandbox here ({last}); user namespaces may be switched off "
                      "(sysctl kernel.unprivileged_userns_clone, or an AppArmor profile for bwrap)"), ()
    return exe, "", extra


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _hidden(host: Host, extra: list[str]) -> list[Path]:
    """What no sandboxed server sees: the config dir (or, when it is the program's checkout, its agent files),
    the data dir, `.env`, agent-mcp's secret files elsewhere, and the entry's hidden paths."""
    config = host.config_dir.resolve()
    paths: list[Path] = []
    if _inside(CODE_DIR, config):
        paths += sorted({p for pattern in CONFIG_PATTERNS for p in config.glob(pattern)})
    else:
        paths.append(config)
    paths.append(host.data_dir.resolve())
    paths += [p.resolve() for p in host.secret_files]
    paths += [Path(os.path.expanduser(p)).resolve() for p in extra]
    return paths


def _limits(limits: Limits, sandboxed: bool) -> dict[str, int]:
    chosen = {k: v for k, v in limits.model_dump().items() if v is not None}
    if not sandboxed:
        # RLIMIT_NPROC counts every process of the user outside a user namespace of its own.
        chosen.pop("processes", None)
    return chosen


def _summary(sandboxed: bool, why_not: str, network: str, limits: dict[str, int]) -> str:
    shown = ", ".join(f"{k} {v}" for k, v in limits.items()) or "none"
    if sandboxed:
        return f"sandboxed (bubblewrap), network {network}, limits: {shown}"
    return f"NOT sandboxed ({why_not}), limits: {shown}"


def fenced(name: str, spec: StdioServer, command: str, args: list[str], child_env: list[str], host: Host) -> Launch:
    """The command line that starts `command args` fenced as `spec` says (FenceError when it cannot be).

    `command` is already resolved to a path; `child_env` names the variables of its entry (their values come
    through the environment the SDK passes, never on a command line).
    """
    want = spec.sandbox or "auto"
    sandboxed = want != "off" and host.bwrap is not None
    if want == "required" and not sandboxed:
        raise FenceError(f"its entry says \"sandbox\": \"required\" but {host.no_sandbox}")
    why_not = "\"sandbox\": \"off\" in mcp-servers.json" if want == "off" else host.no_sandbox
    config = host.config_dir.resolve()
    #: A sandboxed server's own dir, kept between starts: its HOME, and its cwd unless the entry names one.
    home = host.data_dir.resolve() / "mcp" / name
    if sandboxed:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
    workdir = (config / spec.cwd).resolve() if spec.cwd else home if sandboxed else config
    if not workdir.is_dir():
        raise FenceError(f"its cwd {workdir} is not a directory: create it, or fix \"cwd\" in mcp-servers.json")
    hidden = _hidden(host, spec.hidden or [])
    if sandboxed:
        exposed = [p for p in (config, host.data_dir.resolve(), config / ".env") if _inside(p, workdir)]
        if exposed:
            raise FenceError(f"its cwd {workdir} holds agent-mcp's own files ({exposed[0]}), which a sandboxed "
                             "server must not see: give it a directory of its own (\"cwd\" in mcp-servers.json)")
        real = Path(command).resolve()
        hiding = next((h for h in [*hidden, *PRIVATE_DIRS] if _inside(real, h)), None)
        if hiding is not None and not _inside(real, workdir) and not _inside(real, home):
            raise FenceError(f"its command {command} is inside {hiding}, which the sandbox hides or replaces: "
                             "install the server elsewhere, or put it in its own working dir (\"cwd\")")
    limits = _limits(spec.limits or Limits(), sandboxed)
    network = spec.network or "none"
    launcher = [os.path.realpath(sys.executable), "-I", "-S", str(LAUNCHER)]
    for k, v in limits.items():
        launcher += ["--limit", f"{k}={v}"]
    for var in dict.fromkeys(["PATH", *child_env]):
        launcher += ["--keep", var]
    if "HOME" not in child_env:
        launcher += ["--keep", "HOME"] if not sandboxed else ["--set", f"HOME={home}"]
    if "LANG" not in child_env:
        launcher += ["--set", f"LANG={os.environ.get('LANG') or 'C.UTF-8'}"]
    launcher += ["--", command, *args]
    summary = _summary(sandboxed, why_not, network, limits)
    if not sandboxed:
        return Launch(launcher[0], launcher[1:], workdir, False, summary)
    assert host.bwrap is not None
    box = [*_namespaces(network, host.bwrap_flags), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
           # Unix sockets (databases, Docker, D-Bus) answer through a read-only mount: /run goes too.
           "--tmpfs", "/tmp", "--tmpfs", "/var/tmp", "--tmpfs", "/dev/shm", "--tmpfs", "/run"]
    resolv = Path("/etc/resolv.conf").resolve()
    if network == "host" and _inside(resolv, Path("/run")):
        box += ["--ro-bind", str(resolv), str(resolv)]
    emptied = [p for p in hidden if p.is_dir()]
    for path in hidden:
        if path.is_dir():
            box += ["--tmpfs", str(path)]
        elif path.exists():
            box += ["--ro-bind", "/dev/null", str(path)]
    # The launcher and its Python must be there even when they live in a dir the sandbox replaces.
    for own in (LAUNCHER, Path(sys.base_prefix).resolve()):
        if any(_inside(own, d) for d in [*PRIVATE_DIRS, *hidden]):
            box += ["--ro-bind", str(own), str(own)]
    for writable in dict.fromkeys([home, workdir]):
        box += ["--bind", str(writable), str(writable)]
    for path in emptied:  # after the binds, which may need a mount point inside one
        box += ["--remount-ro", str(path)]
    box += ["--chdir", str(workdir), "--", *launcher]
    return Launch(host.bwrap, box, workdir, True, summary)

