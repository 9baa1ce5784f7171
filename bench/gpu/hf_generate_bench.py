#!/usr/bin/env python3
"""External peer for the decode benchmark: HF transformers `generate` (bf16, SDPA attention,
greedy) on a randomly initialised model with the shapes of one of spin's dummy presets, on the
same GPU and in the same run as spin_bench_model. Prints and writes CSV rows:
preset,batch,context,new_tokens,prefill_s,decode_tok_s (medians over repeats).

Decode tok/s = batch * (new_tokens - 1) / (time(generate new_tokens) - time(generate 1 token)),
so the prompt's prefill is not counted as decode.
"""
import argparse
import csv
import statistics
import sys
import time

import torch
import transformers

# The dimensions of spin's presets (src/model/dummy_model.cpp).
PRESETS = {
    "llama-3.1-8b": dict(family="llama", hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8,
                         vocab=128256, theta=500000.0),
    "qwen3-8b": dict(family="qwen3", hidden=4096, ffn=12288, layers=36, heads=32, kv_heads=8,
                     vocab=151936, theta=1000000.0),
    "qwen3-14b": dict(family="qwen3", hidden=5120, ffn=17408, layers=40, heads=40, kv_heads=8,
                      vocab=151936, theta=1000000.0),
}


def make_config(preset: str, max_position: int):
    p = PRESETS[preset]
    common = dict(hidden_size=p["hidden"], intermediate_size=p["ffn"], num_hidden_layers=p["layers"],
                  num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"], head_dim=128,
                  vocab_size=p["vocab"], rope_theta=p["theta"], max_position_embeddings=max_position,
                  tie_word_embeddings=False)
    if p["family"] == "llama":
        return transformers.LlamaConfig(**common, rms_norm_eps=1e-5,
                                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0,
                                                          original_max_position_embeddings=8192))
    return transformers.Qwen3Config(**common, rms_norm_eps=1e-6)


def timed_generate(model, ids, new_tokens):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-14b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[1024])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args()

    torch.manual_seed(0)
    config = make_config(a.preset, max(a.context) + a.new_tokens + 16)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    model.eval()
    rows = []
    with torch.inference_mode():
        for context in a.context:
            for batch in a.batch:
                ids = torch.randint(256, config.vocab_size, (batch, context), device="cuda")
                try:
                    timed_generate(model, ids, 2)  # warm-up
                    prefill = [timed_generate(model, ids, 1) for _ in range(a.repeats)]
                    full = [timed_generate(model, ids, a.new_tokens) for _ in range(a.repeats)]
                except torch.cuda.OutOfMemoryError:
                    print(f"{a.preset} batch {batch} context {context}: out of memory", file=sys.stderr)
                    torch.cuda.empty_cache()
                    continue
                p, f = statistics.median(prefill), statistics.median(full)
                row = dict(preset=a.preset, batch=batch, context=context, new_tokens=a.new_tokens,
                           prefill_s=round(p, 4), decode_tok_s=round(batch * (a.new_tokens - 1) / (f - p), 1))
                print(row, flush=True)
                rows.append(row)
    if a.csv and rows:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
