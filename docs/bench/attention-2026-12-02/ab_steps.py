"""Step time of the packed forward, this checkout against another revision, in one process, taking turns.

    .venv/bin/python docs/bench/attention-2026-12-02/ab_steps.py --before ce6bfa9

loads the built-in target once and builds two engines on it: one from this checkout's KV store and decoder
(services/models/kv_store.py, decoder.py) and one from the same two files at --before; then times steps of
rows x tokens over a context, the two engines taking turns, and prints the mean of the middle timings and
the largest logit difference between them (same inputs, so it shows the change in numerics)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
FILES = ("services/models/kv_store.py", "services/models/decoder.py", "services/models/engine.py")
CASES = [(1, 256, False, "1"), (16, 64, False, "1"), (16, 64, False, "3"), (32, 64, False, "1"),
         (16, 256, False, "1"), (16, 256, True, "1"), (16, 256, True, "5"), (16, 256, True, "1,5"),
         (32, 256, True, "1"), (32, 256, True, "1,5"), (16, 1024, True, "1")]


def engine_from(sources: list[str], target):
    modules = {}
    for name, source in zip(("services.models.kv_store", "services.models.decoder", "services.models.engine"),
                            sources):
        module = types.ModuleType(name)
        sys.modules[name] = module  # the next file imports this one
        exec(compile(source, name, "exec"), module.__dict__)
        modules[name] = module
    return modules["services.models.engine"].TorchEngine(target), modules["services.models.decoder"].ForwardRow


def prefill(engine, row_type, rows: int, context: int, ragged: bool) -> list:
    sequences = [engine.new_sequence() for _ in range(rows)]
    for index, sequence in enumerate(sequences):
        length = context // 2 + (index * 37) % context if ragged else context
        engine.forward([row_type(sequence, [(7 * p + 3 + 13 * index) % 49000 for p in range(length)], 1)])
    return sequences


def step(engine, row_type, sequences: list, sizes: list[int]) -> tuple[float, list]:
    lengths = [sequence.length for sequence in sequences]
    rows = [row_type(sequence, [(11 * k + 5 + index) % 49000 for k in range(n)], n)
            for index, (sequence, n) in enumerate(zip(sequences, sizes))]
    started = time.perf_counter()
    logits = engine.forward(rows)
    elapsed = 1000 * (time.perf_counter() - started)
    for sequence, length in zip(sequences, lengths):
        sequence.crop(length)
    return elapsed, logits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="the revision to compare with")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    from services.config import default_cache_dir
    from services.models.loading import load_model

    target = load_model("smollm2-135m", cache_dir=default_cache_dir() / "models")
    before = [subprocess.run(["git", "show", f"{args.before}:{name}"], cwd=ROOT, check=True, text=True,
                             capture_output=True).stdout for name in FILES]
    after = [(ROOT / name).read_text() for name in FILES]
    engines = {"before": engine_from(before, target), "after": engine_from(after, target)}
    print(f"| rows | context | tokens per row | before ms | after ms | after/before | max logit diff |")
    print("|---|---|---|---|---|---|---|")
    for rows, context, ragged, sizes_text in CASES:
        options = [int(size) for size in sizes_text.split(",")]
        sizes = [options[index % len(options)] for index in range(rows)]
        state = {name: prefill(engine, row_type, rows, context, ragged) for name, (engine, row_type) in
                 engines.items()}
        timings: dict[str, list[float]] = {name: [] for name in engines}
        outputs = {}
        for _ in range(args.repeats):
            for name, (engine, row_type) in engines.items():
                elapsed, outputs[name] = step(engine, row_type, state[name], sizes)
                timings[name].append(elapsed)
        middle = {name: sorted(values)[args.repeats // 4: args.repeats - args.repeats // 4]
                  for name, values in timings.items()}
        mean = {name: sum(values) / len(values) for name, values in middle.items()}
        diff = max(float((a - b).abs().max()) for a, b in zip(outputs["before"], outputs["after"]))
        shape = f"{context // 2}-{context // 2 + context - 1}" if ragged else str(context)
        print(f"| {rows} | {shape} | {sizes_text} | {mean['before']:.1f} | {mean['after']:.1f} | "
              f"{mean['after'] / mean['before']:.2f} | {diff:.1e} |", flush=True)
        for name, (engine, _) in engines.items():
            for sequence in state[name]:
                sequence.release()


if __name__ == "__main__":
    main()
