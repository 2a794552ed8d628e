import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from services.models.loading import load_model
from services.models.engine import TorchEngine
from services.models.decoder import ForwardRow
t = load_model("smollm2-135m").with_precision(sys.argv[2] if len(sys.argv) > 2 else "int8")
e = TorchEngine(t)
seqs = [e.new_sequence() for _ in range(16)]
e.forward([ForwardRow(s, list(range(100 + i, 160 + i)), 1) for i, s in enumerate(seqs)])
for _ in range(3): e.forward([ForwardRow(s, [5], 1) for s in seqs])
a = time.perf_counter()
for _ in range(10): e.forward([ForwardRow(s, [5], 1) for s in seqs])
print("16 rows x 1 token, one step: %.1f ms" % ((time.perf_counter() - a) / 10 * 1000))
