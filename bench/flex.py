#!/usr/bin/env python3
"""posenc.flex against its peers, in one run, as FLOP/s and as a ratio to the peer.

--device cpu (forward, causal, f32, B1 S2048 H8 D128, --threads): for each scheme, posenc's fused
kernel against posenc.flex on compiled FlexAttention (the same scheme through torch's CPU
template), median of --reps alternating rounds.

--device cuda (forward and backward, causal, bf16, B1 S8192 H16 D128): ALiBi through posenc.flex
(its table of b_h(r) from the library), through FlexAttention with a hand-written score_mod
(slope·(kv − q), attention-gym's form), and through F.scaled_dot_product_attention with the bias
materialised as a [1, H, S, S] mask; then the other schemes through posenc.flex. Causal FLOPs:
4·B·H·S²·D/2 forward, 2.5× that for forward and backward.

    PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python bench/flex.py --device cpu --threads 2
"""
import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

import posenc
import posenc.flex

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def schemes(heads, head_dim, device):
    fire = posenc.FIRE(heads).to(device)
    return {
        "none": None,
        "rope": "rope",
        "alibi": "alibi",
        "t5": posenc.T5RelativeBias(heads).to(device),
        "kerple": posenc.Kerple(heads).to(device),
        "fire": fire,
    }


def timed(fn, sync):
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def cpu(args):
    torch.set_num_threads(args.threads)
    b, s, h, g, d = 1, args.seq or 2048, 8, 8, 128
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, g, d), torch.randn(b, s, g, d)
    flops = 4 * b * h * s * s * d / 2
    print(f"posenc.flex on the CPU: causal forward, f32, B{b} S{s} H{h} D{d}, {args.threads} threads, "
          f"median of {args.reps} alternating rounds")
    print(f"{'scheme':8s} {'fused ms':>9s} {'flex ms':>9s} {'fused GFLOP/s':>14s} {'flex GFLOP/s':>13s} "
          f"{'flex time / fused':>17s}")
    with torch.no_grad():
        for name, scheme in schemes(h, d, "cpu").items():
            fused = lambda: posenc.attention(q, k, v, scheme, causal=True)  # noqa: E731
            flex = lambda: posenc.flex.attention(q, k, v, scheme, causal=True)  # noqa: E731
            flex()  # compiles
            times = {"fused": [], "flex": []}
            for _ in range(args.reps):
                times["fused"].append(timed(fused, lambda: None))
                times["flex"].append(timed(flex, lambda: None))
            a, f = statistics.median(times["fused"]), statistics.median(times["flex"])
            print(f"{name:8s} {a * 1e3:9.1f} {f * 1e3:9.1f} {flops / a / 1e9:14.1f} {flops / f / 1e9:13.1f} "
                  f"{f / a:17.2f}")


def cuda(args):
    device = torch.device("cuda")
    b, s, h, d = 1, args.seq or 8192, 16, 128
    dtype = torch.bfloat16

    def fresh():
        return [torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]

    q, k, v = fresh()
    grad = torch.randn(b, s, h, d, device=device, dtype=dtype)
    slopes = posenc.alibi_slopes(h).to(device, torch.float32)
    compiled = torch.compile(torch_flex.flex_attention)
    causal = torch_flex.create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s, device=device)

    def alibi_mod(score, b_, h_, qi, ki):
        return score + slopes[h_] * (ki - qi).to(torch.float32)

    def hand_written():
        return compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=alibi_mod,
                        block_mask=causal).transpose(1, 2)

    positions = torch.arange(s, device=device)
    bias = (slopes[:, None, None] * (positions[None, None, :] - positions[None, :, None])).to(dtype)
    bias = bias.masked_fill(positions[None, None, :] > positions[None, :, None], float("-inf"))[None]

    def sdpa():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=bias).transpose(1, 2)

    def flex_of(scheme):
        return lambda: posenc.attention(q, k, v, scheme, causal=True, backend="flex")

    runs = {"posenc.flex alibi": flex_of("alibi"), "flex hand-written alibi": hand_written,
            "sdpa materialised alibi": sdpa}
    for name, scheme in schemes(h, d, device).items():
        if name != "alibi":
            runs[f"posenc.flex {name}"] = flex_of(scheme)
    flops = {"fwd": 4 * b * h * s * s * d / 2, "fwd+bwd": 2.5 * 4 * b * h * s * s * d / 2}
    name_of_gpu = torch.cuda.get_device_name()
    print(f"posenc.flex on {name_of_gpu}: causal, bf16, B{b} S{s} H{h} D{d}, median of {args.reps} alternating rounds")
    times = {(n, m): [] for n in runs for m in flops}
    for fn in runs.values():  # compile and warm every kernel first
        fn().backward(grad)
    for _ in range(args.reps):
        for n, fn in runs.items():
            with torch.no_grad():
                times[(n, "fwd")].append(timed(fn, torch.cuda.synchronize))
            times[(n, "fwd+bwd")].append(timed(lambda: fn().backward(grad), torch.cuda.synchronize))
    peer = {m: statistics.median(times[("flex hand-written alibi", m)]) for m in flops}
    print(f"{'run':26s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'vs hand':>8s} {'fwd+bwd ms':>11s} {'TFLOP/s':>8s} "
          f"{'vs hand':>8s}")
    for n in runs:
        row = f"{n:26s}"
        for m in flops:
            t = statistics.median(times[(n, m)])
            row += f" {t * 1e3:{8 if m == 'fwd' else 11}.2f} {flops[m] / t / 1e12:8.1f} {peer[m] / t:8.2f}"
        print(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=0, help="sequence length (0: the device's default)")
    args = parser.parse_args()
    (cpu if args.device == "cpu" else cuda)(args)


if __name__ == "__main__":
    main()
