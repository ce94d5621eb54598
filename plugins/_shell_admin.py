"""The shell endpoint's admin route: agentctl's writes to what a running server owns, done by the server.

agentctl never writes a file a running server also writes (the audit log and grants, gate-defaults.json,
llm-models.json): it sends the change here (`POST /admin`, JSON, the endpoint's token, the guard's Host,
Origin and content-type checks), the server applies it at once, writes the file itself and audits it
with actor `agentctl`. A file to save is checked whole first: an invalid or unknown field (at any depth) is
refused, naming it, and nothing is written. One action per request; the answer is JSON, an error is `{"error": "..."}`.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

import plugin_api
from audit_chain import AuditRecord
from config import (
    GATE_DEFAULTS_FILE,
    MODELS_FILE,
    ConfigError,
    GateDefaults,
    ModelsFile,
    atomic_write,
    config_problems,
    field_problems,
    read_json,
    validate_data,
)

ACTOR = "agentctl"
logger = logging.getLogger("agent_mcp.shellpy")


class AdminBody(BaseModel):
    """`POST /admin`: `revoke` (a grant id or `all`), `grants` (list them) or `save` (a whole owned file)."""

    action: Literal["revoke", "grants", "save"]
    which: str = Field(default="", max_length=128)
    file: Literal["", "gate-defaults.json", "llm-models.json"] = ""
    data: dict[str, Any] = {}


class AdminError(Exception):
    """An admin request that cannot be done; the message says why and what to do (HTTP 400)."""


async def handle(rt: plugin_api.PluginContext, body: AdminBody) -> dict[str, Any]:
    """Do one admin action; AdminError for one that cannot be done."""
    store = rt.gate.grants
    if body.action in ("revoke", "grants") and store is None:
        raise AdminError("this server keeps no grants")
    if body.action in ("revoke", "grants"):
        assert store is not None
        await store.refresh_all()  # with several instances: grants given on the others too
    if body.action == "grants":
        assert store is not None
        return {"grants": [{**g.__dict__, "keys": list(g.keys)} for s in list(store.grants) for g in store.active(s)]}
    if body.action == "revoke":
        assert store is not None
        return {"revoked": await _revoke(store, body.which)}
    if body.file == GATE_DEFAULTS_FILE:
        return _save_gates(rt, body.data)
    if body.file == MODELS_FILE:
        return await _save_models(rt, body.data)
    raise AdminError("save needs file: gate-defaults.json or llm-models.json")


async def _revoke(store: Any, which: str) -> list[str]:
    if not which:
        raise AdminError("revoke needs which: a grant id or all")
    sessions = list(store.grants) if which == "all" else [s for s in [await store.find_owner(which)] if s]
    ended = [g.id for s in sessions for g in store.revoke(s, which, ACTOR, detail="agentctl, through the server")]
    await store.flush()  # in the audit log before agentctl is told
    return ended


def unknown_fields(obj: Any, prefix: str = "") -> list[str]:
    """The fields of a loaded config file its schema does not know (dotted: `db.users.wirte`), at any depth;
    `metadata` is free-form where it appears."""
    found: list[str] = []
    if isinstance(obj, BaseModel):
        found += [f"{prefix}{key}" for key in obj.model_extra or {} if key != "metadata"]
        for name in type(obj).model_fields:
            found += unknown_fields(getattr(obj, name), f"{prefix}{name}.")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            found += unknown_fields(value, f"{prefix}{key}.")
    return found


def _validated(model: type[BaseModel], data: dict[str, Any], target: Any) -> Any:
    """The whole file as `model` (AdminError naming every invalid or unknown field: nothing is written)."""
    try:  # (not validate_data: it reports unknown fields as ignored, and here they are refused)
        obj = model.model_validate(data)
    except ValidationError as exc:
        lines = field_problems(exc, "(top level)", "  field '{where}': {msg}", "\n")
        raise AdminError(f"{target}: invalid configuration\n{lines}\nnothing was changed") from None
    if unknown := unknown_fields(obj):
        fields = ", ".join(f"'{f[:80]}'" for f in unknown[:20]) + (f" and {len(unknown) - 20} more" if len(unknown) > 20
                                                                    else "")
        raise AdminError(f"{target}: unknown field{'s' if len(unknown) > 1 else ''} {fields}: remove "
                         f"{'them' if len(unknown) > 1 else 'it'} (or fix the spelling); nothing was changed")
    return obj


def _save_gates(rt: plugin_api.PluginContext, data: dict[str, Any]) -> dict[str, Any]:
    target = rt.config.config_dir / GATE_DEFAULTS_FILE
    new = _validated(GateDefaults, data, target)
    try:  # the keeper saves, puts in force and audits every changed permission
        path = rt.gate.replace_policy(new, ACTOR)
    except (ConfigError, OSError) as exc:
        raise AdminError(f"{target}: cannot write ({exc}); nothing was changed") from None
    rt.config.gates = new
    logger.info("gate defaults replaced by agentctl (saved in %s)", path)
    return {"saved": str(path), "note": "in force at once for every session"}


async def _save_models(rt: plugin_api.PluginContext, data: dict[str, Any]) -> dict[str, Any]:
    target = rt.config.config_dir / MODELS_FILE
    models = _validated(ModelsFile, data, target).models
    enabled = {k: m for k, m in models.items() if m.enabled}
    if problems := config_problems(rt.config.config_dir, enabled, rt.config.enabled):
        raise AdminError(f"refused: the server would not start with this change: {problems[0]}")
    try:
        atomic_write(target, json.dumps(data, indent=2, ensure_ascii=False) + "\n",
                     check=lambda tmp: validate_data(ModelsFile, read_json(tmp), target))
    except (ConfigError, OSError) as exc:
        raise AdminError(f"{target}: cannot write ({exc}); nothing was changed") from None
    changed = [k for k, m in enabled.items() if k in rt.config.models and rt.config.models[k] != m]
    for key in changed:
        rt.config.models[key] = enabled[key]
    await rt.close_models(changed)  # rebuilt with the new settings at their next call
    later = sorted(set(enabled) ^ set(rt.config.models))
    rt.gate.audit(AuditRecord.config(ACTOR, MODELS_FILE, "saved", f"changed now: {', '.join(changed) or 'none'}; "
                                                                   f"at the next start: {', '.join(later) or 'none'}"))
    logger.info("%s replaced by agentctl: %d model(s) changed at once", target, len(changed))
    note = "in force at once" if not later else f"enabling/disabling/adding {', '.join(later)} takes a restart"
    return {"saved": str(target), "note": note}

