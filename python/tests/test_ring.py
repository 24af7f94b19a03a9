"""posenc.distributed.ring_attention with 2 and 4 gloo processes on loopback: the forward and every
gradient (q, k, v, the scheme's parameters, sinks) equal one process's posenc.attention over the
whole sequence, for causal (zigzag layout) and bidirectional (contiguous slices) attention, GQA,
RoPE, ALiBi, T5, Kerple, FIRE, Shaw, Transformer-XL, TUPE, head groups, sinks, chunked attention
and packed sequences; bad input is refused.

Tolerance: fp32 results of O(1) whose sums run in another order (blocks merged through their
log-sum-exp in fp64, the whole sequence in tiles): 2e-5 absolute, about 100 ulps; the parameters'
gradients sum O(S·H) terms: 1e-4 relative."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import posenc
from posenc.distributed import ring_attention, zigzag_indices, zigzag_shard


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_scheme(name, heads, head_dim):
    torch.manual_seed(11)
    if name == "rope":
        return posenc.RotaryPositionalEncoding(head_dim)
    if name == "alibi":
        return posenc.ALiBi(heads, trainable=True)
    if name == "t5":
        t5 = posenc.T5RelativeBias(heads, num_buckets=16, max_distance=64, bidirectional=True)
        torch.nn.init.normal_(t5.table, std=0.3)
        return t5
    if name == "kerple":
        return posenc.Kerple(heads)
    if name == "fire":
        return posenc.FIRE(heads, hidden=8)
    if name == "shaw":
        return posenc.ShawRelativePositions(8, head_dim, std=0.3)
    if name == "xl":
        return posenc.TransformerXLRelative(heads, head_dim, 32, std=0.3)
    if name == "tupe":
        return posenc.TUPE(heads, head_dim, 32, 512, std=0.3)
    if name == "groups":
        return [(2, posenc.RotaryPositionalEncoding(head_dim)), (2, posenc.ALiBi(2, trainable=True))]
    return None


CASES = [  # (scheme, causal, sinks, chunk_size)
    ("rope", True, False, None), ("alibi", True, True, None), ("t5", False, False, None), ("kerple", True, False, None),
    ("fire", True, False, None), ("groups", True, True, None), (None, False, True, None), ("rope", True, False, 24),
    ("shaw", True, False, None), ("xl", False, False, None), ("tupe", True, False, None),
]


def parameters_of(scheme):
    modules = [s for _, s in scheme] if isinstance(scheme, list) else [scheme]
    return [p for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters()]


def inputs(seq, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, seq, heads, dim, generator=gen)
    k = torch.randn(2, seq, kv_heads, dim, generator=gen)
    v = torch.randn(2, seq, kv_heads, dim, generator=gen)
    w = torch.randn(2, seq, heads, dim, generator=gen)  # the loss Σ w·out
    sinks = torch.randn(heads, generator=gen)
    return q, k, v, w, sinks


def packing(seq):
    """Packed sequences of 37, 50 and 5 tokens and the rest: each token's sequence and position."""
    lengths = [37, 50, 5, seq - 92]
    ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    return lengths, ids, positions


