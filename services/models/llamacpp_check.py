"""Run llama.cpp once in a child process before trusting it in-process.

A llama.cpp build can fault on a CPU it was not made for: the AMX kernels of a
native build die with SIGSEGV on some Sapphire Rapids machines, a build with
AVX2 dies with SIGILL on a CPU without it. In-process, that kills the whole
draft worker (or test run) with no word of why. So the GGUF is first decoded in
a child process, with the engine code and settings the caller will use: a
teacher-forced prefill (logits at every position) and batched single-token
steps over several sequences (the draft profile's shapes). The child's death
is named: the signal, the function faulthandler saw it in, and the build's
instruction sets (llama_print_system_info).

The verdict is kept on disk, keyed by the GGUF file, the installed llama.cpp
libraries, this CPU's flags and the engine's settings, so a worker restarting
on the same box pays for the check once. A failed verdict is kept too: a
rebuilt library or another GGUF changes the key and is checked again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.errors import MirrorSDError
from services.models.llamacpp_build import cpu_flags
from services.supervisor import describe_exit, die_with_parent

logger = logging.getLogger(__name__)

CHECK_FORMAT = 1
CHECK_TIMEOUT_S = 180.0
PROBE_TOKENS = tuple((37 * position + 11) % 2000 + 100 for position in range(24))  # any ids of any vocab
NOTABLE_FEATURES = ("AMX_INT8", "AVX512", "AVX2", "AVX")  # named in a fault's description


class LlamaCppFaultError(MirrorSDError):
    """llama.cpp crashed, hung or failed in its check: loading it in this process would take the process down."""

    def __init__(self, check: "EngineCheck", spec: str) -> None:
        self.check = check
        self.spec = spec
        kept = check.kept_note()
        super().__init__(f"draft {spec!r}: {check.describe()}" + (f" ({kept})" if kept else ""))


@dataclass(frozen=True)
class EngineParams:
    """What the caller will run: the check uses the same, and they are part of its key."""

    gguf: str
    threads: int = 1
    num_sequences: int = 4
    context_tokens: int = 256
    batch_tokens: int = 512


@dataclass
class EngineCheck:
    ok: bool
    fault: str | None = None  # "SIGSEGV", "exit code 1", "hung": how the child ended when not ok
    where: str | None = None  # the innermost function faulthandler or the traceback named
    detail: str = ""  # the child's last lines of output (the faulthandler traceback)
    argmax: list[int] = field(default_factory=list)  # greedy token after each prefix of the probe
    system_info: str = ""
    seconds: float = 0.0
    checked_at: float = field(default_factory=time.time)
    cache_file: str | None = None  # where the verdict is kept (a cached one says so)

    @property
    def features(self) -> dict[str, bool]:
        """Instruction sets the build uses, from llama_print_system_info ("AMX_INT8 = 1 | ...")."""
        return {name: value == "1" for name, value in re.findall(r"([A-Z0-9_]+) = (\d)", self.system_info)}

    def describe(self) -> str:
        """One line: what happened, where, and with which build."""
        if self.ok:
            return f"llama.cpp ran its check in {self.seconds:.1f}s"
        used = [name for name in NOTABLE_FEATURES if self.features.get(name)]
        build = f" (build uses {', '.join(used)})" if used else ""
        where = f" in {self.where}" if self.where else ""
        return f"llama.cpp {self.fault_phrase}{where}{build}"

    def kept_note(self) -> str:
        """Where a failed verdict is kept, and how to have it checked again."""
        return (f"the verdict is kept in {self.cache_file}: a rebuilt llama.cpp (`mirror-sd llamacpp build`) is "
                "checked again" if self.cache_file else "")

    @property
    def fault_phrase(self) -> str:
        if self.fault == "hung":
            return f"hung (no answer in {self.seconds:.0f}s)"
        if self.fault and self.fault.startswith("SIG"):
            return f"crashed with {self.fault}"
        return f"failed ({self.fault})"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict) -> "EngineCheck":
        known = {name: body[name] for name in cls.__dataclass_fields__ if name in body}
        return cls(**known)


# --- the child ---------------------------------------------------------------------------------------------
def run_probe(params: EngineParams, probe: list[int]) -> dict:
    """In the child: the engine as the caller builds it, one teacher-forced row, then batched steps."""
    from services.models.decoder import ForwardRow
    from services.models.llamacpp import GgufModel, LlamaCppEngine

    started = time.perf_counter()
    model = GgufModel(Path(params.gguf))
    info = model.lib.llama_print_system_info()
    info = info.decode() if isinstance(info, bytes) else str(info)
    print(json.dumps({"system_info": info}), flush=True)  # before decoding: a crash still says what the build uses
    engine = LlamaCppEngine(model, num_sequences=params.num_sequences, context_tokens=params.context_tokens,
                            threads=params.threads, batch_tokens=params.batch_tokens)
    probe = [token % model.vocab_size for token in probe]
    first = engine.new_sequence()
    logits = engine.forward([ForwardRow(first, probe, len(probe))])[0]  # [len(probe), vocab]
    argmax = [int(index) for index in logits.argmax(dim=-1).tolist()]
    others = [engine.new_sequence() for _ in range(min(params.num_sequences, 16))]
    engine.forward([ForwardRow(sequence, probe[: 4 + index % 4], 1) for index, sequence in enumerate(others)])
    for step in range(2):
        engine.forward([ForwardRow(sequence, [probe[step]], 1) for sequence in others])
    return {"argmax": argmax, "system_info": info, "seconds": round(time.perf_counter() - started, 3)}


def child_main(argv: list[str]) -> int:
    request = json.loads(argv[0])
    params = EngineParams(**request["params"])
    result = run_probe(params, list(request["probe"]))
    print(json.dumps(result), flush=True)
    return 0


# --- the parent --------------------------------------------------------------------------------------------
def _innermost_function(output: str) -> str | None:
    """faulthandler lists the crashing thread innermost first ('File "...", line N in llama_decode'); a Python
    traceback lists it last."""
    fault_frames = re.findall(r'File "[^"]+", line \d+ in (\w+)', output)
    if fault_frames:
        return fault_frames[0]
    frames = re.findall(r'File "[^"]+", line \d+, in (\w+)', output)
    return frames[-1] if frames else None


def check_engine(params: EngineParams, probe: list[int] | tuple[int, ...] = PROBE_TOKENS, *,
                 timeout_s: float = CHECK_TIMEOUT_S, env: dict[str, str] | None = None) -> EngineCheck:
    """Decode `probe` with llama.cpp in a child process; how it went (never raises for the child's fate)."""
    request = json.dumps({"params": asdict(params), "probe": list(probe)})
    command = [sys.executable, "-X", "faulthandler", "-m", "services.models.llamacpp_check", request]
    started = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                env={**os.environ, **(env or {})}, start_new_session=True,
                                preexec_fn=die_with_parent(os.getpid()))  # this thread waits for it: safe
    except subprocess.TimeoutExpired as exc:
        output = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        # named after the timeout it ran out of (killing the child takes a moment more)
        return EngineCheck(ok=False, fault="hung", seconds=timeout_s, detail=output[-3000:])
    seconds = time.monotonic() - started
    output = result.stderr[-3000:]
    answer = _answers(result.stdout)
    if result.returncode != 0:
        return EngineCheck(ok=False, fault=describe_exit(result.returncode), where=_innermost_function(result.stderr),
                           detail=output, seconds=seconds, system_info=answer.get("system_info", ""))
    if "argmax" not in answer:
        return EngineCheck(ok=False, fault="no answer", detail=(result.stdout + output)[-3000:], seconds=seconds)
    return EngineCheck(ok=True, argmax=answer["argmax"], system_info=answer["system_info"], seconds=seconds)


