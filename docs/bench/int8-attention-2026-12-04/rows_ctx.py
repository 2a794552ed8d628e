import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
prec = sys.argv[2]; ctx = int(sys.argv[3]); n = int(sys.argv[4]) if len(sys.argv) > 4 else 16
from services.models.loading import load_model
from services.models.engine import TorchEngine
from services.models.decoder import ForwardRow
t = load_model("smollm2-135m").with_precision(prec)
e = TorchEngine(t)
seqs = [e.new_sequence() for _ in range(n)]
for i, s in enumerate(seqs):
    L = ctx - 40 + (i * 80) // n  # varied lengths around ctx
    e.forward([ForwardRow(s, [(100 + i + k) % 5000 for k in range(L)], 1)])
for _ in range(3): e.forward([ForwardRow(s, [5], 1) for s in seqs])
a = time.perf_counter()
for _ in range(10): e.forward([ForwardRow(s, [5], 1) for s in seqs])
print("%s ctx~%d: %d rows x 1 token, one step: %.1f ms" % (prec, ctx, n, (time.perf_counter() - a) / 10 * 1000))
