#!/bin/bash
# usage: gateway_start.sh CODEDIR (PY: the interpreter, default CODEDIR/.venv/bin/python) -> seconds to the first /v1/models answer, RSS, torch loaded or not
cd $1
export MIRROR_SD_REDIS_URL=redis://127.0.0.1:6379/12 MIRROR_SD_DATABASE_URL=sqlite:////tmp/gw.db MIRROR_SD_GATEWAY__AUTH_DISABLED=true
t0=$(date +%s.%N)
${PY:-.venv/bin/python} -m services.cli gateway --port 8097 > /tmp/gw.log 2>&1 &
P=$!
for i in $(seq 1 400); do curl -s -o /dev/null http://127.0.0.1:8097/v1/models && break; sleep 0.05; done
t1=$(date +%s.%N)
echo "ready after $(echo "$t1 - $t0" | bc) s; RSS $(ps -o rss= -p $P) KB"

grep -c "" /proc/$P/maps >/dev/null; grep -q libtorch /proc/$P/maps && echo "torch loaded" || echo "no torch"
kill -INT $P; sleep 2; kill -9 $P 2>/dev/null
