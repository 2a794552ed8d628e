"""How llama-cpp-python is built for llama.cpp drafts: the flag sets, and wheels cached by version and flags.

pip builds llama-cpp-python from source, and by default ggml compiles for the
build machine (`-march=native`). On a CPU with AMX (Intel Sapphire Rapids and
later) that turns on ggml's AMX kernels, which crash with SIGSEGV in
`ggml_backend_amx_mul_mat` on some of these machines (cloud VMs among them), and a
native wheel copied to another host may die with SIGILL. So the project builds
the wheel itself, with flags it chooses:

- `portable` (the default): AVX2, FMA, F16C and BMI2, no AVX-512, no AMX. Runs
  on every x86-64 CPU since 2013-2015 (Haswell, Zen); docs/bench/llamacpp-build
  compares it with a native build.
- `baseline`: SSE4.2 only, for an older CPU where `portable` dies (SIGILL);
  `make install` falls back to it when the portable build fails its check.
- `native-no-amx`: this machine's instruction sets minus AMX; opt-in only (the
  wheel is keyed by this CPU's flags too, as it runs nowhere else).

pip's own cache keys a built wheel by package version only, so a machine that
once built a bad wheel would keep reinstalling it whatever CMAKE_ARGS says
later. Wheels live instead in `<cache>/wheels/llama-cpp-python-<version>-<key>/`,
the key a hash of version, flags, Python tag and platform: a changed flag set
builds anew, and an unchanged one is reinstalled in seconds.

Only the standard library here: the Docker image's builder stage runs this
file as a script, before anything else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # pinned: its C API moves between releases
DISTRIBUTION = "llama-cpp-python"

# Every set names what it turns off too: ggml's defaults differ between versions and with GGML_NATIVE.
_COMMON = ("-DLLAVA_BUILD=OFF",  # the multimodal library: drafts never use it (and it is a third of the build)
           "-DGGML_CCACHE=OFF",
           "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
_NO_AVX512 = ("-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
              "-DGGML_AVX_VNNI=OFF")
_NO_AMX_CODE = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # -march=native would define __AMX_INT8__ on AMX CPUs
FLAG_SETS: dict[str, tuple[str, ...]] = {
    "portable": ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                 "-DGGML_F16C=ON", "-DGGML_BMI2=ON", *_NO_AVX512, *_COMMON),
    "baseline": ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=OFF", "-DGGML_AVX2=OFF", "-DGGML_FMA=OFF",
                 "-DGGML_F16C=OFF", "-DGGML_BMI2=OFF", *_NO_AVX512, *_COMMON),
    "native-no-amx": ("-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={_NO_AMX_CODE}", f"-DCMAKE_CXX_FLAGS={_NO_AMX_CODE}",
                      *_COMMON),
}
DEFAULT_FLAG_SET = "portable"
SAFE_FLAG_SET = "baseline"  # what an install rebuilds with once when the default build fails its check
HOST_SPECIFIC = {"native-no-amx"}


class BuildError(RuntimeError):
    """pip could not build or install the wheel."""


def cpu_flags() -> str:
    """This CPU's instruction-set flags, as Linux reports them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def flags_of(flag_set: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    if flag_set not in FLAG_SETS:
        raise ValueError(f"llama.cpp flag set {flag_set!r}: known sets are {', '.join(FLAG_SETS)}")
    return (*FLAG_SETS[flag_set], *extra)


def build_key(*, version: str, flags: tuple[str, ...], host_specific: bool = False) -> str:
    """What makes two wheels interchangeable: version, flags, Python and platform (and, for a native build, the
    CPU it was built on)."""
    facts = {"version": version, "flags": list(flags), "python": sys.implementation.cache_tag,
             "platform": sysconfig.get_platform()}
    if host_specific:
        facts["cpu"] = hashlib.sha256(cpu_flags().encode()).hexdigest()[:16]
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def wheel_dir(cache_dir: Path, *, version: str, flags: tuple[str, ...], host_specific: bool = False) -> Path:
    return Path(cache_dir) / "wheels" / f"{DISTRIBUTION}-{version}-{build_key(version=version, flags=flags, host_specific=host_specific)}"


