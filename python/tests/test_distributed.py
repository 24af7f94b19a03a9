"""posenc's modules under torch.distributed (gloo, 2 processes on loopback):

- data parallel: a small attention model with RotaryPositionalEncoding, trainable ALiBi slopes and a
  T5RelativeBias, trained a few steps with DistributedDataParallel on two halves of a batch, ends
  with the parameters of the same training in one process on the whole batch;
- context parallel: a sequence split across the ranks, each rank holding its slice with its
  position offset, gives the same RoPE outputs and ALiBi/T5 bias rows as the unsplit sequence.
"""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import posenc

WORLD = 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TinyAttention(torch.nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)
        self.rope = posenc.RotaryPositionalEncoding(self.head_dim)
        self.alibi = posenc.ALiBi(heads, trainable=True)
        self.t5 = posenc.T5RelativeBias(heads, num_buckets=8, max_distance=16, bidirectional=False)
        torch.nn.init.normal_(self.t5.table, std=0.1)

    def forward(self, tokens):
        b, s = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        positions = torch.arange(s)
        q, k = self.rope(q, k, positions)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.head_dim ** 0.5
        scores = scores + self.alibi(positions) + self.t5(positions)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1))


def train(model, tokens, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()


def data_parallel_worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyAttention()
    tokens = torch.randint(0, 50, (4, 17), generator=torch.Generator().manual_seed(1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    train(ddp, tokens[rank * 2:(rank + 1) * 2])  # each rank half of the global batch
    torch.save(model.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def context_parallel_worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(2)
    seq, heads, dim = 12, 4, 16
    q = torch.randn(1, seq, heads, dim, generator=gen)
    table = torch.randn(32, heads, generator=gen)
    part = seq // WORLD
    positions = torch.arange(rank * part, (rank + 1) * part)  # this rank's slice, with its offset
    q_part, _ = posenc.rope(q[:, rank * part:(rank + 1) * part], None, positions)
    alibi_rows = posenc.alibi_bias(posenc.alibi_slopes(heads), positions, torch.arange(seq))
    t5_rows = posenc.t5_bias(table, positions, torch.arange(seq))
    gathered = [torch.empty_like(q_part) for _ in range(WORLD)]
    dist.all_gather(gathered, q_part.contiguous())
    alibi_all = [torch.empty_like(alibi_rows) for _ in range(WORLD)]
    dist.all_gather(alibi_all, alibi_rows.contiguous())
    t5_all = [torch.empty_like(t5_rows) for _ in range(WORLD)]
    dist.all_gather(t5_all, t5_rows.contiguous())
    if rank == 0:
        torch.save({"q": torch.cat(gathered, 1), "alibi": torch.cat(alibi_all, 2), "t5": torch.cat(t5_all, 2),
                    "inputs": (q, table)}, os.path.join(out_dir, "context.pt"))
    dist.destroy_process_group()


def run(worker, tmp_path):
    mp.start_processes(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, start_method="fork")


def test_data_parallel_matches_one_process(tmp_path):
    run(data_parallel_worker, tmp_path)
    torch.manual_seed(0)
    model = TinyAttention()
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    tokens = torch.randint(0, 50, (4, 17), generator=torch.Generator().manual_seed(1))
    train(model, tokens)
    # posenc's learned parameters did train (their gradients flow through the custom ops).
    for name in ("alibi.slopes", "t5.table"):
        assert not torch.equal(model.state_dict()[name], initial[name]), name
    for rank in range(WORLD):
        state = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        for name, value in model.state_dict().items():
            # fp32: the all-reduced average of two half-batch gradients equals the full batch's
            # mean gradient up to summation order (~1e-7 relative per step, 3 steps).
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} on rank {rank}")


def test_context_parallel_matches_the_whole_sequence(tmp_path):
    run(context_parallel_worker, tmp_path)
    saved = torch.load(os.path.join(tmp_path, "context.pt"))
    q, table = saved["inputs"]
    seq, heads = q.shape[1], q.shape[2]
    whole, _ = posenc.rope(q, None, torch.arange(seq))
    torch.testing.assert_close(saved["q"], whole, rtol=0, atol=0)
    positions = torch.arange(seq)
    torch.testing.assert_close(saved["alibi"], posenc.alibi_bias(posenc.alibi_slopes(heads), positions, positions), rtol=0, atol=0)
    torch.testing.assert_close(saved["t5"], posenc.t5_bias(table, positions, positions), rtol=0, atol=0)
