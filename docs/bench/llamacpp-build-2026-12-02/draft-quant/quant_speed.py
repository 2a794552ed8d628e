"""Time the built-in draft GGUF in three quantizations through the project's LlamaCppEngine, 2 threads, taking turns
over 3 rounds (median of rounds; each figure the fastest of its repeats).

    python quant_speed.py Q4_1.gguf Q8_0.gguf Q4_0.gguf     # Q8_0 and Q4_0 made with llama_model_quantize
"""
import statistics
import sys
import time
from pathlib import Path

from services.models.decoder import ForwardRow
from services.models.llamacpp import GgufModel, LlamaCppEngine


def run(path: str, threads: int) -> dict:
    engine = LlamaCppEngine(GgufModel(Path(path)), num_sequences=17, context_tokens=1024, threads=threads,
                            batch_tokens=512)
    prompt = [(37 * i + 11) % 2000 + 100 for i in range(512)]

    def best(fn, repeats):
        timings = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            fn()
            timings.append(1000 * (time.perf_counter() - started))
        return min(timings[1:])

    single = engine.new_sequence()
    engine.forward([ForwardRow(single, prompt[:64], 1)])

    def decode():
        for step in range(16):
            engine.forward([ForwardRow(single, [prompt[64 + step]], 1)])
        single.crop(64)

    many = [engine.new_sequence() for _ in range(16)]
    engine.forward([ForwardRow(sequence, prompt[i:i + 32], 1) for i, sequence in enumerate(many)])

    def step16():
        engine.forward([ForwardRow(sequence, [prompt[100 + i]], 1) for i, sequence in enumerate(many)])
        for sequence in many:
            sequence.crop(32)

    long = engine.new_sequence()

    def prefill():
        engine.forward([ForwardRow(long, prompt[:256], 1)])
        long.crop(0)

    return {"decode ms/token": best(decode, 2) / 16, "16-session step ms": best(step16, 5),
            "prefill 256 ms": best(prefill, 2)}


results = {path: [] for path in sys.argv[1:]}
for _ in range(3):
    for path in results:
        results[path].append(run(path, 2))
for path, runs in results.items():
    print(Path(path).name, {figure: round(statistics.median(run[figure] for run in runs), 2) for figure in runs[0]})
