import statistics, sys, time, torch
first, then = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(first)
from services.models.loading import load_model
from services.models.engine import TorchEngine
from services.models.decoder import ForwardRow
t = load_model("smollm2-135m", layout="native")
e = TorchEngine(t)
def prefill(n):
    s = e.new_sequence(); e.forward([ForwardRow(s, list(range(100, 164)), 1)]); a = time.perf_counter()
    e.forward([ForwardRow(s, [(7 * k) % 4000 + 50 for k in range(n)], 1)])
    w = (time.perf_counter() - a) * 1000; s.release(); return w
for _ in range(3): prefill(47); prefill(1)
torch.set_num_threads(then)
p = [prefill(47) for _ in range(10)]; d = [prefill(1) for _ in range(10)]
# alternate: wide prefill, narrow decode, as the worker does
alt_p, alt_d = [], []
for _ in range(8):
    torch.set_num_threads(2); alt_p.append(prefill(47))
    torch.set_num_threads(1); alt_d.append(prefill(1))
print(f"{first}->{then}: 47 tok {statistics.median(p[2:]):6.1f}  1 tok {statistics.median(d[2:]):5.1f} | alternating 2/1: 47 tok {statistics.median(alt_p[2:]):6.1f} 1 tok {statistics.median(alt_d[2:]):5.1f}")
