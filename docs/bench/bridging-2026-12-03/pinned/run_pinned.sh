#!/bin/bash
# usage: trace_pin.sh CODEDIR OUTDIR BENCHARGS...  (verify worker alone on CPU 1, the rest on CPU 0)
CODE=$1; OUT=$2; shift 2
rm -f /tmp/trace.db
cd $CODE
export PYTHONPATH=$CODE MIRROR_SD_REDIS_URL=redis://127.0.0.1:6379/13 MIRROR_SD_DATABASE_URL=sqlite:////tmp/trace.db
redis-cli -n 13 flushdb >/dev/null
/work/main/.venv/bin/python -m services.cli up --port 8093 --draft-link 0 > $OUT.up.log 2>&1 &
for i in $(seq 1 300); do grep -q "ready. Try" $OUT.up.log && break; sleep 1; done
for p in $(pgrep -f "cli verify-worker"); do taskset -acp 1 $p >/dev/null; done
for p in $(pgrep -f "services.cli (up|link|draft-worker|telemetry|gateway)") $(pgrep redis-server); do taskset -acp 0 $p >/dev/null; done
taskset -c 0 /work/main/.venv/bin/python -m services.cli bench --url http://127.0.0.1:8093 --out $OUT "$@" > $OUT.bench.log 2>&1
for p in $(pgrep redis-server); do taskset -acp 0,1 $p >/dev/null; done
pkill -INT -f "up --port 8093"; sleep 8; pkill -9 -f "up --port 8093"; pkill -9 -f "services.cli" ; sleep 2
