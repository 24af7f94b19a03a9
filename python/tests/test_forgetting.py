"""Forgetting Attention from Python: the fused op against an eager float64 composition (FLA's
naive form: a running sum of log f, its differences as a bias, a causal softmax), gradients
through torch autograd, head groups, FoX Pro, and errors."""
import pytest
import torch
import torch.nn.functional as F

import posenc


def eager(q, k, v, log_fgate, scale=None, rope=False):
    """softmax(scale·q·kᵀ + c_i − c_j, causal)·v in float64 with c = cumsum(log f); q [B, Sq, H, D]."""
    q, k, v, lf = (t.double() for t in (q, k, v, log_fgate))
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    if rope:
        q = posenc.rope(q, positions=torch.arange(sk - sq, sk))[0]
        k = posenc.rope(k, positions=torch.arange(sk))[0]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    c = lf.cumsum(dim=1)                                   # [B, Sk, H]
    cq = c[:, sk - sq:]                                    # the queries' own tokens
    bias = cq.permute(0, 2, 1)[..., :, None] - c.permute(0, 2, 1)[..., None, :]   # [B, H, Sq, Sk]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or d ** -0.5) + bias
    mask = torch.arange(sk)[None, :] > (torch.arange(sq)[:, None] + sk - sq)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def inputs(b=2, sq=70, sk=70, h=4, g=2, d=32, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, g, d, dtype=dtype)
    v = torch.randn(b, sk, g, d, dtype=dtype)
    lf = F.logsigmoid(torch.rand(b, sk, h, dtype=torch.float32) * 5 - 1)
    return q, k, v, lf


@pytest.mark.parametrize("sq", [70, 1, 23])
def test_matches_the_eager_composition(sq):
    q, k, v, lf = inputs(sq=sq)
    got = posenc.forgetting_attention(q, k, v, lf)
    want = eager(q, k, v, lf)
    # f32 math against float64: the fused kernel's error, within flash-attention's budget at these sizes.
    assert (got.double() - want).abs().max().item() < 2e-5


def test_gradients_match_autograd_through_the_composition():
    q, k, v, lf = inputs(b=1, sq=40, sk=40)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, lf)]
    out = posenc.forgetting_attention(*leaves)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, lf)]
    eager(*ref_leaves).backward(d_out.double())
    for name, a, b in zip(("q", "k", "v", "log_fgate"), leaves, ref_leaves):
        err = (a.grad.double() - b.grad).abs().max().item()
        assert err < 1e-4 * max(1.0, b.grad.abs().max().item()), name


def test_float64_runs_the_reference_and_passes_gradcheck():
    q, k, v, lf = (t.double() for t in inputs(b=1, sq=6, sk=6, h=2, g=1, d=4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, lf)]
    assert torch.autograd.gradcheck(lambda *a: posenc.forgetting_attention(*a), leaves)


def test_fox_pro_and_head_groups():
    q, k, v, lf = inputs(h=4, g=2)
    pro = posenc.attention(q, k, v, posenc.Forgetting(lf, base="rope"), causal=True)
    assert (pro.double() - eager(q, k, v, lf, rope=True)).abs().max().item() < 2e-5
    # Two groups of two heads: forget gates on the first, ALiBi on the second, as separate calls give.
    both = posenc.attention(q, k, v, [(2, posenc.Forgetting(lf[:, :, :2])), (2, "alibi")], causal=True)
    first = posenc.forgetting_attention(q[:, :, :2].contiguous(), k[:, :, :1].contiguous(), v[:, :, :1].contiguous(),
                                        lf[:, :, :2].contiguous())
    second = posenc.attention(q[:, :, 2:].contiguous(), k[:, :, 1:].contiguous(), v[:, :, 1:].contiguous(), "alibi",
                              causal=True)
    assert torch.equal(both[:, :, :2], first) and torch.equal(both[:, :, 2:], second)


def test_errors_name_the_argument():
    q, k, v, lf = inputs()
    with pytest.raises(ValueError, match="log_fgate"):
        posenc.forgetting_attention(q, k, v, lf.abs() + 0.5)
    with pytest.raises(ValueError, match="causal"):
        posenc.attention(q, k, v, posenc.Forgetting(lf))
    with pytest.raises(ValueError, match="heads"):
        posenc.attention(q, k, v, [(2, posenc.Forgetting(lf)), (2, None)], causal=True)
    with pytest.raises(ValueError, match="log_fgate"):
        posenc.forgetting_attention(q, k, v, lf[:1])
    with pytest.raises(ValueError, match="log_fgate"):
        posenc.Forgetting(lf[0, 0])
    with pytest.raises(ValueError, match="log_fgate"):  # the packed form [Tk, heads] without cu_seqlens
        posenc.forgetting_attention(q, k, v, lf[0])
    with pytest.raises(TypeError, match="log_fgate"):
        posenc.Forgetting([0.0])
