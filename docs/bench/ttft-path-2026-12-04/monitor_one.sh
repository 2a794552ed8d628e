# One request per route under `redis-cli MONITOR` (from the repository root; a stack on :8093, its Redis on 6379).
HERE=docs/bench/ttft-path-2026-12-04
.venv/bin/python $HERE/short_ttft.py http://127.0.0.1:8093 3 > /dev/null 2>&1  # warm
(timeout 6 redis-cli MONITOR > /tmp/monitor.txt &) ; sleep 1
.venv/bin/python - <<'PY'
import httpx, time, uuid
c = httpx.Client(timeout=60)
for route in ("sd", "ar"):
    body = {"model": "smollm2-135m", "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "user", "content": f"{uuid.uuid4().hex[:8]} How can I improve my time management skills?"}]}
    if route == "ar":
        body["route"] = "ar"
    t = time.time(); r = c.post("http://127.0.0.1:8093/v1/chat/completions", json=body); e = time.time()
    print(route, "client start %.4f end %.4f wall %.1f ms" % (t, e, (e - t) * 1000), flush=True)
    time.sleep(1.5)
PY
sleep 3
