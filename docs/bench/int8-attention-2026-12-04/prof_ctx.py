import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
prec = sys.argv[2]; ctx = int(sys.argv[3]); n = 16
from services.models.loading import load_model
from services.models.engine import TorchEngine
from services.models.decoder import ForwardRow
t = load_model("smollm2-135m").with_precision(prec)
e = TorchEngine(t)
seqs = [e.new_sequence() for _ in range(n)]
for i, s in enumerate(seqs):
    L = ctx - 40 + (i * 80) // n
    e.forward([ForwardRow(s, [(100 + i + k) % 5000 for k in range(L)], 1)])
for _ in range(3): e.forward([ForwardRow(s, [5], 1) for s in seqs])
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(5): e.forward([ForwardRow(s, [5], 1) for s in seqs])
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
