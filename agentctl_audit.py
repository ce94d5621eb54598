"""agentctl's audit commands: the active grants (and revoking them), the audit log of every gate decision,
and checking that log's keyed chain. While the server runs they go through it (agentctl_remote)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from datetime import datetime
from pathlib import Path

from rich.markup import escape
from rich.table import Table

import agentctl_remote
import audit_log
import grants
from agentctl_base import CommandBase
from agentctl_files import FileProblem, InputError
from agentctl_term import ArgParser


class AuditCommands(CommandBase):
    """grants, audit, audit-verify, audit-head."""

    def _audit_file(self) -> Path:
        return self.files.app_config().data_dir() / grants.AUDIT_FILE

    def cmd_grants(self, args: list[str]) -> None:
        """grants [revoke <id>|all]: the active grants of every session, or end them.

        Grants are answers to gates that reach beyond one call. While the server runs, both go through
        it (its shell endpoint): a revoke is in force at once and audited by the server.
        """
        self._args(args, self.cmd_grants, 0, 2)
        cfg = self.files.app_config()
        if args:
            if len(args) != 2 or args[0] != "revoke":
                raise InputError(f"usage: agentctl {self._usage(self.cmd_grants)}")
            ended, how = agentctl_remote.revoke(cfg, args[1])
            if not ended:
                raise InputError(f"no active grant '{args[1]}'; agentctl grants lists them")
            self.term.applied = how
            self.term.done(f"revoked {', '.join(ended)}")
            return
        active = agentctl_remote.active_grants(cfg)
        if self.term.json_output:
            self.term.json({"grants": [dataclasses.asdict(g) for g in active]})
            return
        now = time.time()
        for grant in active:
            self.term.say(f"{grant.session}: {grant.describe(now)}")
        if not active:
            self.term.say("No active grants.")

    def cmd_audit(self, args: list[str]) -> None:
        """audit [--since <ISO time|hours>] [--session <id>]: gate decisions, grants and revocations, oldest first.

        Also every use of a grant and every gate-policy change; each record is chained to the one before.
        """
        parser = ArgParser(prog="agentctl audit", add_help=False, allow_abbrev=False)
        parser.add_argument("--since")
        parser.add_argument("--session")
        opts = parser.parse_args(args)
        since = _since(opts.since) if opts.since else None
        records = list(audit_log.read_audit(self._audit_file(), since, opts.session)) \
            if self._audit_file().exists() else []
        if self.term.json_output:
            self.term.json({"records": records})
            return
        table = Table("#", "time", "event", "session", "who", "what", "outcome")
        for r in records:
            what = " ".join(filter(None, [r["tool"], r["op"], ",".join(r["tables"]), r["grant_id"]]))
            table.add_row(str(r["seq"]), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ts"])), r["event"],
                          *(escape(v) for v in (r["session"] or "", r["actor"] or "", what, audit_log.shown(r))))
        self.term.table(table)

    def cmd_audit_verify(self, args: list[str]) -> None:
        """audit-verify [--head VALUE] [--head-file PATH] [--log PATH]: check the audit log, its grants and its heads.

        Checks the keyed chain, the head file, the head in Redis (sessions there), every head passed or kept
        elsewhere (--head, --head-file: `agentctl audit-head` output; --log: the server's log, `-` for stdin;
        each may be repeated) and every grant row. Finds changed, deleted, inserted or reordered records, a
        chain recomputed without the key, a cut tail (also with the head file put back), an emptied or
        replaced file, a grant row that is not the server's (exit code 2, one line saying which).
        """
        parser = ArgParser(prog="agentctl audit-verify", add_help=False, allow_abbrev=False)
        parser.add_argument("--head", action="append", default=[])
        parser.add_argument("--head-file", action="append", default=[])
        parser.add_argument("--log", action="append", default=[])
        opts = parser.parse_args(args)
        sources = [audit_log.HeadSource(text, f"--head {i}" if len(opts.head) > 1 else "--head")
                   for i, text in enumerate(opts.head, 1)]
        sources += [audit_log.HeadSource(_read_text(name, "--head-file"), name) for name in opts.head_file]
        sources += [audit_log.HeadSource(_read_text(name, "--log"), "stdin" if name == "-" else name, required=False)
                    for name in opts.log]
        cfg = self.files.app_config()
        path = cfg.data_dir() / grants.AUDIT_FILE
        try:
            found = agentctl_remote.verify(cfg, sources)
        except grants.AuditError as exc:
            if self.term.json_output:
                self.term.json({"ok": False, "why": str(exc)})
            raise FileProblem(f"audit log {path}: {exc}") from None
        later = f", {found.after_checkpoint} after the last checkpoint" if found.after_checkpoint else ""
        unkeyed = f" (the first {found.unkeyed} written before the audit key)" if found.unkeyed else ""
        if self.term.json_output:
            self.term.json({"ok": True, "checked": found.head.count, "unkeyed": found.unkeyed,
                            "heads": found.heads})
        else:
            self.term.line(f"audit log {path}: {found.head.count} records{unkeyed}{later}, chain intact and "
                           f"matches its head; checked against: {', '.join(found.heads)}")

    def cmd_audit_head(self, args: list[str]) -> None:
        """audit-head: print the audit log's verified head as one line, for `audit-verify --head-file`.

        Keep it outside the data dir (e.g. `agentctl audit-head >> /var/backups/agent-mcp/audit-heads` on
        each start): a log cut and put back with an older head file no longer matches it.
        """
        self._args(args, self.cmd_audit_head, 0)
        cfg = self.files.app_config()
        path = cfg.data_dir() / grants.AUDIT_FILE
        try:
            sealed = agentctl_remote.current_head(cfg)
        except grants.AuditError as exc:
            raise FileProblem(f"audit log {path}: {exc}; no head printed") from None
        if self.term.json_output:
            self.term.json(json.loads(sealed))
        else:
            self.term.line(f"{grants.audit_chain.HEAD_LINE}{sealed}")


def _read_text(name: str, option: str) -> str:
    """A file of heads (`-`: stdin); InputError saying how when it cannot be read."""
    if name == "-":
        return sys.stdin.read()
    try:
        return Path(name).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise InputError(f"{option} {name}: cannot be read ({exc.strerror}): give a file of head lines "
                         "(agentctl audit-head output, or the server's log)") from None


def _since(text: str) -> float:
    """`--since`: an ISO date/time, or a number of hours ago."""
    try:
        return time.time() - float(text) * 3600
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise InputError(f"--since {text!r}: give an ISO date/time (2026-11-25T08:00) or hours ago (24)") from None
