#!/usr/bin/env python3
"""PyTorch eager baseline for the sinusoidal table, to compare with `posenc bench sinusoidal`.

The tutorial formulation (div_term = exp(arange(0, d, 2) * -ln(10000)/d); pe[:, 0::2] = sin(p * div);
pe[:, 1::2] = cos(p * div)), timed as the best of several runs.
Run with the set-up's environment (torch from PyPI):

    ~/.cache/posenc/venv-torch-2.15.0/bin/python bench/torch_sinusoidal.py --length 32768 --dim 1024 --threads 2
"""
import argparse
import math
import time

import torch


def tutorial_table(length: int, dim: int) -> torch.Tensor:
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(length, dim)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tutorial_table(args.length, args.dim)  # warm-up
    best = math.inf
    for _ in range(args.reps):
        start = time.perf_counter()
        tutorial_table(args.length, args.dim)
        best = min(best, time.perf_counter() - start)
    gbs = args.length * args.dim * 4 / best / 1e9
    print(f"torch {torch.__version__} tutorial table [{args.length}, {args.dim}] f32: "
          f"{best * 1e3:.1f} ms, {gbs:.2f} GB/s of output ({args.threads} threads)")


if __name__ == "__main__":
    main()
