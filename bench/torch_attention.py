#!/usr/bin/env python3
"""posenc.attention against eager PyTorch with a materialised bias, forward + backward, in one run.

q, k, v [1, S, H, D] f32 (S = 2048, H = 8, D = 128 by default), causal, with ALiBi or T5:
  eager   what a model without a fused kernel does: scores = q·kᵀ·scale + bias [H, S, S]
          (materialised by posenc's own bias op, so that only the attention differs) + causal
          mask, softmax, ·v; backward through autograd; the bias's parameters learn too
  posenc  posenc.attention(q, k, v, ALiBi / T5RelativeBias module, causal=True)
Each variant runs in its own process: the best of --reps forward + backward steps, and the peak
resident memory above the inputs (ru_maxrss after the steps minus before). The BLAS torch was built
with is printed.

    PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python bench/torch_attention.py --threads 2
"""
import argparse
import json
import math
import re
import resource
import subprocess
import sys
import time

import torch

import posenc


def loaded_blas():
    """The BLAS torch was built with (PyPI's x86 wheels: MKL, linked into libtorch_cpu)."""
    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return blas.group(1) if blas else "unknown"


def scheme_module(name, heads):
    if name == "alibi":
        return posenc.ALiBi(heads, trainable=True)
    module = posenc.T5RelativeBias(heads, num_buckets=32, max_distance=128, bidirectional=False)
    with torch.no_grad():
        module.table.normal_()
    return module


def eager_step(q, k, v, module, positions):
    s, d = q.shape[1], q.shape[3]
    bias = module(positions)  # [1, H, S, S], differentiable in the module's parameters
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d) + bias
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    out.sum().backward()


def posenc_step(q, k, v, module, positions):
    out = posenc.attention(q, k, v, module, causal=True)
    out.sum().backward()


def run_variant(args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = (1, args.seq, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    module = scheme_module(args.scheme, args.heads)
    positions = torch.arange(args.seq)
    step = eager_step if args.variant == "eager" else posenc_step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step(q, k, v, module, positions)
    best = math.inf
    for _ in range(args.reps):
        for t in (q, k, v, *module.parameters()):
            t.grad = None
        start = time.perf_counter()
        step(q, k, v, module, positions)
        best = min(best, time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": best, "extra_bytes": peak - before, "blas": loaded_blas()}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--scheme", choices=["alibi", "t5", "both"], default="both")
    parser.add_argument("--variant", choices=["eager", "posenc"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        run_variant(args)
        return
    flops = 2.5 * 2 * args.seq * args.seq * args.head_dim * args.heads + 2 * args.seq * args.seq * args.head_dim * args.heads
    print(f"torch {torch.__version__}, {args.threads} thread(s); q, k, v [1, {args.seq}, {args.heads}, "
          f"{args.head_dim}] f32, causal; forward + backward (~{flops / 1e9:.1f} GFLOP counted causally)")
    for scheme in (["alibi", "t5"] if args.scheme == "both" else [args.scheme]):
        results = {}
        for variant in ("eager", "posenc"):
            command = [sys.executable, __file__, "--variant", variant, "--scheme", scheme] + \
                      [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ("seq", "heads", "head_dim", "threads", "reps")]
            results[variant] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        print(f"  {scheme}: BLAS {results['eager']['blas']}")
        for variant, r in results.items():
            print(f"    {variant:7s} {r['seconds'] * 1e3:9.1f} ms  {flops / r['seconds'] / 1e9:6.1f} GFLOP/s  "
                  f"peak memory +{r['extra_bytes'] / 2**20:7.1f} MiB")
        e, p = results["eager"], results["posenc"]
        print(f"    posenc is {e['seconds'] / p['seconds']:.1f}x faster and uses "
              f"{p['extra_bytes'] / max(e['extra_bytes'], 1):.2f} of eager's extra memory")


if __name__ == "__main__":
    main()
