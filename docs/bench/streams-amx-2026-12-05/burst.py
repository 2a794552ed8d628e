"""N dev chat prompts sent at once per route (sd, ar), TURNS times taking turns; per burst the wall time, the
verify worker's step counters (from the gateway's /metrics) and each process's CPU seconds.
usage: python burst.py URL N TURNS [stream]   (IDS_FROM=a bench's concurrency.json: its prompts, in its order)
Run from the repository root against `mirror-sd up --port 8093` (auth off)."""
import asyncio, json, re, sys, time, uuid
from pathlib import Path
REPO = Path(__file__).resolve().parents[3]
import httpx, psutil
PROCS = {}
for p in psutil.process_iter(["cmdline"]):
    cmd = " ".join(p.info["cmdline"] or [])
    for role in ("verify-worker", "draft-worker", "gateway", "telemetry"):
        if "services.cli " + role in cmd or "mirror-sd " + role in cmd:
            PROCS.setdefault(role, []).append(p)

def cpu():
    out = {}
    for role, ps in PROCS.items():
        tot = 0.0
        for p in ps:
            try:
                for q in [p] + p.children(recursive=True):
                    t = q.cpu_times(); tot += t.user + t.system
            except psutil.Error: pass
        out[role] = tot
    return out

URL = sys.argv[1]; N = int(sys.argv[2]); TURNS = int(sys.argv[3])
rows = [json.loads(l) for l in open(REPO / "data" / "dev_prompts.jsonl")][:N]
NAMES = ("steps", "wide_steps", "bridged_rounds", "forward_seconds", "step_seconds")

def counters(c):
    text = c.get(f"{URL}/metrics").text
    out = {}
    for name in NAMES:
        m = re.findall(rf"mirror_sd:verify_{name}_total\{{[^}}]*\}} ([0-9.e+]+)", text)
        out[name] = sum(float(x) for x in m)
    return out

async def one(client, prompt, route, salt):
    r = await client.post(f"{URL}/v1/chat/completions", json={"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 48, "temperature": 0, "route": route, "cache_salt": salt, "return_token_ids": True}, timeout=300)
    r.raise_for_status(); return r.json()

async def burst(route):
    salt = uuid.uuid4().hex
    async with httpx.AsyncClient() as client:
        t = time.perf_counter()
        out = await asyncio.gather(*(one(client, row["prompt"], route, salt) for row in rows))
        return time.perf_counter() - t, out

with httpx.Client() as c:
    for turn in range(TURNS):
        for route in ("sd", "ar"):
            before = counters(c); c0 = cpu()
            wall, out = asyncio.run(burst(route)); c1 = cpu()
            time.sleep(2.5)  # the heartbeat carries the counters
            after = counters(c)
            d = {k: round(after[k] - before[k], 2) for k in NAMES}
            toks = sum(len(o["choices"][0]["token_ids"]) for o in out)
            print(f"turn {turn} {route}: {wall:.2f} s, {toks} tokens, {toks/wall:.1f} tok/s, {d} cpu {dict((k, round(c1[k]-c0[k],2)) for k in c1)}", flush=True)
