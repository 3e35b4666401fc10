"""The README's test command is what CI runs (.ci/run), so the two must not drift apart."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    ci_command = [l for l in (ROOT / ".ci/run").read_text().splitlines() if l.startswith("pip install")]
    assert len(ci_command) == 1
    assert ci_command[0] in (ROOT / "README.md").read_text()


def test_importing_tandem_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, tandem, tandem.cli, tandem.configs.model, tandem.tokenizer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
