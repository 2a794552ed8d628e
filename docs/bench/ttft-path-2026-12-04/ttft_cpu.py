"""Long dev prompts one at a time, max_tokens 1: wall TTFT and each stack process's CPU seconds during it."""
import json, os, subprocess, sys, time
import httpx
url = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 6
rows = [json.loads(l) for l in open("data/dev_prompts.jsonl")  # from the repository root]
rows = sorted(rows, key=lambda r: -len(r["prompt"]))[:n]
def procs():
    out = subprocess.run(["pgrep", "-f", "services.cli|redis-server"], capture_output=True, text=True).stdout.split()
    res = {}
    tck = os.sysconf("SC_CLK_TCK")
    for pid in out:
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
        except OSError:
            continue
        name = next((w for w in ("verify-worker", "draft-worker", "gateway", "telemetry", "redis-server", " up ") if w in cmd), cmd[:40])
        res[pid] = (name.strip(), (int(stat[11]) + int(stat[12])) / tck)
    return res
client = httpx.Client(timeout=120)
model = client.get(url + "/v1/models").json()["data"][0]["id"]
tot = {}
for rep in range(2):
    for r in rows:
        before = procs(); t = time.perf_counter()
        resp = client.post(url + "/v1/completions", json={"model": model, "prompt": r["prompt"], "max_tokens": 1, "temperature": 0})
        wall = time.perf_counter() - t; after = procs()
        cpu = {}
        for pid, (name, s) in after.items():
            if pid in before:
                cpu[name] = cpu.get(name, 0) + s - before[pid][1]
        print(f"{r['id'][:28]:28s} {resp.status_code} wall {wall*1000:7.0f} ms  " + "  ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items())), flush=True)
        for k, v in cpu.items():
            tot[k] = tot.get(k, 0) + v
print("total cpu s:", {k: round(v, 2) for k, v in tot.items()})
