#!/bin/bash
# one stack per draft: the new auto (suffix:gguf:smollm2-135m) and the GGUF draft alone
cd /work/main
run() {
  name=$1; draft=$2; modes=$3
  redis-cli DEL mirror-sd:history >/dev/null
  MIRROR_SD_DRAFT=$draft .venv/bin/mirror-sd up --port 8123 --auth-disabled > /tmp/conc/up-$name.log 2>&1 &
  up=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8123/readyz | grep -q '"ready":true' && break; sleep 3; done
  echo "$name ready $(date)"
  .venv/bin/mirror-sd bench --concurrency 1,16 --requests 48 --modes $modes --max-prompt-chars 600 --limit 16 -n 64 \
      --url http://127.0.0.1:8123 --out /tmp/conc/$name > /tmp/conc/bench-$name.log 2>&1
  echo "$name done $(date) rc=$?"
  kill -TERM $up; wait $up
  sleep 5
}
run choice auto stack,stack-ar,hf-batch
run gguf gguf:smollm2-135m stack
