"""The house rules, from every import statement (module level or inside a function): the apps (gateway,
draft_worker, verify_worker, telemetry) never import one another, the core (services/) imports an app
only in the CLI, inside the command that runs it, and the gateway's rooms import only rooms below them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APPS = ("gateway", "draft_worker", "verify_worker", "telemetry")


# gateway/__init__.py's list, from the door inwards: a room imports only rooms after it (and the modules beside
# the rooms: state, errors, schemas)
GATEWAY_ROOMS = ("api", "sessions", "admission", "streams", "fleet", "observability")


def imported(path: Path, depth: int = 1) -> list[tuple[int, str]]:
    """(line, the first `depth` parts of the module) of every absolute import in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, ".".join(alias.name.split(".")[:depth])) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, ".".join(node.module.split(".")[:depth])))
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


def test_the_gateway_rooms_import_only_rooms_below_them():
    rooms = sorted(path.name for path in (ROOT / "gateway").iterdir() if (path / "__init__.py").is_file())
    assert rooms == sorted(GATEWAY_ROOMS)  # a new room takes its place in the list (and in gateway/__init__.py)
    upward = [f"{path.relative_to(ROOT)}:{line} imports {module}"
              for index, room in enumerate(GATEWAY_ROOMS)
              for path in sorted((ROOT / "gateway" / room).rglob("*.py"))
              for line, module in imported(path, depth=2)
              if module.startswith("gateway.") and module.split(".")[1] in GATEWAY_ROOMS[:index + 1]
              and module != f"gateway.{room}"]
    assert upward == []


def test_only_the_application_imports_the_http_surface():
    users = {str(path.relative_to(ROOT)) for path in sorted((ROOT / "gateway").rglob("*.py"))
             if any(module == "gateway.api" for _, module in imported(path, depth=2))
             and not path.is_relative_to(ROOT / "gateway" / "api")}
    assert users == {"gateway/app.py"}
