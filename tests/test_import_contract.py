"""The import contract, read from the source (every import statement, top-level or inside a function):
the core package ``tandem`` never imports a service (verifier, drafter, gateway), and services never
import each other. ``import tandem`` stays torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