def _answers(stdout: str) -> dict:
    """The child's JSON lines, merged (llama.cpp may print lines of its own between them)."""
    merged: dict = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                merged.update(json.loads(line))
            except ValueError:
                continue
    return merged


def library_facts() -> list:
    """The installed llama.cpp bindings (where) and libraries (name, size, mtime), without loading them."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return []
    lib = Path(spec.submodule_search_locations[0]) / "lib"
    return [str(spec.origin), *sorted((path.name, path.stat().st_size, path.stat().st_mtime_ns)
                                      for path in lib.glob("*") if path.is_file())] if lib.is_dir() else [str(spec.origin)]


def check_key(params: EngineParams) -> str:
    stat = Path(params.gguf).stat()
    facts = {"format": CHECK_FORMAT, "params": asdict(params), "gguf": [stat.st_size, stat.st_mtime_ns],
             "libraries": library_facts(), "cpu": cpu_flags(), "python": sys.implementation.cache_tag,
             "pythonpath": os.environ.get("PYTHONPATH", "")}  # where the child looks for the bindings first
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def cached_engine_check(params: EngineParams, cache_dir: Path | None, *,
                        timeout_s: float = CHECK_TIMEOUT_S) -> EngineCheck:
    """check_engine, its verdict read from / written to cache_dir/checks (None: no cache, always run)."""
    if cache_dir is None:
        return check_engine(params, timeout_s=timeout_s)
    path = Path(cache_dir) / "checks" / f"llamacpp-{check_key(params)}.json"
    try:
        check = EngineCheck.from_json(json.loads(path.read_text()))
        check.cache_file = str(path)
        return check
    except (OSError, ValueError, TypeError):
        pass
    logger.info("checking llama.cpp on %s in a child process (once per GGUF, build and CPU) ...",
                Path(params.gguf).name)
    check = check_engine(params, timeout_s=timeout_s)
    if check.fault != "hung":  # a hang may be this moment's load: ask again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(check.to_json()))
        temporary.replace(path)
    check.cache_file = str(path) if not check.ok else None
    return check


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
