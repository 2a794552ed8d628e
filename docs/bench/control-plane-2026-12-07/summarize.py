import json, glob, statistics, sys, collections
base = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ab"
configs = collections.defaultdict(list)
for path in sorted(glob.glob(f"{base}/*/overhead.json")):
    name = path.split("/")[-2].rsplit("-", 1)[0]
    configs[name].append(json.load(open(path)))
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
print("config | reps | in-process tok/s (median) ")
for name, runs in configs.items():
    print(name, len(runs), [round(r["in_process"]["tokens_per_s"]) for r in runs])
keys = [(r["route"], r["concurrency"]) for r in next(iter(configs.values()))[0]["rows"]]
print("\n| route | C | " + " | ".join(f"{n} tok/s" for n in configs) + " | " + " | ".join(f"{n} x-in-proc" for n in configs) + " | " + " | ".join(f"{n} TTFT ms" for n in configs) + " | " + " | ".join(f"{n} machinery ms/step" for n in configs) + " | " + " | ".join(f"{n} verify us/tok" for n in configs) + " | " + " | ".join(f"{n} gw us/tok" for n in configs) + " |")
for route, c in keys:
    cells = []
    for field in ("tokens_per_s", "x_in_process", "ttft_p50_ms", "machinery_ms_per_step"):
        for name, runs in configs.items():
            vals = [row[field] for run in runs for row in run["rows"] if row["route"] == route and row["concurrency"] == c]
            m = med(vals); cells.append(f"{m:.3g}" + f" ({min(vals):.3g}-{max(vals):.3g})" if m is not None else "-")
    for proc in ("verify-worker", "gateway"):
        for name, runs in configs.items():
            vals = [row["cpu_us_per_token"][proc] for run in runs for row in run["rows"] if row["route"] == route and row["concurrency"] == c]
            cells.append(f"{med(vals):.0f}")
    print(f"| {route} | {c} | " + " | ".join(cells) + " |")
