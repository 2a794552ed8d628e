"""Time llama.cpp builds of llama-cpp-python against each other on the built-in GGUF, taking turns.

Each build is a wheel unpacked into its own folder; every measurement runs in a fresh process with that
folder first on PYTHONPATH, through the project's own LlamaCppEngine (what a draft worker runs):
- decode: ms per token of one sequence, one token per llama_decode, after a 64-token prompt (a draft token);
- step16: ms of one batched step of 16 sequences, one token each (the draft profile's 16-session step);
- prefill512: ms to prefill a 512-token prompt in one sequence (a long prompt's draft prefill).
Rounds alternate between the builds so a drift of the machine's speed hits them alike; the table gives the
median over rounds of each figure (each figure itself the fastest of its repeats).

    python compare_builds.py --build portable=/tmp/wheels/portable/x.whl --build native=... --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CHILD = r"""
import json, sys, time
from services.models.decoder import ForwardRow
from services.models.drafters.gguf import gguf_path
from services.models.llamacpp import GgufModel, LlamaCppEngine
threads = int(sys.argv[1])
model = GgufModel(gguf_path("gguf:smollm2-135m"))
engine = LlamaCppEngine(model, num_sequences=17, context_tokens=1024, threads=threads, batch_tokens=512)
prompt = [(37 * i + 11) % 2000 + 100 for i in range(512)]

def best(run, repeats):
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter(); run(); times.append(1000 * (time.perf_counter() - started))
    return min(times[1:])

single = engine.new_sequence()
engine.forward([ForwardRow(single, prompt[:64], 1)])
def decode():
    for step in range(32):
        engine.forward([ForwardRow(single, [prompt[64 + step]], 1)])
    single.crop(64)
many = [engine.new_sequence() for _ in range(16)]
engine.forward([ForwardRow(s, prompt[i: i + 32], 1) for i, s in enumerate(many)])
def step16():
    engine.forward([ForwardRow(s, [prompt[100 + i]], 1) for i, s in enumerate(many)])
    for s in many:
        s.crop(32)
long = engine.new_sequence()
def prefill():
    engine.forward([ForwardRow(long, prompt, 1)])
    long.crop(0)
info = model.lib.llama_print_system_info().decode()
print(json.dumps({"decode": best(decode, 3) / 32, "step16": best(step16, 10), "prefill512": best(prefill, 3),
                  "system_info": info}))
"""


def unpack(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(into)
    return into


def measure(site: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.getcwd()])}
    result = subprocess.run([sys.executable, "-c", CHILD, str(threads)], env=env, capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", action="append", required=True, help="name=path/to/wheel")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llamacpp-builds-"))
    sites = {name: unpack(Path(path), root / name) for name, path in (b.split("=", 1) for b in args.build)}
    runs: dict = {f"{name}@{t}": [] for name in sites for t in args.threads.split(",")}
    for round_index in range(args.rounds):
        for threads in args.threads.split(","):
            for name, site in sites.items():
                runs[f"{name}@{threads}"].append(measure(site, int(threads)))
        print(f"round {round_index + 1} done", file=sys.stderr)
    table = {key: {figure: round(statistics.median(run[figure] for run in samples), 3)
                   for figure in ("decode", "step16", "prefill512")} | {"system_info": samples[0]["system_info"]}
             for key, samples in runs.items()}
    print(f"{'build@threads':28} {'decode ms/tok':>14} {'16-row step ms':>15} {'prefill 512 ms':>15}")
    for key, row in table.items():
        print(f"{key:28} {row['decode']:14.2f} {row['step16']:15.2f} {row['prefill512']:15.1f}")
    if args.out:
        args.out.write_text(json.dumps({"rounds": args.rounds, "table": table, "samples": runs}, indent=1))


if __name__ == "__main__":
    main()
