"""Attention sinks from Python: posenc.attention(..., sinks=) against transformers' gpt-oss eager
form in float64 (the sink as an extra score column, dropped after the softmax), gradients through
torch autograd and gradcheck, and errors."""
import pytest
import torch

import posenc


def eager(q, k, v, sinks, causal=True, window=-1):
    """gpt-oss's eager attention with sinks, float64; q [B, Sq, H, D], k, v [B, Sk, G, D]."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    hidden = (j > i) if causal else torch.zeros(sq, sk, dtype=torch.bool)
    if window >= 0:
        hidden = hidden | (j < i - window)
    scores = scores.masked_fill(hidden, float("-inf"))
    column = sinks.reshape(1, h, 1, 1).expand(b, h, sq, 1)
    probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def inputs(b=2, sq=50, sk=50, h=4, g=2, d=32, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(b, sq, h, d), torch.randn(b, sk, g, d), torch.randn(b, sk, g, d), torch.randn(h) + 1)


@pytest.mark.parametrize("sq,causal,window", [(50, True, -1), (50, False, -1), (1, True, -1), (50, True, 7)])
def test_matches_gpt_oss_eager_attention(sq, causal, window):
    q, k, v, s = inputs(sq=sq)
    got = posenc.attention(q, k, v, causal=causal, window=(window, -1), sinks=s)
    assert (got.double() - eager(q, k, v, s, causal, window)).abs().max().item() < 2e-5


def test_gradients_match_autograd_and_gradcheck():
    q, k, v, s = inputs(b=1, sq=30, sk=30)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, s)]
    out = posenc.attention(*leaves[:3], "alibi", causal=True, sinks=leaves[3])
    d_out = torch.randn_like(out)
    out.backward(d_out)
    slopes = posenc.alibi_slopes(4).double()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, s)]
    qd, kd, vd, sd = ref
    # ALiBi as an extra bias on the eager scores: −m_h·(i − j).
    dist = (torch.arange(30)[:, None] - torch.arange(30)[None, :]).double()
    kr, vr = kd.repeat_interleave(2, dim=2), vd.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kr) * 32 ** -0.5 - slopes[:, None, None] * dist
    scores = scores.masked_fill(dist < 0, float("-inf"))
    probs = torch.cat([scores, sd.reshape(1, 4, 1, 1).expand(1, 4, 30, 1)], -1).softmax(-1)[..., :-1]
    torch.einsum("bhqk,bkhd->bqhd", probs, vr).backward(d_out.double())
    for name, a, b in zip(("q", "k", "v", "sinks"), leaves, ref):
        assert (a.grad.double() - b.grad).abs().max().item() < 1e-4 * max(1.0, b.grad.abs().max().item()), name
    small = [t.double().clone().requires_grad_() for t in inputs(b=1, sq=5, sk=5, h=2, g=1, d=4)]
    assert torch.autograd.gradcheck(lambda q, k, v, s: posenc.attention(q, k, v, causal=True, sinks=s), small)


def test_errors_name_the_argument():
    q, k, v, s = inputs()
    with pytest.raises(ValueError, match="sinks"):
        posenc.attention(q, k, v, sinks=s[:3])
    with pytest.raises(TypeError, match="sinks"):
        posenc.attention(q, k, v, sinks=[0.0] * 4)
    with pytest.raises(ValueError, match="logits"):
        posenc.attention(q, k, v, sinks=torch.full((4,), float("nan")))
