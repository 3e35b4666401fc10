"""The import contract, read from the source (every import statement, top-level or inside a function):
the core package ``tandem`` never imports a service (verifier, drafter, gateway), and services never
import each other; module by module, imports run down the layers (runtime ← engine and draft ← the
shared flags ← services ← the app) and never in a circle. ``import tandem`` stays torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("verifier", "drafter", "gateway")


def _imports(path: Path) -> set[str]:
    """Top-level package names that ``path`` imports (absolute imports only; relative ones stay inside)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _violations(package: str, forbidden: set[str]) -> list[str]:
    return [f"{path.relative_to(ROOT)} imports {name}"
            for path in sorted((ROOT / package).rglob("*.py"))
            for name in sorted(_imports(path) & forbidden)]


def test_the_core_imports_no_service():
    assert _violations("tandem", set(SERVICES)) == []


def test_services_do_not_import_each_other():
    for service in SERVICES:
        assert _violations(service, set(SERVICES) - {service}) == [], service


def test_the_contract_check_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from drafter.reload import run\n    import gateway.config\n")
    assert _imports(source) == {"drafter", "gateway"}


def test_importing_tandem_does_not_import_torch():
    code = "import sys, tandem, tandem.reload_client, tandem.tokenizer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# ------------------------------------------------------------------ layers, module by module
# From the bottom. A module is in the layer of its longest matching prefix; tandem's others are runtime
# (models, layers, kernels, attention, KV cache, sampling, rings, graph capture, ...). Imports under
# ``if TYPE_CHECKING:`` are annotations only and do not count.
LAYERS = {
    "engine and draft": ("tandem.engine", "tandem.speculative"),
    "flags": ("tandem.args", "tandem.speculative_flags"),  # the argument definitions every CLI shares (defaults from the engine's config)
    "services": SERVICES,
    "app": ("tandem.cli", "tandem.launcher", "tandem.supervision", "tandem.training", "tandem.reload_client",
            "verifier.__main__", "drafter.__main__", "gateway.__main__", "drafter.train"),  # entry points
}
ORDER = ["runtime", *LAYERS]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    matches = [(len(p), name) for name, prefixes in LAYERS.items() for p in prefixes
               if module == p or module.startswith(p + ".")]
    return max(matches)[1] if matches else "runtime"


def _module_graph() -> dict[str, set[str]]:
    """Every product module (generated stubs aside) → the product modules it imports."""
    files = {_module(p): p for top in ("tandem", *SERVICES) for p in (ROOT / top).rglob("*.py")
             if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        annotations = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                       for stmt in node.body for n in ast.walk(stmt)}
        targets = set()
        for node in ast.walk(tree):
            if id(node) in annotations:
                continue
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {known(f"{node.module}.{a.name}") or known(node.module) for a in node.names}
        graph[module] = targets - {None, module}
    return graph


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({_layer(m)}) imports {t} ({_layer(t)})" for m, targets in sorted(graph.items())
            for t in sorted(targets) if ORDER.index(_layer(t)) > ORDER.index(_layer(m))]


def test_imports_run_down_the_layers():
    graph = _module_graph()
    assert _upward(graph) == []
    assert len(graph) > 150 and _layer("tandem.kernels.gemv") == "runtime" and _layer("verifier.__main__") == "app"


def test_no_module_imports_itself_through_others():
    graph, seen, done, circles = _module_graph(), [], set(), []

    def visit(module: str) -> None:  # depth-first; a module met again on the current path closes a circle
        if module in seen:
            circles.append(seen[seen.index(module):] + [module])
            return
        if module in done:
            return
        seen.append(module)
        for target in sorted(graph[module]):
            visit(target)
        seen.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert circles == []


def test_the_layer_check_sees_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    (tmp_path / "tandem" / "kernels").mkdir(parents=True)
    (tmp_path / "tandem" / "engine").mkdir()
    for top in SERVICES:
        (tmp_path / top).mkdir()
    (tmp_path / "tandem" / "kernels" / "k.py").write_text("from tandem.engine.e import x\n")
    (tmp_path / "tandem" / "engine" / "e.py").write_text("def f():\n    import tandem.kernels.k\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = _module_graph()
    assert graph == {"tandem.kernels.k": {"tandem.engine.e"}, "tandem.engine.e": {"tandem.kernels.k"}}
    assert _upward(graph) == ["tandem.kernels.k (runtime) imports tandem.engine.e (engine and draft)"]
    with pytest.raises(AssertionError):
        test_no_module_imports_itself_through_others()
