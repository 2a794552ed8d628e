"""Peak RSS of loading random:llama-1b (cpu_weight_layout auto; a fresh MIRROR_SD_CACHE_DIR measures the layout profile)."""
import resource, sys, time, torch
torch.set_num_threads(2)
from services.models.loading import load_model
t = time.time()
m = load_model("random:llama-1b")
import psutil
print(f"layout {m.layout}; load {time.time()-t:.0f}s; rss now {psutil.Process().memory_info().rss/2**30:.1f} GiB; "
      f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/2**20:.1f} GiB", flush=True)
