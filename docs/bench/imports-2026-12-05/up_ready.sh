#!/bin/bash
# usage: up_ready.sh CODEDIR (PY: the interpreter, default CODEDIR/.venv/bin/python) -> seconds from `up` to "ready. Try", and the gateway's own start
cd $1
export MIRROR_SD_REDIS_URL=redis://127.0.0.1:6379/13 MIRROR_SD_DATABASE_URL=sqlite:////tmp/ready.db
redis-cli -n 13 flushdb >/dev/null; rm -f /tmp/ready.db
t0=$(date +%s.%N)
setsid ${PY:-.venv/bin/python} -m services.cli up --port 8093 --draft ngram > /tmp/upr.log 2>&1 &
for i in $(seq 1 1500); do grep -q "ready. Try" /tmp/upr.log && break; sleep 0.2; done
t1=$(date +%s.%N)
GW=$(pgrep -f "services.cli gateway --port 8093" | head -1)
echo "$1 ready $(echo "$t1-$t0"|bc | cut -c1-5) s; gateway RSS $(( $(ps -o rss= -p $GW) / 1024 )) MB"
pkill -INT -f "services.cli up --port 8093"; sleep 8; pkill -9 -f "port 8093"; pkill -9 -f "services.cli (verify-worker|draft-worker|telemetry)"
sleep 2
