import sys, time, uuid, statistics, httpx, redis
sys.path.insert(0, ".")  # from the repository root
from services.redis_client import read_heartbeats
r = redis.Redis.from_url("redis://127.0.0.1:6379/13")
def counters():
    return {b.worker_id: dict(b.step_counters) for b in read_heartbeats(r) if b.role == "verify"}
c = httpx.Client(timeout=60)
walls = []
for i in range(3):
    c.post("http://127.0.0.1:8093/v1/chat/completions", json={"model": "smollm2-135m", "messages": [{"role": "user", "content": f"{uuid.uuid4().hex[:8]} How can I improve my time management skills?"}], "max_tokens": 1, "temperature": 0, "route": "ar"})
time.sleep(3); a = counters()
for i in range(12):
    t = time.perf_counter()
    c.post("http://127.0.0.1:8093/v1/chat/completions", json={"model": "smollm2-135m", "messages": [{"role": "user", "content": f"{uuid.uuid4().hex[:8]} How can I improve my time management skills?"}], "max_tokens": 1, "temperature": 0, "route": "ar"})
    walls.append((time.perf_counter() - t) * 1000)
time.sleep(3); b = counters()
for w in a:
    d = {k: round(b[w][k] - a[w].get(k, 0), 4) for k in b[w]}
    print(w, d)
    print("per request: forward %.1f ms, step %.1f ms; wall median %.1f" % (1000 * d["forward_s"] / 12, 1000 * d["step_s"] / 12, statistics.median(walls)))
