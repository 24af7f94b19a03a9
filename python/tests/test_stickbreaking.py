"""Stick-breaking attention from Python: the fused op against an eager float64 composition (the
authors' form: log σ of the logits plus a masked running sum of log(1 − σ) from the diagonal
leftwards), gradients through torch autograd for out and rem, GQA, packed sequences, decode,
layouts, dtypes and errors."""
import pytest
import torch
import torch.nn.functional as F

import posenc


def eager(q, k, v, scale=None, attend_current=False):
    """(out, rem) in float64; q [B, Sq, H, D], k, v [B, Sk, G, ·]; query i is token Sk − Sq + i."""
    q, k, v = (t.double() for t in (q, k, v))
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    z = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or d ** -0.5)
    token = torch.arange(sq)[:, None] + sk - sq
    seen = torch.arange(sk)[None, :] < token + (1 if attend_current else 0)      # [Sq, Sk]
    log_beta = F.logsigmoid(-z).masked_fill(~seen, 0.0)                          # log(1 − σ)
    # Σ over visible m > j of log(1 − σ(z_im)): a reversed cumulative sum minus the term itself.
    after = log_beta.flip(-1).cumsum(-1).flip(-1) - log_beta
    att = torch.exp(F.logsigmoid(z) + after).masked_fill(~seen, 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", att, v)
    rem = (1 - att.sum(-1)).permute(0, 2, 1)                                     # [B, Sq, H]
    return out, rem


def inputs(b=2, sq=70, sk=70, h=4, g=2, d=32, dv=None, dtype=torch.float32, seed=0, spread=1.0):
    torch.manual_seed(seed)
    q = (torch.randn(b, sq, h, d) * spread).to(dtype)
    k = (torch.randn(b, sk, g, d) * spread).to(dtype)
    v = torch.randn(b, sk, g, dv or d).to(dtype)
    return q, k, v


@pytest.mark.parametrize("sq,attend_current", [(70, False), (70, True), (1, False), (23, True)])
def test_matches_the_eager_composition_with_gradients(sq, attend_current):
    q, k, v = inputs(sq=sq)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, rem = posenc.stickbreaking_attention(q, k, v, attend_current=attend_current)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want_out, want_rem = eager(qd, kd, vd, attend_current=attend_current)
    assert out.dtype == torch.float32 and rem.shape == (2, sq, 4)
    # f32 logits and running sums against fp64: a few 1e-6 at |out| of a few units.
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(rem.double(), want_rem, atol=2e-6, rtol=1e-5)
    w_out, w_rem = torch.randn_like(want_out), torch.randn_like(want_rem)
    ((out.double() * w_out).sum() + (rem.double() * w_rem).sum()).backward()
    ((want_out * w_out).sum() + (want_rem * w_rem).sum()).backward()
    # f32 backward: G − Σ_{m>=j} g cancels; 1e-4 of the gradients' size covers it.
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_float64_runs_the_reference_and_passes_gradcheck():
    q, k, v = inputs(b=1, sq=6, sk=9, h=2, g=1, d=4, dv=3, dtype=torch.float64)
    for t in (q, k, v):
        t.requires_grad_(True)
    # rem is stored in float32 (its gradient is exact; its value rounds): check out alone, then
    # rem's part at a tolerance of its rounding.
    assert torch.autograd.gradcheck(lambda a, b, c: posenc.stickbreaking_attention(a, b, c)[0], (q, k, v))
    out, rem = posenc.stickbreaking_attention(q, k, v)
    want_out, want_rem = eager(q, k, v)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(rem.double(), want_rem, atol=1e-7, rtol=0)


# tol: one ulp of the dtype relative (bf16 2^-8, f16 2^-11), twice the half ulp a single rounding costs.
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
def test_sixteen_bit_inputs(dtype, tol):
    q, k, v = inputs(h=4, g=4, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, rem = posenc.stickbreaking_attention(q, k, v)
    assert out.dtype == dtype and rem.dtype == torch.float32
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want_out, want_rem = eager(qd, kd, vd)
    # The output rounds once to the dtype (half an ulp relative); f32 math adds ~1e-6 absolute.
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=tol)
    torch.testing.assert_close(rem.double(), want_rem, atol=1e-5, rtol=0)
    w = torch.randn_like(want_out).to(dtype).double()  # d_out reaches the op in the dtype: the same here
    (out.double() * w).sum().backward()
    (want_out * w).sum().backward()
    # The op keeps out in float32 for backward; the gradients round once to the dtype (rtol), and
    # the f32 sums cancel to 1e-4 of the gradients' size as in float32 (atol).
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4 * want.abs().max().item(), rtol=tol)


