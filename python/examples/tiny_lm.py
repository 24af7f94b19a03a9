"""Trains a tiny byte-level language model made of posenc.nn.SelfAttention layers for a few
seconds, then generates from it with a posenc.KVCache per layer, one byte per step, and checks
that every cached step gives the logits of recomputing the whole sequence.

    PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python python/examples/tiny_lm.py --seconds 10 --scheme rope
"""
import argparse
import os
import sys
import time

import torch

from posenc.nn import SelfAttention


class Block(torch.nn.Module):
    def __init__(self, dim, heads, scheme):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, kv_heads=heads // 2, scheme=scheme)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x, cache=None):
        x = x + self.attn(self.norm1(x), cache=cache)
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    def __init__(self, scheme, dim=64, heads=4, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, scheme) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 256)

    def forward(self, tokens, caches=None):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.norm(x))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="training time")
    parser.add_argument("--scheme", default="rope", help="a registered scheme name (posenc.schemes())")
    parser.add_argument("--corpus", default=os.path.join(here, "..", "..", "README.md"), help="a text file")
    parser.add_argument("--length", type=int, default=64, help="training length in bytes")
    parser.add_argument("--generate", type=int, default=120, help="bytes to generate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    with open(args.corpus, "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long)
    if data.numel() <= args.length + 1:
        sys.exit(f"tiny_lm: --corpus has {data.numel()} bytes; expected more than --length + 1 = {args.length + 1}")

    model = TinyLM(args.scheme)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start, steps = time.monotonic(), 0
    while time.monotonic() - start < args.seconds:
        offsets = torch.randint(0, data.numel() - args.length - 1, (16,))
        batch = torch.stack([data[o:o + args.length + 1] for o in offsets.tolist()])
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    print(f"trained {steps} steps in {time.monotonic() - start:.1f} s ({args.scheme}): loss {loss.item():.3f} nats/byte")

    # Greedy generation, one byte per step through the caches; every step is checked against the
    # whole sequence recomputed without them.
    model.eval()
    prompt = list(b"The positional ")
    worst = 0.0
    with torch.no_grad():
        caches = [block.attn.make_cache(1, capacity=32) for block in model.blocks]
        logits = model(torch.tensor([prompt]), caches)[0, -1]
        tokens = list(prompt)
        for _ in range(args.generate):
            tokens.append(int(logits.argmax()))
            logits = model(torch.tensor([tokens[-1:]]), caches)[0, -1]
            whole = model(torch.tensor([tokens]))[0, -1]
            worst = max(worst, float((logits - whole).abs().max()))
    text = bytes(tokens).decode("utf-8", errors="replace")
    print(f"generated with posenc.KVCache: {text!r}")
    # fp32 logits of O(10): the cached and whole-sequence paths sum in different orders.
    print(f"largest |cached − recomputed| logit over {args.generate} steps: {worst:.2e}")
    if not worst < 1e-3:
        sys.exit("tiny_lm: cached generation differs from recomputation")


if __name__ == "__main__":
    main()
