#!/usr/bin/env bash
# guidellm 0.8.1 (the vLLM project's load-test client) against `mirror-sd up`, its server checks left on
# (it probes GET /health first). guidellm lives in a venv of its own, not a project dependency:
#   python3 -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install torch==2.13.0 guidellm==0.8.1
# Start the stack first (`make up`, or `.venv/bin/mirror-sd up --port 8000`), then run this from the repository
# root. The tokenizer comes from the converted built-in model (no hub download).
set -euo pipefail
GUIDELLM=${GUIDELLM:-/tmp/guidellm-venv/bin/guidellm}
TARGET=${TARGET:-http://127.0.0.1:8000}
OUT=${OUT:-/tmp/guidellm.json}  # every prompt and output: summarize.py keeps the figures
"$GUIDELLM" run \
  --backend "kind=openai_http,target=$TARGET,model=smollm2-135m,request_format=/v1/chat/completions" \
  --profile kind=concurrent \
  --override profile.streams 1,8 \
  --override 'constraints[0].count' 16,32 \
  --constraint kind=max_requests,count=16 \
  --data kind=synthetic_text,prompt_tokens=128,output_tokens=64 \
  --tokenizer "kind=huggingface_auto,model=$HOME/.cache/mirror-sd/models/smollm2-135m" \
  --output "kind=json,path=$OUT" \
  --disable-console-interactive
