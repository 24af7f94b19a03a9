"""CoPE from Python: the fused op against an eager float64 composition (the paper's form: gates
σ of the logits, a reversed cumulative sum clamped to npos − 1, the position logits gathered at
the floor and ceiling and interpolated), gradients through torch autograd for q, k, v and the
table, GQA, packed sequences, decode, layouts, dtypes, the scheme form and errors."""
import pytest
import torch

import posenc


def eager(q, k, v, table, scale=None):
    """out in float64; q [B, Sq, H, D], k, v [B, Sk, G, ·]; query i is token Sk − Sq + i."""
    q, k, v, table = (t.double() for t in (q, k, v, table))
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    z = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or d ** -0.5)
    token = torch.arange(sq)[:, None] + sk - sq
    seen = torch.arange(sk)[None, :] <= token                                    # [Sq, Sk]
    z = z.masked_fill(~seen, float("-inf"))
    pos = torch.sigmoid(z).flip(-1).cumsum(-1).flip(-1).clamp(max=table.shape[0] - 1)
    fixed = torch.einsum("bqhd,nd->bhqn", q, table)
    ceil, floor = pos.ceil().long(), pos.floor().long()
    w = pos - floor
    logits = z + fixed.gather(-1, ceil) * w + fixed.gather(-1, floor) * (1 - w)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(logits, -1), v)


def inputs(b=2, sq=70, sk=70, h=4, g=2, d=32, dv=None, npos=24, dtype=torch.float32, seed=0, linear=False):
    """q, k, v and a table; with `linear` the table's rows lie on a line, so that ⟨q, e[n]⟩ is
    linear in n and the derivative has no step at integer positions (test_cope.cpp says why)."""
    torch.manual_seed(seed)
    q = torch.randn(b, sq, h, d).to(dtype)
    k = torch.randn(b, sk, g, d).to(dtype)
    v = torch.randn(b, sk, g, dv or d).to(dtype)
    if linear:
        a, s = torch.randn(d), torch.randn(d) / 8
        table = a + torch.arange(npos)[:, None] * s
    else:
        table = torch.randn(npos, d)
    return q, k, v, table


def grads(out, tensors, seed=1):
    torch.manual_seed(seed)
    go = torch.randn(out.shape, dtype=torch.float64).to(out.dtype)  # (randn_like follows the strides)
    return torch.autograd.grad(out, tensors, go)


