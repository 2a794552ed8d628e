"""Mask cost and rollback: llguidance against xgrammar, the built-in tokenizer, one JSON schema, the same tokens."""
import json, time, sys
import numpy as np
from services.config import Settings
from services.models.locate import resolve_model_dir
from services.models.tokenizer_loading import load_tokenizer
_, source = resolve_model_dir("smollm2-135m", Settings().cache_dir)
tok = load_tokenizer(source)
schema = {"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},"tags":{"type":"array","items":{"type":"string"}}},"required":["name","age","tags"],"additionalProperties":False}
text = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}'
ids = tok.encode(text, add_special_tokens=False)
V = 49152
out = {"tokens": len(ids)}
import llguidance, llguidance.hf
t0 = time.perf_counter(); llt = llguidance.hf.from_tokenizer(tok, n_vocab=V); out["llg_tokenizer_s"] = time.perf_counter() - t0
g = llguidance.LLMatcher.grammar_from_json_schema(schema)
t0 = time.perf_counter(); m = llguidance.LLMatcher(llt, g); out["llg_compile_ms"] = 1e3 * (time.perf_counter() - t0)
def llg_pass():
    m.reset()
    for t in ids:
        m.compute_bitmask(); m.consume_token(t)
t0 = time.perf_counter()
for _ in range(20): llg_pass()
out["llg_mask_us"] = 1e6 * (time.perf_counter() - t0) / (20 * len(ids))
t0 = time.perf_counter()
for _ in range(200): m.rollback(8); m.consume_tokens(ids[-8:])
out["llg_rollback8_us"] = 1e6 * (time.perf_counter() - t0) / 200
import xgrammar as xgr
t0 = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V); comp = xgr.GrammarCompiler(info); out["xgr_tokenizer_s"] = time.perf_counter() - t0
t0 = time.perf_counter(); cg = comp.compile_json_schema(json.dumps(schema)); out["xgr_compile_ms"] = 1e3 * (time.perf_counter() - t0)
mat = xgr.GrammarMatcher(cg)
import torch
bm = xgr.allocate_token_bitmask(1, V)
def xgr_pass():
    mat.reset()
    for t in ids:
        mat.fill_next_token_bitmask(bm); assert mat.accept_token(t)
t0 = time.perf_counter()
for _ in range(20): xgr_pass()
out["xgr_mask_us"] = 1e6 * (time.perf_counter() - t0) / (20 * len(ids))
t0 = time.perf_counter()
for _ in range(200):
    mat.rollback(8)
    for t in ids[-8:]: mat.accept_token(t)
out["xgr_rollback8_us"] = 1e6 * (time.perf_counter() - t0) / 200
print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))
