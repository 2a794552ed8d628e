"""No Docker engine runs here: check the compose file against the CLI instead."""

from pathlib import Path

import yaml
from typer.main import get_command

from services.cli import app

COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml"


def load() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_every_service_has_a_healthcheck_or_waits_for_health():
    services = load()["services"]
    assert {"redis", "postgres", "gateway", "draft-worker", "verify-worker", "telemetry", "flower"} <= set(services)
    for name, service in services.items():
        if name != "flower":
            assert "healthcheck" in service, name
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert condition == {"condition": "service_healthy"}, (name, dependency)
            assert "healthcheck" in services[dependency]


def test_commands_are_real_cli_commands_with_real_options():
    cli = get_command(app)
    for name, service in load()["services"].items():
        command = service.get("command", [])
        if command[:1] != ["mirror-sd"]:
            continue
        subcommand = cli.commands[command[1]]
        if hasattr(subcommand, "commands"):  # a group: `mirror-sd telemetry run`
            subcommand = subcommand.commands[command[2]]
            command = command[1:]
        known = {opt for param in subcommand.params for opt in getattr(param, "opts", [])}
        flags = [part for part in command[2:] if part.startswith("--")]
        assert set(flags) <= known, (name, set(flags) - known)


def test_verify_worker_reserves_a_gpu_and_cpu_profile_exists():
    services = load()["services"]
    devices = services["verify-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["verify-worker-cpu"]["profiles"] == ["cpu"]


def test_required_secret_is_required():
    text = COMPOSE.read_text()
    assert "${POSTGRES_PASSWORD:?" in text
    assert "MIRROR_SD_ENVIRONMENT: production" in text  # production refuses auth_disabled
