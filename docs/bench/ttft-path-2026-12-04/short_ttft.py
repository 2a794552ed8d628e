import json, statistics, sys, time, uuid
import httpx
url = sys.argv[1]; reps = int(sys.argv[2]) if len(sys.argv) > 2 else 15
c = httpx.Client(timeout=60)
model = c.get(url + "/v1/models").json()["data"][0]["id"]
res = {"sd": [], "ar": []}
for i in range(reps):
    for route in ("sd", "ar"):
        body = {"model": model, "messages": [{"role": "user", "content": f"{uuid.uuid4().hex[:8]} How can I improve my time management skills?"}],
                "max_tokens": 1, "temperature": 0}
        if route == "ar":
            body["route"] = "ar"
        t = time.perf_counter(); r = c.post(url + "/v1/chat/completions", json=body); w = time.perf_counter() - t
        assert r.status_code == 200, r.text
        res[route].append(w * 1000)
for k, v in res.items():
    print(k, "median %.1f ms  min %.1f  mean %.1f" % (statistics.median(v), min(v), statistics.mean(v)))