def find_wheel(directory: Path) -> Path | None:
    wheels = sorted(Path(directory).glob("*.whl")) if Path(directory).is_dir() else []
    return wheels[0] if wheels else None


def build_wheel(directory: Path, *, version: str, flags: tuple[str, ...], python: str = sys.executable,
                jobs: int | None = None) -> Path:
    """pip wheel from the source release into `directory` (filled only once the build succeeded), no pip cache."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    log_path = directory.parent / f"{directory.name}.log"
    staging = Path(tempfile.mkdtemp(prefix=f"{directory.name}.", dir=directory.parent))
    env = {**os.environ, "CMAKE_ARGS": shlex.join(flags), "FORCE_CMAKE": "1",
           "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs or os.cpu_count() or 1)}
    command = [python, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--no-binary", DISTRIBUTION,
               "--wheel-dir", str(staging), f"{DISTRIBUTION}=={version}"]
    started = time.monotonic()
    try:
        with open(log_path, "w") as log:
            log.write(f"$ CMAKE_ARGS={shlex.quote(env['CMAKE_ARGS'])} {shlex.join(command)}\n")
            log.flush()
            code = subprocess.call(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        built = find_wheel(staging)
        if code != 0 or built is None:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise BuildError(f"building {DISTRIBUTION}=={version} failed (pip exit {code}); the last lines of "
                             f"{log_path}:\n" + "\n".join(tail))
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)  # all or nothing: an interrupted build leaves no wheel behind
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("built %s in %.0f s", directory / built.name, time.monotonic() - started)
    return directory / built.name


def ensure_wheel(cache_dir: Path, *, flag_set: str = DEFAULT_FLAG_SET, extra: tuple[str, ...] = (),
                 version: str = LLAMA_CPP_PYTHON_VERSION, python: str = sys.executable,
                 rebuild: bool = False) -> tuple[Path, bool]:
    """The wheel for this version and flag set: the cached one, else a new build. Returns (wheel, built now)."""
    flags = flags_of(flag_set, extra)
    directory = wheel_dir(cache_dir, version=version, flags=flags, host_specific=flag_set in HOST_SPECIFIC)
    cached = None if rebuild else find_wheel(directory)
    if cached is not None:
        return cached, False
    return build_wheel(directory, version=version, flags=flags, python=python), True


def installed_wheel(python: str = sys.executable) -> str | None:
    """The wheel file the interpreter's llama-cpp-python was installed from (pip's direct_url.json), if any."""
    code = ("import importlib.metadata as m, json\n"
            "try:\n d = m.distribution('llama_cpp_python')\nexcept m.PackageNotFoundError:\n print('')\n"
            "else:\n print(json.loads(d.read_text('direct_url.json') or '{}').get('url', ''))")
    result = subprocess.run([python, "-c", code], capture_output=True, text=True)
    url = result.stdout.strip()
    return url.removeprefix("file://") if url.startswith("file://") else None


def install_wheel(wheel: Path, python: str = sys.executable) -> bool:
    """Install `wheel` unless it is the one installed already; True when pip ran."""
    if installed_wheel(python) == str(Path(wheel).resolve()):
        return False
    pip = [python, "-m", "pip", "install", "--quiet"]
    # this exact build in place of any other of the same version, then whatever it needs (numpy, diskcache, ...)
    for command in ([*pip, "--no-deps", "--force-reinstall", str(Path(wheel).resolve())],
                    [*pip, str(Path(wheel).resolve())]):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"pip could not install {wheel}: {result.stderr.strip()[-2000:]}")
    return True


def main(argv: list[str] | None = None) -> int:
    """Script entry for the Docker image's builder stage: build (or reuse) the wheel, print its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", type=Path, required=True, help="where keyed wheels are kept")
    parser.add_argument("--flags", default=DEFAULT_FLAG_SET, choices=sorted(FLAG_SETS))
    parser.add_argument("--copy-to", type=Path, help="also copy the wheel into this folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    wheel, _ = ensure_wheel(args.cache_dir, flag_set=args.flags)
    if args.copy_to is not None:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        shutil.copy2(wheel, args.copy_to / wheel.name)
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
