"""The core modules import each other in one direction only (issue 16, item 3).

The project's own import graph is read from the source: top-level imports, and imports under
`if TYPE_CHECKING:` too (a module typed with a module above it is a layer upside down, even when
only the type checker follows the import; issue 30). It must have no cycle, and no core module may
import a sibling core module inside a function to get around one. Each module must also import
alone in a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.source import parse

#: The core modules, lowest layer first (docs/architecture.md's "Modules, lowest first" table): each may import
#: only modules before it.
CORE = ("decisions", "config", "secret_files", "audit_chain", "sql", "sql_shape", "guard", "failures", "metrics",
        "tracing", "chat_openai", "text_calls", "prompt", "registry", "stores", "sessions", "turns", "events",
        "shared_link", "shared_store", "shared_events", "shared_gates", "shared_values", "grants", "audit_log",
        "approvals", "budget", "client_classes", "gate_policy", "gate", "rate_limits", "llm_errors", "models",
        "tool_calls", "agents", "state", "gate_commands", "plugin_checks", "api_client", "tools", "db_roles",
        "db_runners", "db_results", "database", "routes", "plugin_scope", "plugin_api", "plugin_loader", "commands",
        "build")
#: What a plugin (plugins/*.py) may import of the core: the plugin surface, and the modules of vocabulary and file
#: formats that hold no runtime (decision words, approver and audit records, gate-policy changes, settings and
#: secret files, failure texts, listener settings, the database library and its results). Everything else of
#: the server a plugin reaches through its PluginContext.
PLUGIN_SURFACE = ("plugin_api",)
LIBRARIES = ("decisions", "config", "secret_files", "failures", "guard", "grants", "approvals", "audit_chain",
             "gate_policy", "database", "db_results")

def _imports(module: str) -> tuple[set[str], set[str], list[str]]:
    """(core modules imported at module level, those imported for type checkers only, under
    `if TYPE_CHECKING:`, and core modules imported inside functions)."""
    tree = parse((ROOT / f"{module}.py").read_text())
    top: set[str] = set()
    typing: set[str] = set()
    nested: list[str] = []

    def names(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name.split(".")[0] for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            return [node.module.split(".")[0]]
        return []

    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing.update(n for inner in ast.walk(node) for n in names(inner) if n in CORE)
            continue
        top.update(n for n in names(node) if n in CORE)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            nested += [n for inner in ast.walk(node) for n in names(inner) if n in CORE]
    return top - {module}, typing - top - {module}, nested


def test_the_core_import_graph_has_no_cycle_and_no_function_level_imports() -> None:
    found = {m: _imports(m) for m in CORE}
    graph = {m: top | typing for m, (top, typing, _) in found.items()}
    for module in CORE:
        assert found[module][2] == [], f"{module} imports a core module inside a function"
    order: list[str] = []
    visiting: list[str] = []

    def visit(module: str) -> None:
        if module in order:
            return
        assert module not in visiting, f"import cycle: {' → '.join([*visiting[visiting.index(module):], module])}"
        visiting.append(module)
        for dependency in sorted(graph[module]):
            visit(dependency)
        visiting.pop()
        order.append(module)

    for module in CORE:
        visit(module)
    # The lowest layers import nothing of ours, and every module only what lies below it.
    assert graph["decisions"] == graph["config"] == graph["sql"] == graph["guard"] == graph["failures"] == set()
    assert graph["stores"] == graph["tracing"] == set()
    assert graph["metrics"] <= {"decisions"}  # the gate decision words it labels: a module of constants
    for layer, module in enumerate(CORE):
        above = graph[module] - set(CORE[:layer])
        typed = " (for type annotations: the annotated code belongs above them, or takes less)" \
            if above <= found[module][1] else ""
        assert not above, f"{module} imports {', '.join(sorted(above))}, which lie above it in the layer order{typed}"


#: One fresh interpreter imports the libraries the core modules use, then forks a child per core module that
#: imports that module alone: what is tested is the project's own import order, at one interpreter's cost.
_ALONE = """
import importlib, json, os, sys, traceback
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass
results = {}
for module in sys.argv[1].split(","):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            code = 0
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        error = fh.read().decode()
    _, status = os.waitpid(pid, 0)
    results[module] = error or ("" if status == 0 else f"exit status {status}")
print(json.dumps(results))
"""


def _libraries() -> list[str]:
    """Every module outside the project that a core module imports at module level."""
    found: set[str] = set()
    for module in CORE:
        for node in parse((ROOT / f"{module}.py").read_text()).body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
    return sorted(n for n in found if n.split(".")[0] not in CORE)


@pytest.fixture(scope="module")
def imported_alone() -> dict[str, str]:
    """Core module → the error its import alone raised ("" when it imported)."""
    result = subprocess.run([sys.executable, "-c", _ALONE, ",".join(CORE), *_libraries()], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", CORE)
def test_each_core_module_imports_alone(module: str, imported_alone: dict[str, str]) -> None:
    assert imported_alone[module] == "", imported_alone[module]


def _all_imports(path: Path) -> set[str]:
    """Every top-level name `path` imports, at any depth (functions, TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in ast.walk(parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "plugins").glob("*.py")), ids=lambda p: p.name)
def test_a_plugin_imports_of_the_core_only_the_plugin_surface(path: Path) -> None:
    core = {p.stem for p in ROOT.glob("*.py")}
    outside = _all_imports(path) & core - set(PLUGIN_SURFACE) - set(LIBRARIES)
    assert not outside, (f"plugins/{path.name} imports {', '.join(sorted(outside))}: a plugin reaches the server "
                         "through plugin_api (its PluginContext, self.ctx) only")


def test_every_member_of_the_plugin_context_is_documented_in_writing_a_plugin() -> None:
    import plugin_api

    documented = (ROOT / "docs" / "plugins.md").read_text()
    context = [n for n in vars(plugin_api.PluginContext) if not n.startswith("_")]
    missing = [n for n in context if f"`{n}" not in documented]
    assert not missing, f"docs/plugins.md does not document PluginContext.{', '.join(missing)}"
