"""The CLI builds its whole command tree without importing any app: each command imports what it runs.

So the core does not depend on the apps, and `mirror-sd --help` (or a command's bad flag) answers
without loading FastAPI, Celery workers or a model. Checked in a fresh interpreter, where nothing
else has imported them first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

APPS = ("gateway", "draft_worker", "verify_worker", "telemetry")

PROBE = """
import json, sys
from typer.main import get_command
import services.cli
tree = get_command(services.cli.app)
names = sorted(tree.commands) + sorted(f"{group} {name}" for group, command in tree.commands.items()
                                       for name in getattr(command, "commands", {}))
loaded = sorted({name.split(".")[0] for name in sys.modules} & set(sys.argv[1:]))
print(json.dumps({"loaded": loaded, "commands": names}))
"""


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    """Run this interpreter on this checkout's code (not whatever an installed copy points at)."""
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def _python(*args: str) -> str:
    done = _run(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _probe() -> dict:
    return json.loads(_python("-c", PROBE, *APPS, "torch"))


def test_importing_the_cli_imports_no_app():
    probe = _probe()
    assert not set(probe["loaded"]) & set(APPS), probe["loaded"]
    assert "torch" not in probe["loaded"]  # model commands import torch themselves, when they run


def test_every_command_is_still_there():
    expected = {"generate", "bench", "distill", "verify-worker", "draft-worker", "up", "status", "gateway",
                "models", "telemetry", "keys", "models list", "models prepare", "models profile",
                "models step-profile", "telemetry run", "telemetry inject", "telemetry drill",
                "keys create", "keys list", "keys revoke", "drill", "drill chaos", "drill burst",
                "llamacpp", "llamacpp build", "llamacpp check", "llamacpp info", "link"}
    assert set(_probe()["commands"]) == expected


def test_python_dash_m_runs_the_cli():  # `mirror-sd up` starts its children this way
    usage = _python("-m", "services.cli", "--help")
    assert "verify-worker" in usage and "telemetry" in usage


@pytest.mark.parametrize("variable, value, named", [
    ("MIRROR_SD_REDIS_URL", "", "redis_url (MIRROR_SD_REDIS_URL)"),
    ("MIRROR_SD_SCHEDULER__MAX_BATCH_SIZE", "many", "scheduler.max_batch_size (MIRROR_SD_SCHEDULER__MAX_BATCH_SIZE)"),
])
def test_a_bad_setting_is_one_line_naming_its_variable(variable, value, named):
    done = _run("-m", "services.cli", "status", **{variable: value})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("Error: invalid settings: ") and named in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


# The modules of processes that run no model: importing them loads neither torch nor transformers. (The gateway's
# tokenizer loads transformers' tokenizer module, still without torch: tests/unit/test_tokenizer_loading.py.)
LIGHT = ("gateway.app", "telemetry.main", "services.cli.status", "services.cli.drill", "services.synthetic",
         "services.models.random_spec", "services.models.synthetic_spec", "services.protocol")


@pytest.mark.parametrize("module", LIGHT)
def test_a_process_that_runs_no_model_imports_no_torch(module):
    loaded = _python("-c", f"import sys, {module}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))")
    assert loaded.strip() == "[]", f"{module} imports {loaded.strip()}"


def test_status_without_redis_is_one_line_and_loads_no_model_code():
    """`mirror-sd status` (an operator's first command) on a Redis nobody runs: one line naming it, exit 1, no
    traceback; and no torch or transformers (seconds to import) on the way."""
    done = _run("-c", "import sys, runpy; sys.argv = ['mirror-sd', 'status']\n"
                      "try:\n    runpy.run_module('services.cli', run_name='__main__')\n"
                      "except SystemExit as exc:\n    print('exit', exc.code)\n"
                      "print(sorted({'torch', 'transformers'} & set(sys.modules)))",
                MIRROR_SD_REDIS_URL="redis://:hunter2@127.0.0.1:1/0")
    assert done.stdout.splitlines() == ["exit 1", "[]"], done.stdout + done.stderr
    assert done.stderr.startswith("Error: cannot reach Redis at primary 127.0.0.1:1 ") and "MIRROR_SD_REDIS_URL" in \
        done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "hunter2" not in done.stderr, done.stderr
