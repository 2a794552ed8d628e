"""The figures of a guidellm 0.8.1 JSON report (which also holds every prompt and output) as a small JSON:
per benchmark, streams, requests, TTFT median/p99, ITL median, TPOT median, requests/s, output tokens/s.

    python summarize.py /tmp/guidellm.json > summary.json
"""

import json
import sys

report = json.load(open(sys.argv[1]))
rows = []
for benchmark in report["benchmarks"]:
    metrics = benchmark["metrics"]

    def ok(name):
        return metrics[name]["successful"]

    rows.append({"streams": benchmark["config"]["strategy"].get("streams", 1),
                 "requests": metrics["request_totals"],
                 "ttft_ms_median": round(ok("time_to_first_token_ms")["median"], 1),
                 "ttft_ms_p99": round(ok("time_to_first_token_ms")["percentiles"]["p99"], 1),
                 "itl_ms_median": round(ok("inter_token_latency_ms")["median"], 1),
                 "tpot_ms_median": round(ok("time_per_output_token_ms")["median"], 1),
                 "requests_per_s": round(ok("requests_per_second")["mean"], 3),
                 "output_tokens_per_s": round(ok("output_tokens_per_second")["mean"], 1)})
print(json.dumps(rows, indent=1))
