"""`mirror-sd up --verify-pools/--accelerator-pools`: parsing, the fallback pool, and one-line CLI errors."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.pools import VerifyPool, fallback_pool, parse_verify_pools
from services.stack import pinned_cores, pool_commands


def test_parses_pools_in_order_with_declared_accelerators():
    pools = parse_verify_pools("accel=1, cpu=2", "accel")
    assert pools == [VerifyPool("accel", 1, True), VerifyPool("cpu", 2, False)]
    assert pools[1].worker_ids() == ["verify-cpu-0", "verify-cpu-1"]
    assert fallback_pool(pools, "cpu") == "cpu"
    # the configured fallback is kept only when it is a plain pool of this stack
    assert fallback_pool([VerifyPool("a100", 1, True), VerifyPool("edge", 1)], "cpu") == "edge"


@pytest.mark.parametrize("text, accelerators, message", [
    ("accel", None, "expected name=count entries like accel=1,cpu=1, got 'accel'"),
    ("accel=one", None, "worker count of pool 'accel' must be an integer, got 'one'"),
    ("accel=0,cpu=1", None, "worker count of pool 'accel' must be 1..16, got 0"),
    ("GPU=1", None, "pool name must be lowercase letters, digits, '-' or '_', got 'GPU'"),
    ("cpu=1,cpu=2", None, "pool 'cpu' is named twice"),
    ("=1", None, "got '=1'"),
    ("accel=1,cpu=1", "gpu", "--accelerator-pools: 'gpu' is not one of the verify pools ['accel', 'cpu']"),
])
def test_bad_values_name_themselves(text, accelerators, message):
    with pytest.raises(ValueError) as error:
        parse_verify_pools(text, accelerators)
    assert message in str(error.value)


def test_every_pool_an_accelerator_leaves_nowhere_to_fall_back():
    with pytest.raises(ValueError, match="keep one plain pool"):
        fallback_pool(parse_verify_pools("accel=1", "accel"), "cpu")


def test_one_verify_command_per_worker_and_the_declared_kind():
    commands = pool_commands(parse_verify_pools("accel=1,cpu=2", "accel"), verify_threads=1)
    assert list(commands) == ["verify-accel-0", "verify-cpu-0", "verify-cpu-1"]
    accel = commands["verify-accel-0"]
    assert accel[accel.index("--pool") + 1] == "accel" and accel[accel.index("--device-kind") + 1] == "accelerator"
    assert "--device-kind" not in commands["verify-cpu-1"]
    assert commands["verify-cpu-1"][commands["verify-cpu-1"].index("--worker-id") + 1] == "verify-cpu-1"
    pins = pinned_cores([*commands, "draft-worker", "gateway"], [0, 1, 2])
    assert pins == {"verify-accel-0": {0, 1}, "verify-cpu-0": {0, 1}, "verify-cpu-1": {0, 1}, "draft-worker": {2}}


@pytest.mark.parametrize("args, message", [
    (["--verify-pools", "accel=1,cpu"], "Error: --verify-pools: expected name=count entries like accel=1,cpu=1, "
                                        "got 'cpu' in 'accel=1,cpu'"),
    (["--verify-pools", "accel=x"], "Error: --verify-pools: worker count of pool 'accel' must be an integer, got 'x'"),
    (["--verify-pools", "accel=1", "--accelerator-pools", "accel"], "keep one plain pool"),
    (["--accelerator-pools", "accel"], "give --verify-pools too"),
])
def test_up_refuses_bad_pools_before_starting_anything(args, message, monkeypatch):
    from services.config import get_settings

    monkeypatch.setenv("MIRROR_SD_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing may be reached for
    try:
        result = CliRunner().invoke(app, ["up", *args])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2, result.output
    assert message in result.output