def worker(rank, world, port, out_dir, seq):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for name, causal, with_sinks, chunk in CASES:
        q, k, v, w, sinks = inputs(seq, 4, 2, 16)
        scheme = make_scheme(name, 4, 16)
        # Causal: the zigzag layout (two chunks per rank); bidirectional: contiguous slices.
        index = zigzag_indices(seq, rank, world) if causal else torch.arange(rank * seq // world,
                                                                              (rank + 1) * seq // world)
        ql, kl, vl = (x[:, index].clone().requires_grad_() for x in (q, k, v))
        sink = sinks.clone().requires_grad_() if with_sinks else None
        out = ring_attention(ql, kl, vl, scheme, positions=index, causal=causal, chunk_size=chunk, sinks=sink)
        (out * w[:, index]).sum().backward()
        results[(name, causal, with_sinks, chunk)] = {
            "index": index, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
            "params": [p.grad.clone() for p in parameters_of(scheme)], "sinks": None if sink is None else sink.grad,
            "bytes": posenc.distributed.stats.bytes_sent}
    # Packed sequences across the ranks (zigzag cuts them), ALiBi with sinks, GQA.
    q, k, v, w, sinks = inputs(seq, 4, 2, 16)
    _, ids, positions = packing(seq)
    index = zigzag_indices(seq, rank, world)
    ql, kl, vl = (x[:, index].clone().requires_grad_() for x in (q, k, v))
    sink = sinks.clone().requires_grad_()
    scheme = make_scheme("alibi", 4, 16)
    out = ring_attention(ql, kl, vl, scheme, positions=positions[index], sequence_ids=ids[index], sinks=sink)
    (out * w[:, index]).sum().backward()
    results["packed"] = {"index": index, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                         "params": [scheme.slopes.grad.clone()], "sinks": sink.grad}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_one_process(tmp_path, world):
    seq = 48 * world
    mp.start_processes(worker, args=(world, free_port(), str(tmp_path), seq), nprocs=world, start_method="fork")
    ranks = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(world)]
    for name, causal, with_sinks, chunk in CASES:
        key = (name, causal, with_sinks, chunk)
        q, k, v, w, sinks = inputs(seq, 4, 2, 16)
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        scheme = make_scheme(name, 4, 16)
        sink = sinks.clone().requires_grad_() if with_sinks else None
        out = posenc.attention(q, k, v, scheme, causal=causal, chunk_size=chunk, sinks=sink)
        (out * w).sum().backward()
        params = [p.grad for p in parameters_of(scheme)]
        for r, result in enumerate(ranks):
            got = result[key]
            index = got["index"]
            where = f"{key}, rank {r} of {world}"
            for part, want in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
                torch.testing.assert_close(got[part], want[:, index], atol=2e-5, rtol=0, msg=f"{part}: {where}")
            for got_p, want_p in zip(got["params"], params):
                torch.testing.assert_close(got_p, want_p, rtol=1e-4, atol=1e-5, msg=f"parameters: {where}")
            if with_sinks:
                torch.testing.assert_close(got["sinks"], sink.grad, rtol=1e-4, atol=1e-5, msg=f"sinks: {where}")
            # Forward and backward: world − 1 hops of k, v, positions and sequence ids each;
            # backward also world hops of dk, dv. One of k, v, dk, dv: S·B·G·D fp32 values.
            kv = index.numel() * 2 * 2 * 16 * 4
            assert got["bytes"] == 2 * (world - 1) * (2 * kv + index.numel() * 16) + world * 2 * kv, where


    # Packed: one process attends within each sequence, one call per sequence.
    q, k, v, w, sinks = inputs(seq, 4, 2, 16)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    sink = sinks.clone().requires_grad_()
    scheme = make_scheme("alibi", 4, 16)
    lengths, _, _ = packing(seq)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    out = torch.cat([posenc.attention(q[:, a:a + n], k[:, a:a + n], v[:, a:a + n], scheme, causal=True, sinks=sink)
                     for a, n in zip(starts, lengths)], 1)
    (out * w).sum().backward()
    for r, result in enumerate(ranks):
        got, index = result["packed"], result["packed"]["index"]
        for part, want in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            torch.testing.assert_close(got[part], want[:, index], atol=2e-5, rtol=0, msg=f"packed {part}, rank {r}")
        torch.testing.assert_close(got["params"][0], scheme.slopes.grad, rtol=1e-4, atol=1e-5, msg=f"packed, rank {r}")
        torch.testing.assert_close(got["sinks"], sink.grad, rtol=1e-4, atol=1e-5, msg=f"packed sinks, rank {r}")


def test_zigzag_layout():
    assert zigzag_indices(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    x = torch.arange(16).view(1, 16)
    assert sorted(torch.cat([zigzag_shard(x, r, 4) for r in range(4)], 1).flatten().tolist()) == list(range(16))
    with pytest.raises(ValueError, match="length = 10"):
        zigzag_indices(10, 0, 2)
    with pytest.raises(ValueError, match="rank = 2"):
        zigzag_indices(8, 2, 2)


def refusing_worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    q = torch.randn(1, 8, 2, 8)
    messages = []
    for call in (lambda: ring_attention(q, q, q, posenc.Forgetting(torch.zeros(1, 8, 2)), positions=torch.arange(8)),
                 lambda: ring_attention(q, q, q, "rope", positions=torch.arange(8 if rank == 0 else 7)),
                 lambda: ring_attention(q, q, q, "rope", positions=torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]) + 8 * rank
                                        if rank else torch.tensor([0, 1, 2, 3, 6, 7, 8, 9]))):
        try:
            call()
            messages.append("no error")
        except (ValueError, TypeError) as e:
            messages.append(str(e))
    torch.save(messages, os.path.join(out_dir, f"refused{rank}.pt"))
    dist.destroy_process_group()


def test_ring_attention_refuses_what_it_cannot_split(tmp_path):
    mp.start_processes(refusing_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="fork")
    messages = [torch.load(os.path.join(tmp_path, f"refused{rank}.pt")) for rank in range(2)]
    assert all("Forgetting" in m[0] for m in messages)
    # One rank's bad positions: it names them, the other is told instead of waiting in the ring.
    assert "another rank's input was refused" in messages[0][1]
    assert "positions must be an int64 tensor [S]" in messages[1][1]
    assert all("partly overlap" in m[2] for m in messages)
