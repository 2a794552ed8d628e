"""How often would a block sent for a rejection (the draft's second choice at its least confident positions)
have caught a broken chain? Teacher-forced: the target's greedy output, and the draft's two likeliest tokens
at every position of it, in one llama.cpp pass.

    python docs/bench/branches-2026-12-05/second_choice.py PATH/TO/draft.gguf [PROMPTS]

Needs `mirror-sd models prepare` (the built-in target in ~/.cache/mirror-sd/models/smollm2-135m)."""
import json
import sys
from pathlib import Path

import llama_cpp
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = Path.home() / ".cache/mirror-sd/models/smollm2-135m"
BLOCK, NEW = 5, 64

tokenizer = AutoTokenizer.from_pretrained(MODEL)
torch.set_num_threads(2)
target = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
draft = llama_cpp.Llama(model_path=sys.argv[1], logits_all=True, n_ctx=4096, n_threads=2, verbose=False)
count = int(sys.argv[2]) if len(sys.argv) > 2 else 16
prompts = [json.loads(line) for line in open(Path(__file__).parents[3] / "data/dev_prompts.jsonl")][:count]
breaks, holds, blocks = [], 0, 0
for record in prompts:
    text = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = target.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0].tolist()
    output = out[len(ids):]
    draft.reset()
    draft.eval(out)
    scores = np.array(draft.scores[:len(out)])  # row t: the draft's logits for token t + 1

    def choice(j):  # the draft's two likeliest for output position j, and their margin
        row = scores[len(ids) - 1 + j]
        probs = np.exp(row - row.max())
        probs /= probs.sum()
        first, second = np.argsort(-probs)[:2]
        return int(first), int(second), float(probs[first] - probs[second])

    j = 0
    while j + BLOCK + 1 <= len(output):
        blocks += 1
        path = [choice(j + k) for k in range(BLOCK + 1)]  # the block's draft tokens, then the bonus guess
        miss = next((k for k in range(BLOCK + 1) if path[k][0] != output[j + k]), None)
        if miss is None:
            holds += 1
            j += BLOCK + 1
            continue
        order = sorted(range(BLOCK + 1), key=lambda k: path[k][2])  # least confident first
        breaks.append((miss, path[miss][1] == output[j + miss], order.index(miss)))
        j += miss + 1
print(f"prompts {count}, blocks {blocks}, chains held {holds}, broken {len(breaks)} ({len(breaks) / blocks:.2f})")
print("break position (0..block, the last = the bonus guess):", np.bincount([b[0] for b in breaks],
                                                                          minlength=BLOCK + 1).tolist())
print(f"the draft's second choice was the target's token at {sum(b[1] for b in breaks) / len(breaks):.2f} of breaks")
for points in (1, 2, 3):
    covered = sum(1 for b in breaks if b[1] and b[2] < points) / len(breaks)
    print(f"{points} least confident point(s) per block: {covered:.2f} of breaks caught")
