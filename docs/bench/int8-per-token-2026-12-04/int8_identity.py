import sys, time, json, torch
torch.set_num_threads(1)
from services.models.loading import load_model
from services.models.drafters import load_draft_source
from services.models.tokenization import encode_prompt
from services.engine import GenerationOptions, generate
from tests.conftest import load_dev_prompts
prec = sys.argv[1]
target = load_model("smollm2-135m").with_precision(prec)
none = load_draft_source("none", target); ngram = load_draft_source("ngram", target)
prompts = load_dev_prompts()
bad = 0; tp = 0; tt = 0; ns=0
for rec in prompts[:int(sys.argv[2])]:
    ids = encode_prompt(target.tokenizer, rec["prompt"], chat=True)
    t = time.perf_counter(); a = generate(target, none, ids, GenerationOptions(max_new_tokens=48)); tp += time.perf_counter()-t; ns += a.num_tokens
    t = time.perf_counter(); b = generate(target, ngram, ids, GenerationOptions(max_new_tokens=48)); tt += time.perf_counter()-t
    if a.token_ids != b.token_ids: bad += 1; print("MISMATCH", rec["id"])
print(prec, "mismatch", bad, "plain s", round(tp,1), "ms/token", round(1000*tp/ns,1), "ngram s", round(tt,1))
