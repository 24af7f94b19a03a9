#!/usr/bin/env python3
"""A Llama-shaped transformers model with each attention implementation, side by side in one run:
prefill of --prompt tokens, then --steps greedy decode steps over the cache.

  eager   transformers' eager_attention_forward (matmul, mask add, softmax, matmul)
  sdpa    torch's scaled_dot_product_attention
  flex    torch's flex_attention, compiled by transformers (inductor on the CPU); a warm-up run
          (the same prefill and 3 decode steps) compiles it first, outside the timings
  posenc  posenc.hf.register(): posenc's fused kernel

Every implementation runs the same random weights (LlamaForCausalLM, 16 heads of 128 over 4 KV
heads, 4 layers, width 2048, MLP 5504, vocabulary 32000, Llama 3's RoPE) on the same tokens. Each
one's attention function is wrapped by a timer: the table gives the seconds inside the attention
calls (prefill: in all; decode: per step) and their share of the whole. Decode steps feed the previous greedy token; the greedy
tokens of every implementation are compared with eager's and the count that differ is printed.

    PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python bench/hf_side_by_side.py --threads 2
"""
import argparse
import json
import time

import torch
import transformers
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

import posenc.hf

SPENT = {"attention": 0.0}


def timed(function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SPENT["attention"] += time.perf_counter() - start
    return wrapper


def instrument():
    """Every implementation's attention function wrapped by the timer, under its own name (so
    that transformers still builds the mask each one expects)."""
    posenc.hf.register()
    modeling_llama.eager_attention_forward = timed(modeling_llama.eager_attention_forward)
    for name in ("sdpa", "flex_attention", posenc.hf.NAME):
        ALL_ATTENTION_FUNCTIONS.register(name, timed(ALL_ATTENTION_FUNCTIONS[name]))


def build(args, implementation):
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.heads * args.head_dim, intermediate_size=5504,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation)
    return model.eval()


def run(model, prompt, steps):
    """Prefill and decode: (prefill s, attention s in it, decode s, attention s in it, tokens)."""
    SPENT["attention"] = 0.0
    cache = transformers.DynamicCache(config=model.config)
    start = time.perf_counter()
    out = model(prompt, cache=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - start
    prefill_attention = SPENT["attention"]
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    generated = [token]
    SPENT["attention"] = 0.0
    start = time.perf_counter()
    for _ in range(steps - 1):
        out = model(token, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(token)
    decode = time.perf_counter() - start
    return prefill, prefill_attention, decode, SPENT["attention"], torch.cat(generated, dim=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--only", default="eager,sdpa,flex_attention,posenc")
    parser.add_argument("--format", choices=["text", "json"], default="text")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    instrument()
    prompt = torch.randint(3, 32000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    rows, reference = [], None
    with torch.no_grad():
        for implementation in args.only.split(","):
            model = build(args, implementation)
            if implementation == "flex_attention":
                run(model, prompt, 4)  # compiles the prefill's and (dynamic) decode's shapes, outside the timings
            prefill, prefill_attention, decode, decode_attention, tokens = run(model, prompt, args.steps)
            if reference is None:
                reference = tokens
            rows.append({
                "implementation": implementation,
                "prefill_tokens_per_s": args.prompt / prefill, "prefill_attention_share": prefill_attention / prefill,
                "decode_tokens_per_s": (args.steps - 1) / decode, "decode_attention_share": decode_attention / decode,
                "tokens_differing_from_first": int((tokens != reference).sum()),
            })
    if args.format == "json":
        print(json.dumps({"args": vars(args), "torch": torch.__version__, "transformers": transformers.__version__,
                          "rows": rows}, indent=1))
        return
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads; "
          f"{args.layers} layers, {args.heads} heads of {args.head_dim} over {args.kv_heads} KV heads, "
          f"prefill {args.prompt}, {args.steps} decode steps")
    print(f"{'implementation':<16}{'prefill tok/s':>14}{'attention s':>12}{'share':>7}{'decode tok/s':>14}"
          f"{'attention ms':>14}{'share':>7}{'tokens differing':>18}")
    for r in rows:
        prefill_attention = r["prefill_attention_share"] * args.prompt / r["prefill_tokens_per_s"]
        step_attention = 1000 * r["decode_attention_share"] / r["decode_tokens_per_s"]
        print(f"{r['implementation']:<16}{r['prefill_tokens_per_s']:>14.1f}{prefill_attention:>12.3f}"
              f"{r['prefill_attention_share']:>7.1%}{r['decode_tokens_per_s']:>14.2f}{step_attention:>14.2f}"
              f"{r['decode_attention_share']:>7.1%}{r['tokens_differing_from_first']:>18d}")

if __name__ == "__main__":
    main()
