"""llama-cpp-python wheels built with the project's flags, kept by version and flags (not by pip's version-only
cache): a changed flag set builds anew, an unchanged one is reused, a failed build leaves nothing behind.

The build itself runs through a stand-in interpreter whose `-m pip wheel` records what it was asked and writes a
wheel file: the real build (4-9 minutes) is what `make install` runs in CI."""

from __future__ import annotations

import re
import shlex
import stat
import sys
import tomllib

import pytest

from services.models.llamacpp_build import (
    DEFAULT_FLAG_SET,
    FLAG_SETS,
    LLAMA_CPP_PYTHON_VERSION,
    BuildError,
    build_key,
    ensure_wheel,
    flags_of,
    wheel_dir,
)
from tests.conftest import REPO_ROOT

FAKE_PIP = """#!{python}
import os, sys
args = sys.argv[1:]
with open({calls!r}, "a") as log:
    log.write(repr([args, os.environ.get("CMAKE_ARGS")]) + "\\n")
if os.environ.get("FAKE_PIP_FAIL"):
    print("CMake Error: the compiler broke", file=sys.stderr)
    sys.exit(1)
out = args[args.index("--wheel-dir") + 1]
open(os.path.join(out, "llama_cpp_python-{version}-py3-none-linux_x86_64.whl"), "w").write("wheel")
"""


@pytest.fixture
def fake_python(tmp_path):
    calls = tmp_path / "calls.txt"
    path = tmp_path / "python"
    path.write_text(FAKE_PIP.format(python=sys.executable, calls=str(calls), version=LLAMA_CPP_PYTHON_VERSION))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path, calls


def recorded(calls) -> list:
    import ast

    return [ast.literal_eval(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def test_the_shipped_flags_turn_amx_and_native_code_off():
    portable = flags_of(DEFAULT_FLAG_SET)
    assert DEFAULT_FLAG_SET == "portable"
    assert "-DGGML_NATIVE=OFF" in portable and "-DGGML_AVX2=ON" in portable
    for flags in FLAG_SETS.values():
        assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert not any(re.match(r"-DGGML_AVX512\w*=ON", flag) for flag in portable + flags_of("baseline"))
    native = flags_of("native-no-amx")
    assert "-DGGML_NATIVE=ON" in native and any("-mno-amx-int8" in flag for flag in native)


def test_an_unknown_flag_set_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"'fastest'.*portable, baseline, native-no-amx"):
        flags_of("fastest")


def test_the_key_changes_with_flags_version_and_for_native_builds_the_cpu():
    portable = flags_of("portable")
    key = build_key(version="0.3.36", flags=portable)
    assert key == build_key(version="0.3.36", flags=portable)
    assert key != build_key(version="0.3.36", flags=(*portable, "-DGGML_CUDA=ON"))
    assert key != build_key(version="0.3.37", flags=portable)
    assert key != build_key(version="0.3.36", flags=portable, host_specific=True)
    folder = wheel_dir(REPO_ROOT, version="0.3.36", flags=portable)
    assert folder.name == f"llama-cpp-python-0.3.36-{key}" and folder.parent.name == "wheels"


def test_the_extra_pins_the_version_the_build_uses():
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["llamacpp"] == [f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]


def test_a_wheel_is_built_once_per_flag_set_with_those_flags_and_without_pips_cache(tmp_path, fake_python):
    python, calls = fake_python
    wheel, built = ensure_wheel(tmp_path / "cache", flag_set="portable", python=str(python))
    assert built and wheel.parent == wheel_dir(tmp_path / "cache", version=LLAMA_CPP_PYTHON_VERSION,
                                               flags=flags_of("portable"))
    (args, cmake_args), = recorded(calls)
    assert args[:3] == ["-m", "pip", "wheel"] and "--no-cache-dir" in args
    assert args[-1] == f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    assert shlex.split(cmake_args) == list(flags_of("portable"))  # quoted flags survive (CMAKE_C_FLAGS="a b")

    again, built = ensure_wheel(tmp_path / "cache", flag_set="portable", python=str(python))
    assert again == wheel and not built and len(recorded(calls)) == 1  # reused, not built again

    baseline, built = ensure_wheel(tmp_path / "cache", flag_set="baseline", python=str(python))
    assert built and baseline.parent != wheel.parent and len(recorded(calls)) == 2  # new flags: a new build
    native, _ = ensure_wheel(tmp_path / "cache", flag_set="native-no-amx", python=str(python))
    assert shlex.split(recorded(calls)[-1][1]) == list(flags_of("native-no-amx"))


def test_a_failed_build_says_why_and_leaves_no_wheel(tmp_path, fake_python, monkeypatch):
    python, _ = fake_python
    monkeypatch.setenv("FAKE_PIP_FAIL", "1")
    with pytest.raises(BuildError, match=r"(?s)pip exit 1.*the compiler broke"):
        ensure_wheel(tmp_path / "cache", python=str(python))
    folder = wheel_dir(tmp_path / "cache", version=LLAMA_CPP_PYTHON_VERSION, flags=flags_of("portable"))
    assert not folder.exists()
    assert [path.name for path in folder.parent.iterdir()] == [f"{folder.name}.log"]  # only the log, to read
