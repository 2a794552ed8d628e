"""The compose stack as a real Compose implementation resolves it, and its Dockerfile.

No Docker engine runs here, so nothing is built or started: `docker-compose config` (Debian's package, which
`make test` installs when missing: its target test-tools) parses the file the way `up` would (anchors, merges,
${VAR:?} checks) and prints the result, and the tests assert on that result, not on the text we wrote.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import tomllib
from functools import lru_cache
from pathlib import Path

import yaml
from typer.main import get_command

from services.cli import app
from services.protocol import ROUTING_TABLE_KEY, heartbeat_key
from services.redis_url import check_redis_url, parse_sentinel_url

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
SENTINEL = ROOT / "compose" / "sentinel.yml"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
MIRROR_SERVICES = ("gateway", "draft-worker", "verify-worker-gpu", "verify-worker-cpu", "telemetry")


def compose_config(*extra: Path, **env: str) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is missing: `make test-tools` installs it (Debian's package; `make test` runs it)"
    # A clean environment: a MIRROR_SD_* or COMPOSE_* variable of the shell running the tests must not change
    # what the file resolves to.
    files = [arg for path in (COMPOSE, *extra) for arg in ("-f", str(path))]
    return subprocess.run([binary, *files, "config"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", **env})


@lru_cache(maxsize=1)
def resolved_file() -> dict:
    result = compose_config(POSTGRES_PASSWORD="s3cret")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def resolved() -> dict:
    return resolved_file()["services"]


def named_volumes() -> set[str]:
    return set(resolved_file().get("volumes") or {})


def pool_of(service: dict) -> str:
    """The pool a mirror-sd service runs in: its --pool flag, else MIRROR_SD_WORKER__POOL (the flag wins)."""
    command = service["command"]
    if "--pool" in command:
        return command[command.index("--pool") + 1]
    return service["environment"]["MIRROR_SD_WORKER__POOL"]


def test_the_stack_has_every_service_with_health_and_grace():
    services = resolved()
    assert set(services) == {"redis", "postgres", "flower", *MIRROR_SERVICES}
    for name, service in services.items():
        assert service["healthcheck"]["test"], name
        assert "stop_grace_period" in service, name
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition == {"condition": "service_healthy"}, (name, dependency)
            assert "healthcheck" in services[dependency], (name, dependency)
    for name in MIRROR_SERVICES:
        env = services[name]["environment"]
        assert env["MIRROR_SD_DATABASE_URL"] == "postgresql://mirror:s3cret@postgres:5432/mirror", name
        assert env["MIRROR_SD_ENVIRONMENT"] == "production", name  # production refuses auth_disabled
        assert env["MIRROR_SD_LOG_FORMAT"] == "json", name
        assert env["MIRROR_SD_DRAFT"] == "auto", name


def test_gpu_worker_gets_the_gpu_image_and_a_gpu_in_pool_gpu():
    gpu = resolved()["verify-worker-gpu"]
    assert pool_of(gpu) == "gpu"
    assert gpu["environment"]["MIRROR_SD_DEVICE"] == "cuda"
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["image"] == "mirror-sd-gpu:latest"
    assert "/whl/cu12" in gpu["build"]["args"]["TORCH_INDEX"]  # CUDA torch, not the Dockerfile's CPU default
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("nvidia-ml-py") for dep in extras[gpu["build"]["args"]["EXTRAS"]])


def test_cpu_worker_is_the_fallback_pool_the_telemetry_service_uses():
    services = resolved()
    cpu = services["verify-worker-cpu"]
    assert pool_of(cpu) == "cpu"
    assert cpu["image"] == "mirror-sd:latest" and "deploy" not in cpu and "profiles" not in cpu
    assert "MIRROR_SD_DEVICE" not in cpu["environment"]  # settings' default: cpu
    assert services["telemetry"]["environment"]["MIRROR_SD_TELEMETRY__FALLBACK_POOL"] == pool_of(cpu)
    assert pool_of(services["verify-worker-gpu"]) != pool_of(cpu)  # else the thermal rule has nowhere to go


def test_sessions_of_both_verify_pools_reach_a_draft_worker():
    """The gateway sends every session to draft.<its own worker.pool> (gateway/sessions/submit.py) and requires a draft
    worker heartbeating in that pool, whichever verify pool routing chose: one draft pool serves both."""
    services = resolved()
    assert pool_of(services["draft-worker"]) == pool_of(services["gateway"]) == "cpu"
    command = services["draft-worker"]["healthcheck"]["test"][1]
    assert f"draft-{pool_of(services['draft-worker'])}@" in command  # the Celery hostname the CLI gives it


def test_redis_keeps_an_append_only_file_in_a_volume_and_flower_watches_it():
    services = resolved()
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    # docker-compose v1 prints the short form (`name:/data:rw`), v2 the long one
    mounts = [(v["source"], v["target"]) if isinstance(v, dict) else tuple(v.split(":")[:2]) for v in redis["volumes"]]
    assert any(target == "/data" and source in named_volumes() for source, target in mounts), mounts
    broker = services["gateway"]["environment"]["MIRROR_SD_REDIS_URL"]
    assert broker.startswith("redis://redis:")
    assert services["flower"]["environment"]["CELERY_BROKER_URL"] == broker
    assert all(services[name]["environment"]["MIRROR_SD_REDIS_URL"] == broker for name in MIRROR_SERVICES)


def test_healthchecks_read_the_keys_the_services_write():
    services = resolved()
    for name in ("verify-worker-gpu", "verify-worker-cpu"):
        worker_id = services[name]["environment"]["MIRROR_SD_WORKER__WORKER_ID"]
        assert worker_id == f"verify-{pool_of(services[name])}-0"
        test = services[name]["healthcheck"]["test"][1].replace("$$", "$")  # compose's escape, printed or not
        assert f"python -m services.redis_conn has-key {heartbeat_key('')}$MIRROR_SD_WORKER__WORKER_ID" == test, test
    assert services["telemetry"]["healthcheck"]["test"][-2:] == ["has-key", ROUTING_TABLE_KEY]


def test_config_fails_clearly_without_the_postgres_password():
    result = compose_config()
    assert result.returncode != 0
    assert "set POSTGRES_PASSWORD" in result.stderr, result.stderr


def test_commands_are_real_cli_commands_with_real_options():
    cli = get_command(app)
    for name, service in resolved().items():
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


def _stages() -> dict[str, str]:
    """Dockerfile text per build stage (FROM ... AS name)."""
    stages, name = {}, None
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("FROM "):
            name = line.split(" AS ")[-1].strip()
            stages[name] = ""
        elif name is not None and not line.lstrip().startswith("#"):
            stages[name] += line + "\n"
    return stages


def test_dockerfile_builds_llama_cpp_portably_and_ships_no_compiler():
    stages = _stages()
    builder, runtime = stages["llama-builder"], stages["runtime"]
    # the flags `make install` builds with (no -march=native, no AMX): the image runs on any AVX2 host
    assert "COPY services/models/llamacpp_build.py /build/llamacpp_build.py" in builder
    assert "ARG LLAMACPP_FLAGS=portable" in builder
    assert 'RUN python /build/llamacpp_build.py --cache-dir /build/cache --flags "${LLAMACPP_FLAGS}" ' \
           "--copy-to /wheels" in builder
    assert "cmake" in builder and "g++" in builder
    assert "cmake" not in runtime and "g++" not in runtime
    assert "COPY --from=llama-builder /wheels" in runtime
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in runtime
    assert "mirror-sd llamacpp check" in runtime  # the smoke check runs where the image is built


def test_the_builder_script_runs_on_the_standard_library_alone():
    """The builder stage has python, cmake and g++ and nothing of this project: the script must import nothing
    else (checked in a fresh interpreter that has only the standard library's path)."""
    import subprocess
    import sys

    script = ROOT / "services" / "models" / "llamacpp_build.py"
    done = subprocess.run([sys.executable, "-S", "-I", str(script), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--cache-dir" in done.stdout and "--copy-to" in done.stdout


def test_image_carries_the_dev_prompts_where_the_bench_default_looks():
    """services/bench/prompts.py finds data/ two folders above services/bench/: the image installs editable from
    /app, so /app/data must be there (a plain `pip install .` would look beside site-packages)."""
    runtime = _stages()["runtime"]
    assert "WORKDIR /app" in runtime and "COPY data ./data" in runtime and "COPY docs ./docs" in runtime
    assert 'pip install -e "' in runtime
    from services.bench.prompts import DEV_PROMPTS_PATH

    assert DEV_PROMPTS_PATH.relative_to(ROOT) == Path("data/dev_prompts.jsonl")


def grace_seconds(service: dict) -> float:
    text = str(service["stop_grace_period"])
    return float(text[:-1]) * {"s": 1, "m": 60}[text[-1]]


def test_the_gateway_drains_within_its_stop_grace_period():
    gateway = resolved()["gateway"]
    drain = float(gateway["environment"]["MIRROR_SD_GATEWAY__DRAIN_TIMEOUT_S"])
    assert 0 < drain < grace_seconds(gateway)


@lru_cache(maxsize=1)
def resolved_with_sentinel() -> dict:
    result = compose_config(SENTINEL, POSTGRES_PASSWORD="s3cret")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def sentinel_conf(service: dict) -> list[str]:
    """The lines a sentinel container writes to its config file (its `printf '%s\\n' 'line' ...`)."""
    script = service["command"][-1]
    return shlex.split(script.split(">", 1)[0])[2:]


def test_with_sentinel_every_service_finds_the_primary_through_three_sentinels():
    services = resolved_with_sentinel()
    urls = {services[name]["environment"]["MIRROR_SD_REDIS_URL"] for name in MIRROR_SERVICES}
    assert len(urls) == 1
    target = parse_sentinel_url(check_redis_url(urls.pop()))
    assert [host for host, _ in target.sentinels] == ["sentinel-1", "sentinel-2", "sentinel-3"]
    for host, port in target.sentinels:
        conf = sentinel_conf(services[host])
        assert f"port {port}" in conf
        # each watches the primary under the URL's master name, a majority of the three to act
        assert f"sentinel monitor {target.master} redis 6379 2" in conf
        assert "sentinel resolve-hostnames yes" in conf and services[host]["command"][-1].endswith("--sentinel")
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1:replica.index("--replicaof") + 3] == ["redis", "6379"]
    assert services["redis"]["command"][services["redis"]["command"].index("--replica-announce-ip") + 1] == "redis"


def test_with_sentinel_healthchecks_read_any_redis_url():
    services = resolved_with_sentinel()
    assert services["verify-worker-cpu"]["healthcheck"]["test"][1].startswith("python -m services.redis_conn")
    assert services["telemetry"]["healthcheck"]["test"][1:4] == ["python", "-m", "services.redis_conn"]
