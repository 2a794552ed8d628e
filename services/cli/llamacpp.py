"""`mirror-sd llamacpp`: build llama-cpp-python with the project's flags, check it decodes the built-in GGUF as the
target does, and say what the installed build uses (services/models/llamacpp_build.py, llamacpp_check.py)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from services.cli.common import fail

logger = logging.getLogger(__name__)

app = typer.Typer(help="llama.cpp for GGUF drafts: build, check, info.", no_args_is_help=True)

CHECK_PROMPT = "The capital of France is"
CHECK_TOKENS = 8
MIN_AGREEMENT = 6  # of CHECK_TOKENS: Q4_1 arithmetic in llama.cpp may tip a near-tie the torch target breaks otherwise


def _build_and_install(flag_set: str, extra: tuple[str, ...] = (), rebuild: bool = False) -> None:
    from services.config import get_settings
    from services.models.llamacpp_build import BuildError, ensure_wheel, install_wheel

    typer.echo(f"llama-cpp-python: flag set {flag_set!r} ...", err=True)
    try:
        wheel, built = ensure_wheel(get_settings().cache_dir, flag_set=flag_set, extra=extra, rebuild=rebuild)
        typer.echo(f"{'built' if built else 'reusing'} {wheel}", err=True)
        if install_wheel(wheel):
            typer.echo("installed it", err=True)
        else:
            typer.echo("already installed", err=True)
    except BuildError as exc:
        fail(str(exc))


@app.command("build")
def build(
    flags: Annotated[str, typer.Option(help="flag set: portable (default; AVX2, no AVX-512, no AMX), baseline "
                                             "(SSE4.2), native-no-amx (this CPU only)")] = "portable",
    cmake_arg: Annotated[list[str] | None, typer.Option("--cmake-arg", help="one more CMake argument, e.g. "
                                                        "-DGGML_CUDA=ON (part of the wheel's key)")] = None,
    rebuild: Annotated[bool, typer.Option(help="build again even if a wheel with this key exists")] = False,
) -> None:
    """Build (or reuse) the llama-cpp-python wheel for these flags and install it; wheels are kept in
    cache_dir/wheels, keyed by version and flags (pip's own cache keys them by version only)."""
    from services.models.llamacpp_build import FLAG_SETS

    if flags not in FLAG_SETS:
        fail(f"--flags: unknown flag set {flags!r}; known: {', '.join(FLAG_SETS)}")
    _build_and_install(flags, tuple(cmake_arg or ()), rebuild)


def _target_greedy() -> tuple[list[int], list[int]]:
    """The built-in target's prompt ids and its first CHECK_TOKENS greedy tokens (torch, fp32)."""
    from services.engine import GenerationOptions, generate
    from services.models.drafters import load_draft_source
    from services.models.loading import load_model
    from services.models.tokenization import encode_prompt

    target = load_model("smollm2-135m")
    prompt = encode_prompt(target.tokenizer, CHECK_PROMPT, chat=False)
    result = generate(target, load_draft_source("none", target), prompt,
                      GenerationOptions(max_new_tokens=CHECK_TOKENS, ignore_eos=True))
    return prompt, result.token_ids


def _check_once(prompt: list[int], expected: list[int]):
    """llama.cpp's greedy tokens after each prefix of prompt + expected, in a child process: (check, agreement)."""
    from services.models.drafters.gguf import gguf_path
    from services.models.llamacpp_check import EngineParams, check_engine

    params = EngineParams(str(gguf_path("gguf:smollm2-135m")), threads=1)
    check = check_engine(params, [*prompt, *expected])
    if not check.ok:
        return check, 0
    predicted = check.argmax[len(prompt) - 1: len(prompt) - 1 + len(expected)]
    return check, sum(a == b for a, b in zip(predicted, expected))


@app.command("check")
def check(
    rebuild_on_fault: Annotated[bool, typer.Option(
        help="if the installed build faults or decodes wrongly, rebuild once with the baseline flags and check "
        "again (make install does)")] = False,
) -> None:
    """Decode a few tokens of the built-in GGUF with llama.cpp in a child process and compare them with the
    target's greedy tokens: a build that crashes on this CPU fails here, with the fault named, not in a worker."""
    from services.errors import MirrorSDError
    from services.models.llamacpp import llama_cpp_available
    from services.models.llamacpp_build import SAFE_FLAG_SET

    if not llama_cpp_available():
        fail("llama-cpp-python is not installed: `mirror-sd llamacpp build` builds and installs it")
    try:
        prompt, expected = _target_greedy()
    except MirrorSDError as exc:
        fail(str(exc))
    outcome, agree = _check_once(prompt, expected)
    if (not outcome.ok or agree < MIN_AGREEMENT) and rebuild_on_fault:
        typer.echo(f"the installed build {_verdict(outcome, agree)}; rebuilding once with the {SAFE_FLAG_SET!r} "
                   "flags ...", err=True)
        _build_and_install(SAFE_FLAG_SET)
        outcome, agree = _check_once(prompt, expected)
    if not outcome.ok:
        typer.echo(f"llama.cpp's last output in the check:\n{outcome.detail[-1500:]}", err=True)
        fail(f"{outcome.describe()} decoding the built-in GGUF. Remedy: rebuild with the project's portable "
             f"flags (`mirror-sd llamacpp build --rebuild`; on an older CPU `--flags {SAFE_FLAG_SET}`), or serve "
             f"without it: MIRROR_SD_DRAFT=ngram")
    if agree < MIN_AGREEMENT:
        fail(f"llama.cpp {_verdict(outcome, agree)}: this build computes wrong values here. Remedy: "
             f"`mirror-sd llamacpp build --flags {SAFE_FLAG_SET}`, or serve with MIRROR_SD_DRAFT=ngram")
    used = ", ".join(name for name, on in outcome.features.items() if on)
    typer.echo(f"llama.cpp ok: {agree}/{len(expected)} greedy tokens of the built-in GGUF agree with the target "
               f"({outcome.seconds:.1f}s; build uses {used}; AMX {'on' if outcome.features.get('AMX_INT8') else 'off'})")


def _verdict(outcome, agree: int) -> str:
    return outcome.describe() if not outcome.ok else f"agrees with the target on {agree}/{CHECK_TOKENS} greedy tokens"


@app.command("info")
def info() -> None:
    """The installed build: where its wheel came from, its flag set, the instruction sets it uses (read in a
    child process, so a faulting build cannot take this command down)."""
    import subprocess
    import sys
    from pathlib import Path

    from services.config import get_settings
    from services.models.llamacpp import llama_cpp_available
    from services.models.llamacpp_build import (
        FLAG_SETS,
        HOST_SPECIFIC,
        LLAMA_CPP_PYTHON_VERSION,
        installed_wheel,
        wheel_dir,
    )

    if not llama_cpp_available():
        fail("llama-cpp-python is not installed: `mirror-sd llamacpp build` builds and installs it")
    wheel = installed_wheel()
    folder = Path(wheel).parent if wheel else None
    flag_set = next((name for name, flags in FLAG_SETS.items()
                     if folder == wheel_dir(get_settings().cache_dir, version=LLAMA_CPP_PYTHON_VERSION, flags=flags,
                                            host_specific=name in HOST_SPECIFIC)), None)
    probe = "import llama_cpp; print(llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        fail(f"llama_cpp does not load here (exit {result.returncode}): {result.stderr.strip()[-500:]}")
    version, system = (result.stdout.strip().splitlines() + ["", ""])[:2]
    typer.echo(f"llama-cpp-python {version}")
    typer.echo(f"wheel: {wheel or 'not installed from a wheel file (pip built it itself?)'}")
    typer.echo(f"flag set: {flag_set or 'not one of this project (rebuild: mirror-sd llamacpp build)'}")
    typer.echo(f"system: {system}")
    typer.echo(f"AMX: {'on' if 'AMX_INT8 = 1' in system else 'off'}")
