"""C streams (argv 1), the sd route against the plain route of a stack on :8093, taking turns (argv 2 times each);
CPU seconds of each stack process per run. Run from the repository root."""
import sys, time, psutil
from services.bench.load import run_level
from services.bench.prompts import load_prompts, select_prompts
from pathlib import Path
prompts = select_prompts(load_prompts(Path("data/dev_prompts.jsonl")), limit=32)
C = int(sys.argv[1]) if len(sys.argv) > 1 else 16
def workers():
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        for role in ("verify-worker", "draft-worker", "gateway", "telemetry", "link"):
            if f"services.cli {role}" in cmd:
                out[role] = p
    return out
procs = workers()
def cpu():
    return {role: sum(p.cpu_times()[:2]) for role, p in procs.items()}
url = "http://127.0.0.1:8093"
run_level(url, "smollm2-135m", prompts[:1], 1, max_tokens=8)
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    for route in (None, "ar"):
        before, t = cpu(), time.perf_counter()
        run = run_level(url, "smollm2-135m", prompts[:C], C, max_tokens=48, route=route)
        wall = time.perf_counter() - t
        after = cpu()
        tokens = sum(r.num_tokens for r in run.records)
        print(f"{'sd   ' if route is None else 'plain'} C={C} {tokens/wall:6.1f} tok/s wall {wall:5.1f}s  cpu s: " +
              "  ".join(f"{k} {after[k]-before[k]:.1f}" for k in sorted(after)), flush=True)
