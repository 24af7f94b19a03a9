"""Ring attention (posenc.distributed.ring_attention) across gloo processes on loopback: the
bytes each rank sends per ring step and the time split between posenc's kernels and waiting for
the ring, forward and backward, beside the ring's own limit measured in the same run (the same
blocks passed round with no attention).

    PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python bench/ring_attention.py --world 4 --seq 16384
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import posenc
from posenc.distributed import ring_attention, stats, zigzag_indices


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(rank)
    index = zigzag_indices(args.seq, rank, args.world)
    s = index.numel()
    q = torch.randn(1, s, args.heads, args.head_dim, generator=gen, requires_grad=True)
    k = torch.randn(1, s, args.kv_heads, args.head_dim, generator=gen, requires_grad=True)
    v = torch.randn(1, s, args.kv_heads, args.head_dim, generator=gen, requires_grad=True)
    scheme = posenc.RotaryPositionalEncoding(args.head_dim) if args.scheme == "rope" else args.scheme
    rows = []
    for _ in range(args.rounds):
        dist.barrier()
        start = time.perf_counter()
        out = ring_attention(q, k, v, scheme, positions=index, causal=True)
        forward = (time.perf_counter() - start, stats.compute_seconds, stats.wait_seconds, stats.bytes_sent, stats.steps)
        stats.reset()
        dist.barrier()
        start = time.perf_counter()
        out.sum().backward()
        backward = (time.perf_counter() - start, stats.compute_seconds, stats.wait_seconds, stats.bytes_sent, stats.steps)
        rows.append((forward, backward))
    # The ring alone: the forward's blocks (k, v, positions) passed round world − 1 times.
    block = [k.detach(), v.detach(), index]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.world - 1):
        received = [torch.empty_like(t) for t in block]
        ops = [dist.P2POp(dist.isend, t, (rank + 1) % args.world) for t in block]
        ops += [dist.P2POp(dist.irecv, r, (rank - 1) % args.world) for r in received]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        block = received
    ring_only = time.perf_counter() - start
    torch.save({"rows": rows, "ring_only": ring_only, "block_bytes": sum(t.numel() * t.element_size() for t in block)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--scheme", default="rope")
    parser.add_argument("--threads", type=int, default=1, help="per process")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="/tmp/posenc-ring-bench")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mp.start_processes(worker, args=(args, free_port(), args.out), nprocs=args.world, start_method="fork")
    results = [torch.load(os.path.join(args.out, f"rank{r}.pt")) for r in range(args.world)]
    print(f"ring attention, {args.world} processes (gloo, loopback, {args.threads} thread each, {os.cpu_count()} cores), "
          f"S = {args.seq} causal (zigzag), H = {args.heads}, G = {args.kv_heads}, D = {args.head_dim}, {args.scheme}, "
          "the last round")
    # Causal attention over the whole sequence: Q·Kᵀ and P·V, 2 flops per multiply-add, half the
    # pairs; backward recomputes Q·Kᵀ and forms dV, dP, dQ, dK: 2.5 times the forward's.
    flops = 2 * 2 * args.seq * args.seq * args.heads * args.head_dim / 2
    print("| rank | pass | wall s | in kernels | waiting | sent per step | sent in all | ring steps |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    walls = {"forward": 0.0, "backward": 0.0}
    for r, result in enumerate(results):
        for name, (wall, compute, wait, sent, steps) in zip(("forward", "backward"), result["rows"][-1]):
            walls[name] = max(walls[name], wall)
            print(f"| {r} | {name} | {wall:.3f} | {compute / wall:.0%} | {wait / wall:.1%} | "
                  f"{sent / max(steps, 1) / 2**20:.1f} MiB | {sent / 2**20:.0f} MiB | {steps} |")
    print(f"whole ring: forward {flops / walls['forward'] / 1e9:.0f} GFLOP/s, backward "
          f"{2.5 * flops / walls['backward'] / 1e9:.0f} GFLOP/s (the slowest rank's wall time)")
    ring = max(r["ring_only"] for r in results)
    sent = results[0]["rows"][-1][0][3]
    print(f"the ring alone (the forward's blocks, {args.world - 1} hops, no attention): {ring:.3f} s, "
          f"{results[0]['block_bytes'] * (args.world - 1) / ring / 1e9:.2f} GB/s per rank; the forward used "
          f"{sent / walls['forward'] / 1e9:.3f} GB/s of it")


if __name__ == "__main__":
    main()
