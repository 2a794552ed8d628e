"""The house rules, from every import statement (module level or inside a function): the apps (gateway,
draft_worker, verify_worker, telemetry) never import one another, and the core (services/) imports an app
only in the CLI, inside the command that runs it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APPS = ("gateway", "draft_worker", "verify_worker", "telemetry")


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def crossings(folder: str, allowed: set[str]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {package}"
            for path in sorted((ROOT / folder).rglob("*.py"))
            for line, package in imported(path) if package in APPS and package not in allowed]


def test_no_app_imports_another():
    assert [crossing for app in APPS for crossing in crossings(app, {app})] == []


def test_the_core_imports_apps_only_in_the_cli():
    outside_cli = [crossing for crossing in crossings("services", set()) if not crossing.startswith("services/cli/")]
    assert outside_cli == []


def test_the_check_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\n\ndef f():\n    from telemetry.rules import evaluate\n    import gateway.app\n")
    assert imported(sample) == [(1, "os"), (4, "telemetry"), (5, "gateway")]