def leaves(*tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


@pytest.mark.parametrize("sq,sk,g,npos", [(70, 70, 2, 24), (70, 70, 4, 200), (1, 90, 1, 16), (23, 60, 2, 1)])
def test_float64_matches_the_eager_composition_with_gradients(sq, sk, g, npos):
    q, k, v, table = leaves(*inputs(sq=sq, sk=sk, g=g, npos=npos), dtype=torch.float64)
    out = posenc.cope_attention(q, k, v, table)
    want = eager(q, k, v, table)
    # The float64 op is the fp64 reference: the same sums in another order.
    assert torch.allclose(out, want, atol=1e-12, rtol=0)
    for a, b in zip(grads(out, (q, k, v, table)), grads(want, (q, k, v, table))):
        assert torch.allclose(a, b, atol=1e-11 * b.abs().max().item() + 1e-12, rtol=0)


@pytest.mark.parametrize("sq,sk,npos", [(70, 70, 24), (17, 130, 64)])
def test_float32_fused_matches_with_gradients(sq, sk, npos):
    q, k, v, table = leaves(*inputs(sq=sq, sk=sk, npos=npos, linear=True))
    out = posenc.cope_attention(q, k, v, table)
    want = eager(*leaves(q, k, v, table, dtype=torch.float64))
    # f32 products and Kahan-summed gate counts: a few f32 rounding steps of the outputs' size.
    assert (out.double() - want).abs().max().item() < 5e-5 * max(1.0, want.abs().max().item())
    q64, k64, v64, t64 = leaves(q, k, v, table, dtype=torch.float64)
    for a, b in zip(grads(out, (q, k, v, table)), grads(eager(q64, k64, v64, t64), (q64, k64, v64, t64))):
        assert (a.double() - b).abs().max().item() < 2e-4 * b.abs().max().item() + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_with_a_float32_table(dtype):
    q, k, v, table = inputs(dtype=dtype, linear=True)
    q, k, v, table = leaves(q, k, v, table)
    out = posenc.cope_attention(q, k, v, table)
    assert out.dtype == dtype
    q64, k64, v64, t64 = leaves(q, k, v, table, dtype=torch.float64)
    want = eager(q64, k64, v64, t64)
    # Math in f32 from 16-bit inputs, out rounded once: 2^−8 of its size.
    assert (out.double() - want).abs().max().item() < 2 ** -8 * want.abs().max().item()
    # The gradients: d_out rounded to the dtype in the op (the eager side keeps it in float64),
    # then each gradient rounded once: two half ulps, 2^−8 for bfloat16, within 2^−7.
    got = grads(out, (q, k, v, table))
    assert [g.dtype for g in got] == [dtype, dtype, dtype, torch.float32]
    for a, b in zip(got, grads(want, (q64, k64, v64, t64))):
        assert (a.double() - b).abs().max().item() < 2 ** -7 * b.abs().max().item()


def test_packed_sequences_count_their_own_positions():
    lengths = [30, 1, 45]
    q, k, v, table = leaves(*inputs(b=1, sq=sum(lengths), sk=sum(lengths)), dtype=torch.float64)
    cu = torch.tensor([0, 30, 31, 76])
    out = posenc.cope_attention(q[0], k[0], v[0], table, cu_seqlens=cu)
    parts = [eager(q[:, a:b], k[:, a:b], v[:, a:b], table)[0] for a, b in zip(cu[:-1], cu[1:])]
    assert torch.allclose(out, torch.cat(parts), atol=1e-12, rtol=0)


def test_the_scheme_form_layouts_and_lse():
    q, k, v, _ = inputs(sq=20, sk=20, npos=12)
    cope = posenc.CoPE(12, 32)
    assert torch.count_nonzero(cope.table) == 0
    with torch.no_grad():
        cope.table.normal_()
    out, lse = posenc.attention(q, k, v, cope, causal=True, return_lse=True)
    direct, lse_direct = posenc.cope_attention(q, k, v, cope.table, return_lse=True)
    assert torch.equal(out, direct) and lse.shape == (2, 4, 20) and torch.equal(lse, lse_direct.transpose(1, 2))
    out_bhsd = posenc.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cope, causal=True,
                                layout="bhsd")
    assert torch.equal(out_bhsd.transpose(1, 2), out)
    loss = out.square().sum()
    loss.backward()
    assert cope.table.grad is not None and cope.table.grad.abs().sum() > 0


def test_bad_input_is_refused_by_name():
    q, k, v, table = inputs(sq=10, sk=10, npos=8)
    cope = posenc.CoPE(8, 32)
    with pytest.raises(ValueError, match="mask.causal = false; expected a causal mask .cope replaces the softmax"):
        posenc.attention(q, k, v, cope)
    with pytest.raises(ValueError, match="mask.window_left = 4; expected -1"):
        posenc.attention(q, k, v, cope, causal=True, window=(4, 0))
    with pytest.raises(ValueError, match=r"terms = 1 terms; expected none \(sinks included\)"):
        posenc.attention(q, k, v, cope, causal=True, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match=r"cache = q8_0; expected k and v tensors"), torch.no_grad():
        posenc.attention(q, posenc.quantize_kv(k, "q8_0"), posenc.quantize_kv(v, "q8_0"), cope, causal=True,
                         kv_format="q8_0")
    with pytest.raises(ValueError, match=r"params\[0\] shape \[8, 16\]; expected \[8, 32\]"):
        posenc.cope_attention(q, k, v, table[:, :16])
    with pytest.raises(ValueError, match="has head_dim = 16; expected q's 32"):
        posenc.attention(q, k, v, posenc.CoPE(8, 16), causal=True)
    with pytest.raises(ValueError, match="npos_max = 70000"):
        posenc.CoPE(70000, 32)
    with pytest.raises(ValueError, match="npos_max"):
        posenc.CoPE(0, 32)
    with pytest.raises(TypeError, match="table is list"):
        posenc.cope_attention(q, k, v, [1.0])
    with pytest.raises(ValueError, match="scale = -1"):
        posenc.cope_attention(q, k, v, table, scale=-1)
    with pytest.raises(ValueError, match="at most as many queries as keys"):
        posenc.cope_attention(q, k[:, :5], v[:, :5], table)