def test_layouts_packed_sequences_and_decode():
    q, k, v = inputs(b=1, sq=50, sk=50)
    out, rem = posenc.stickbreaking_attention(q, k, v)
    out_h, rem_h = posenc.stickbreaking_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  layout="bhsd")
    assert torch.equal(out_h.transpose(1, 2), out) and torch.equal(rem_h.transpose(1, 2), rem)
    # Decode: the last query alone against every key is the last row of the full call.
    last_out, last_rem = posenc.stickbreaking_attention(q[:, -1:], k, v)
    torch.testing.assert_close(last_out, out[:, -1:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(last_rem, rem[:, -1:], atol=1e-7, rtol=1e-6)
    # Packed: each sequence as its own call.
    lengths = [17, 1, 32]
    parts = [inputs(b=1, sq=n, sk=n, seed=i) for i, n in enumerate(lengths)]
    cu = [0, 17, 18, 50]
    pq, pk, pv = (torch.cat([p[i][0] for p in parts]) for i in range(3))
    p_out, p_rem = posenc.stickbreaking_attention(pq, pk, pv, cu_seqlens=torch.tensor(cu))
    assert p_out.shape == (50, 4, 32) and p_rem.shape == (50, 4)
    for (a, b_, c), lo, hi in zip(parts, cu[:-1], cu[1:]):
        o, r = posenc.stickbreaking_attention(a, b_, c)
        torch.testing.assert_close(p_out[lo:hi], o[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(p_rem[lo:hi], r[0], atol=1e-7, rtol=1e-6)


def test_the_remainder_is_differentiable_alone():
    q, k, v = inputs(b=1, sq=30, sk=30, h=2, g=1, d=16)
    q.requires_grad_(True)
    _, rem = posenc.stickbreaking_attention(q, k, v)
    rem.sum().backward()
    qd = q.detach().double().requires_grad_(True)
    eager(qd, k, v)[1].sum().backward()
    torch.testing.assert_close(q.grad.double(), qd.grad, atol=1e-4 * qd.grad.abs().max().item(), rtol=0)


def test_bad_input():
    q, k, v = inputs(b=1, sq=10, sk=8)
    with pytest.raises(ValueError, match="at most as many queries as keys"):
        posenc.stickbreaking_attention(q, k, v)
    q, k, v = inputs(b=1, sq=8, sk=8, h=3, g=2)
    with pytest.raises(ValueError, match="KV head count dividing"):
        posenc.stickbreaking_attention(q, k, v)
    q, k, v = inputs(b=1, sq=8, sk=8)
    with pytest.raises(TypeError, match="scale is str"):
        posenc.stickbreaking_attention(q, k, v, scale="1")
    with pytest.raises(ValueError, match="scale = -1"):
        posenc.stickbreaking_attention(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match="attend_current is int"):
        posenc.stickbreaking_attention(q, k, v, attend_current=1)
    with pytest.raises(ValueError, match="layout"):
        posenc.stickbreaking_attention(q, k, v, layout="sbhd")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        posenc.stickbreaking_attention(q[0], k[0], v[0], cu_seqlens=[0, 5, 9])
    with pytest.raises(TypeError, match="v is list"):
        posenc.stickbreaking_attention(q, k, [1.0])
