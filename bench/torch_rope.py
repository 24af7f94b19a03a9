#!/usr/bin/env python3
"""posenc.rope against the PyTorch formulations users write, in one run, on Llama-3-8B's shapes.

q [1, 4096, 32, 128] and k [1, 4096, 8, 128] f32, half-split pairs, positions 0..4095:
  rotate_half   Hugging Face's tutorial form: x·cos + rotate_half(x)·sin, cos/sin from an fp32
                angle table built each call (as the model's rotary module does)
  complex       Meta's original form: view_as_complex(x) · polar(1, θ), θ precomputed
  posenc        posenc.rope(q, k, positions) (exact fp64 angles, one pass over q and k)
Each is timed as the best of --reps runs, with fresh output tensors each call, and the BLAS torch
uses is printed (it does not matter for these element-wise forms).

    PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python bench/torch_rope.py --threads 2
"""
import argparse
import math
import re
import time

import torch

import posenc


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rope(q, k, positions, base=10000.0):
    dim = q.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def complex_rope(q, k, rotation):
    qc = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2))
    kc = torch.view_as_complex(k.reshape(*k.shape[:-1], -1, 2))
    return torch.view_as_real(qc * rotation).flatten(-2), torch.view_as_real(kc * rotation).flatten(-2)


def best_of(fn, reps):
    fn()
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    q = torch.randn(1, args.seq, args.heads, args.head_dim)
    k = torch.randn(1, args.seq, args.kv_heads, args.head_dim)
    positions = torch.arange(args.seq, dtype=torch.long)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    rotation = torch.polar(torch.ones(args.seq, args.head_dim // 2), positions.float()[:, None] * inv_freq)[None, :, None, :]
    bytes_moved = 2 * (q.numel() + k.numel()) * 4
    times = {
        "rotate_half": best_of(lambda: hf_rope(q, k, positions), args.reps),
        "complex": best_of(lambda: complex_rope(q, k, rotation), args.reps),
        "posenc": best_of(lambda: posenc.rope(q, k, positions), args.reps),
    }
    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    print(f"torch {torch.__version__}, {args.threads} thread(s); BLAS {blas.group(1) if blas else 'unknown'}")
    print(f"q [1, {args.seq}, {args.heads}, {args.head_dim}], k [1, {args.seq}, {args.kv_heads}, {args.head_dim}] f32")
    for name, seconds in times.items():
        print(f"  {name:12s} {seconds * 1e3:8.2f} ms  {bytes_moved / seconds / 1e9:6.2f} GB/s  "
              f"posenc is {seconds / times['posenc']:.1f}x faster")


if __name__ == "__main__":
    main()
