"""config.py: typed loading, errors that name the file and the field, disabled models absent."""

import json
from pathlib import Path

import pytest

import config
from config import ConfigError, load_config


def write(d: Path, name: str, data) -> Path:
    p = d / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


MODELS = {"models": {
    "a": {"model_id": "m-a", "type": "OPENAI", "host": "http://127.0.0.1:1/v1", "env_key": None},
    "off": {"model_id": "m-off", "type": "GEMINI", "env_key": "X", "enabled": False},
}}


@pytest.fixture
def cdir(tmp_path):
    write(tmp_path, "llm-models.json", MODELS)
    write(tmp_path, "plugins-enabled.json", {"default_model": "a", "enabled_plugins": []})
    return tmp_path


def test_shipped_config_loads_with_every_spec_model_and_plugin():
    cfg = load_config()
    types = {m.type for m in cfg.models.values()}
    assert types == {"OPENAI", "GEMINI"}
    hosts = " ".join(m.host or "" for m in cfg.models.values())
    assert "api.openai.com" in hosts and "api.x.ai" in hosts and "127.0.0.1" in hosts
    assert set(cfg.manifest.plugins) >= {
        "plugin_client_shellpy", "plugin_client_api", "plugin_proxy_llama", "plugin_client_slack",
        "plugin_database_mysql", "plugin_storage_googledrive", "plugin_search_google", "plugin_search_ddgs",
        "plugin_search_tavily", "plugin_search_xai", "plugin_urlextract_tavily",
    }
    assert cfg.enabled.rate_limits["llm_call"].auto_disable is True


def test_disabled_models_are_absent_and_defaults_filled(cdir):
    cfg = load_config(cdir)
    assert list(cfg.models) == ["a"]
    m = cfg.models["a"]
    assert (m.max_context, m.tool_call_available, m.llm_call_timeout, m.llm_tools) == (50, False, 60, "all")
    # The manifest was not in cdir: the shipped one is used.
    assert "plugin_client_shellpy" in cfg.manifest.plugins


def test_not_json_names_file_and_position(cdir):
    write(cdir, "llm-models.json", '{"models": {')
    with pytest.raises(ConfigError, match=r"llm-models\.json: not valid JSON \(line 1"):
        load_config(cdir)


@pytest.mark.parametrize(("entry", "field"), [
    ({"model_id": "x", "type": "CLAUDE"}, "models.a.type"),
    ({"model_id": "x", "type": "OPENAI", "max_context": "lots"}, "models.a.max_context"),
    ({"model_id": "x", "type": "OPENAI", "host": "ftp://h"}, "models.a.host"),
    ({"type": "OPENAI"}, "models.a.model_id"),
    ({"model_id": "x", "type": "OPENAI", "llm_tools": 3}, "models.a.llm_tools"),
])
def test_bad_model_field_is_named(cdir, entry, field):
    write(cdir, "llm-models.json", {"models": {"a": entry}})
    with pytest.raises(ConfigError) as err:
        load_config(cdir)
    assert "llm-models.json" in str(err.value) and f"field '{field}" in str(err.value)


def test_bad_enabled_and_manifest_fields_are_named(cdir):
    write(
        cdir, "plugins-enabled.json", {"default_model": "a", "rate_limits": {"db": {"calls": -1, "window_seconds": 1}}}
    )
    with pytest.raises(ConfigError, match=r"plugins-enabled\.json[\s\S]*field 'rate_limits\.db\.calls'"):
        load_config(cdir)
    write(cdir, "plugins-enabled.json", {"default_model": "a"})
    write(cdir, "plugin-manifest.json", {"plugins": {"p": {"type": "gadget", "file": "p.py"}}})
    with pytest.raises(ConfigError, match=r"plugin-manifest\.json[\s\S]*field 'plugins\.p\.type'"):
        load_config(cdir)


def test_default_model_must_be_enabled(cdir):
    write(cdir, "plugins-enabled.json", {"default_model": "off"})
    with pytest.raises(ConfigError, match=r"field 'default_model': 'off' is not an enabled model"):
        load_config(cdir)


def test_unknown_fields_are_kept_and_warned(cdir, caplog):
    write(cdir, "llm-models.json", {"models": {"a": {"model_id": "x", "type": "OPENAI", "temprature": 1}}})
    cfg = load_config(cdir)
    assert cfg.models["a"].model_extra == {"temprature": 1}
    assert "unknown field 'models.a.temprature'" in caplog.text


def test_env_file_under_process_environment(cdir, monkeypatch):
    write(cdir, ".env", "FROM_FILE=1\nBOTH=file\n")
    monkeypatch.setenv("BOTH", "process")
    env = load_config(cdir).env
    assert env["FROM_FILE"] == "1" and env["BOTH"] == "process"


def test_api_key_resolution():
    m = config.ModelConfig(model_id="x", type="OPENAI", env_key="K")
    assert config.resolve_api_key(m, {"K": "secret"}) == "secret"
    assert config.resolve_api_key(m, {}) is None
    keyless = config.ModelConfig(model_id="x", type="OPENAI", env_key=None)
    assert config.resolve_api_key(keyless, {}) == "no-key-required"


def test_gate_defaults_are_loaded_and_validated(cdir):
    assert load_config(cdir).gates.tools["*"].read is False  # the shipped file: everything gated
    (cdir / "gate-defaults.json").write_text(
        '{"db": {"users": {"read": true}}, "tools": {"ddgs_search": {"read": true}}}'
    )
    gates = load_config(cdir).gates
    assert gates.db["users"].read and not gates.db["users"].write and gates.tools["ddgs_search"].read
    (cdir / "gate-defaults.json").write_text('{"tools": {"x": {"read": "maybe"}}}')
    with pytest.raises(ConfigError, match=r"(?s)gate-defaults.json.*tools\.x\.read"):
        load_config(cdir)


def test_atomic_write_keeps_the_old_file_when_the_check_fails(tmp_path):
    target = write(tmp_path, "f.json", '{"old": true}')
    target.chmod(0o640)

    def reject(tmp: Path) -> None:
        assert json.loads(tmp.read_text()) == {"new": True}
        raise ConfigError("no")

    with pytest.raises(ConfigError):
        config.atomic_write(target, '{"new": true}', reject)
    assert target.read_text() == '{"old": true}' and [p.name for p in tmp_path.iterdir()] == ["f.json"]
    config.atomic_write(target, '{"new": true}')
    assert target.read_text() == '{"new": true}' and target.stat().st_mode & 0o777 == 0o640
