cd /work/main
export MIRROR_SD_REDIS_URL=redis://127.0.0.1:6391/0
export MIRROR_SD_DATABASE_URL=sqlite:////tmp/drill.db
export MIRROR_SD_GATEWAY__AUTH_DISABLED=true
rm -f /tmp/drill.db
PY=/work/main/.venv/bin/python
mkdir -p /tmp/prof
setsid $PY -m services.cli up --port 8094 > /tmp/up-drill.log 2>&1 &
for i in $(seq 1 600); do grep -q "ready. Try" /tmp/up-drill.log && break; sleep 1; done
PRIV=$(grep -o "export MIRROR_SD_REDIS_URL=[^ ]*" /tmp/up-drill.log | head -1 | cut -d= -f2)
echo "private redis: $PRIV"
export MIRROR_SD_REDIS_URL=$PRIV
$PY -m services.cli drill burst --url http://127.0.0.1:8094 --requests 500 --out /tmp/prof/burst.json > /tmp/prof/burst.txt 2>&1
echo "burst rc $?"
sleep 5
$PY -m services.cli drill chaos --url http://127.0.0.1:8094 --kills 3 --every 4 --requests 16 --concurrency 6 --restart-redis --out /tmp/prof/chaos.json > /tmp/prof/chaos.txt 2>&1
echo "chaos rc $?"
pkill -INT -f "services.cli up --port 8094"; sleep 8; pkill -9 -f "services.cli up --port 8094"
pkill -9 -f "verify-worker|draft-worker|telemetry|services.cli gateway" 2>/dev/null; true
