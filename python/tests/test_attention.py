"""posenc.attention against eager PyTorch written here (materialised scores, biases, mask,
softmax, P·V) in float64: forward and every gradient, for each scheme, GQA, layouts, masks;
gradcheck; errors.

Run: PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python -m pytest -q python/tests
"""
import math

import pytest
import torch

import posenc

torch.manual_seed(0)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rope(x, positions, base=10000.0):
    """x [B, S, H, D] rotated by rotate_half at the given positions (float64)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[None, :, None, :]
    return x * emb.cos() + rotate_half(x) * emb.sin()


def reference_attention(q, k, v, bias=None, causal=False, window=(-1, -1), softcap=0.0, scale=None, chunk_size=None):
    """Eager attention: q [B, Sq, H, D], k, v [B, Sk, G, D]; bias [H, Sq, Sk] (or [B, H, Sq, Sk]) or None;
    chunk_size as Llama 4's chunked mask (query and key in one chunk of positions)."""
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale if scale else 1.0 / math.sqrt(d))
    if bias is not None:
        scores = scores + bias
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window[0] >= 0:
        visible &= j >= i - window[0]
    if window[1] >= 0:
        visible &= j <= i + window[1]
    if chunk_size is not None:
        visible &= torch.div(j, chunk_size, rounding_mode="floor") == torch.div(i, chunk_size, rounding_mode="floor")
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)


def inputs(b=2, sq=33, sk=47, h=4, g=2, d=32, dtype=torch.float64):
    q = torch.randn(b, sq, h, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, g, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, g, d, dtype=dtype, requires_grad=True)
    return q, k, v


def grads_of(out, tensors, seed=1):
    w = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), tensors, allow_unused=True)


def alibi_reference_bias(slopes, sq, sk):
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    return -slopes[:, None, None] * (i - j).to(slopes.dtype)


def test_skipping_vanishing_tiles_changes_no_bit():
    """Steep ALiBi slopes make far key tiles vanish; skipping them must leave out and every
    gradient bit for bit as running them (finite inputs), and a non-finite value in a skipped
    tile never reaches the output while running every tile spreads it as NaN (0·inf)."""
    # 600 keys: the blocks of the last 128 queries sit more than 300 keys past the first tile,
    # which then vanishes for all of their rows at every slope (the skip decides per tile and
    # block of rows).
    q, k, v = (t.detach().float().requires_grad_() for t in inputs(b=1, sq=600, sk=600, h=4, g=4, d=32))
    alibi = posenc.ALiBi(4, trainable=True)
    with torch.no_grad():
        alibi.slopes.copy_(torch.tensor([4.0, 2.0, 1.0, 0.5]))
    results = []
    for skip in (True, False):
        out = posenc.attention(q, k, v, alibi, causal=True, skip_vanishing_tiles=skip)
        results.append((out,) + tuple(grads_of(out, (q, k, v, alibi.slopes))))
    for name, a, b in zip("out q k v slopes".split(), *results):
        assert torch.equal(a, b), name
    with torch.no_grad():
        v_inf = v.detach().clone()
        v_inf[0, 0, :, 0] = float("inf")
        last = [posenc.attention(q.detach(), k.detach(), v_inf, alibi, causal=True, skip_vanishing_tiles=s)[0, -1]
                for s in (True, False)]
    assert torch.isfinite(last[0]).all()
    assert torch.isnan(last[1]).any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_alibi_forward_and_gradients_match_eager(dtype):
    q, k, v = inputs(dtype=dtype)
    alibi = posenc.ALiBi(4, trainable=True).to(dtype)
    out = posenc.attention(q, k, v, alibi, causal=True)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    slopes = alibi.slopes.detach().double().requires_grad_()
    ref = reference_attention(qr, kr, vr, alibi_reference_bias(slopes, q.shape[1], k.shape[1]), causal=True)
    # float32: the kernel's f32 sums over D = 32 and Sk = 47 terms; 1e-5 of O(1) values bounds
    # their rounding (~50 · 2^-24 ≈ 3e-6) with room; float64 runs the fp64 reference (1e-12).
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(out.double(), ref, atol=tol, rtol=0)
    got = grads_of(out, (q, k, v, alibi.slopes))
    want = grads_of(ref, (qr, kr, vr, slopes))
    # Gradients sum up to Sq·Sk products: 2e-4 relative to their scale for float32.
    for name, a, b in zip("q k v slopes".split(), got, want):
        scale = b.abs().max().item() + 1e-3
        assert (a.double() - b).abs().max().item() <= (1e-10 if dtype == torch.float64 else 2e-4) * scale, name


def test_rope_t5_kerple_schemes_match_eager():
    q, k, v = inputs(dtype=torch.float32)
    qd, kd, vd = (t.detach().double() for t in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    q_pos = torch.arange(sq) + (sk - sq)
    k_pos = torch.arange(sk)
    # RoPE module, on the fly.
    out = posenc.attention(q, k, v, posenc.RotaryPositionalEncoding(32), causal=True)
    ref = reference_attention(reference_rope(qd, q_pos), reference_rope(kd, k_pos), vd, causal=True)
    # f32 rotation and sums over D and Sk: 1e-5 covers ~100 f32 roundings of O(1) terms.
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)
    # Keys already rotated (a KV cache): rotate only queries.
    k_rot = reference_rope(kd, k_pos).float()
    out = posenc.attention(q, k_rot, v, posenc.RotaryPositionalEncoding(32), causal=True, keys_rotated=True)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)
    # T5 and Kerple against the library's own bias ops (tested against formulas in test_ops.py).
    t5 = posenc.T5RelativeBias(4, num_buckets=16, max_distance=40)
    with torch.no_grad():
        t5.table.normal_()
    bias = posenc.t5_bias(t5.table.double(), q_pos, k_pos, 16, 40, True)[0]
    out = posenc.attention(q, k, v, t5, window=(10, 5))
    assert torch.allclose(out.double(), reference_attention(qd, kd, vd, bias, window=(10, 5)), atol=1e-5, rtol=0)
    kerple = posenc.Kerple(4)
    bias = posenc.kerple_bias(kerple.r1.double(), kerple.r2.double(), q_pos, k_pos)[0]
    out = posenc.attention(q, k, v, kerple, causal=True, softcap=5.0)
    assert torch.allclose(out.double(), reference_attention(qd, kd, vd, bias, causal=True, softcap=5.0), atol=1e-5, rtol=0)


def test_shortformer_adds_the_sinusoid_to_queries_and_keys():
    q, k, v = inputs(dtype=torch.float64)
    sq, sk = q.shape[1], k.shape[1]
    table = posenc.sinusoidal_table(sk, 32, dtype=torch.float64)  # positions 0..Sk-1
    out = posenc.attention(q, k, v, posenc.SinusoidalPositionalEncoding(32), causal=True)
    ref = reference_attention(q + table[sk - sq:][None, :, None, :], k + table[None, :, None, :], v, causal=True)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    got, want = grads_of(out, (q, k, v)), grads_of(ref, (q, k, v))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


def test_t5_and_kerple_parameter_gradients():
    q, k, v = inputs(dtype=torch.float64)
    sq, sk = q.shape[1], k.shape[1]
    q_pos = torch.arange(sq) + (sk - sq)
    k_pos = torch.arange(sk)
    t5 = posenc.T5RelativeBias(4, num_buckets=16, max_distance=40).double()
    with torch.no_grad():
        t5.table.normal_()
    out = posenc.attention(q, k, v, t5)
    table = t5.table.detach().clone().requires_grad_()
    ref = reference_attention(q, k, v, posenc.t5_bias(table, q_pos, k_pos, 16, 40, True)[0])
    (g_fused,) = grads_of(out, (t5.table,))
    (g_ref,) = grads_of(ref, (table,))
    assert torch.allclose(g_fused, g_ref, atol=1e-10, rtol=0)
    kerple = posenc.Kerple(4, power=True).double()
    out = posenc.attention(q, k, v, kerple, causal=True)
    r1, r2 = (t.detach().clone().requires_grad_() for t in (kerple.r1, kerple.r2))
    ref = reference_attention(q, k, v, posenc.kerple_bias(r1, r2, q_pos, k_pos, True)[0], causal=True)
    got, want = grads_of(out, (kerple.r1, kerple.r2)), grads_of(ref, (r1, r2))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


def test_shaw_matches_eager_with_its_table_gradients():
    q, k, v = inputs(dtype=torch.float64)
    sq, sk = q.shape[1], k.shape[1]
    shaw = posenc.ShawRelativePositions(4, 32, std=0.3).double()
    out = posenc.attention(q, k, v, shaw, causal=True)
    key_table, value_table = (t.detach().clone().requires_grad_() for t in (shaw.key_table, shaw.value_table))
    # Eager: rows r = clip(j - i, -k, k) + k of both tables (positions: queries at Sk - Sq + i).
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    rows = (j - i).clamp(-4, 4) + 4  # [Sq, Sk]
    b, _, h, d = q.shape
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = (torch.einsum("bqhd,bkhd->bhqk", q, kk) + torch.einsum("bqhd,qkd->bhqk", q, key_table[rows])) / math.sqrt(d)
    scores = scores.masked_fill(j > i, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", probs, vv) + torch.einsum("bhqk,qkd->bqhd", probs, value_table[rows])
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    got = grads_of(out, (q, k, v, shaw.key_table, shaw.value_table))
    want = grads_of(ref, (q, k, v, key_table, value_table))
    for a, b_ in zip(got, want):
        assert torch.allclose(a, b_, atol=1e-10, rtol=0)
    f32 = posenc.attention(q.float(), k.float(), v.float(), shaw.float(), causal=True)
    # The fused f32 kernel against the fp64 result: sums of ~50 f32 products of O(1) terms.
    assert torch.allclose(f32.double(), ref, atol=1e-5, rtol=0)


def test_fire_matches_eager_with_its_parameter_gradients():
    q, k, v = inputs(dtype=torch.float64)
    sq, sk = q.shape[1], k.shape[1]
    fire = posenc.FIRE(4, hidden=8, c=0.5, threshold=16.0).double()
    out = posenc.attention(q, k, v, fire, causal=True)
    q_pos, k_pos = torch.arange(sq) + (sk - sq), torch.arange(sk)
    clone = posenc.FIRE(4, hidden=8).double()
    clone.load_state_dict(fire.state_dict())
    bias = posenc.fire_bias(clone.w1, clone.b1, clone.w2, clone.b2, clone.c, clone.threshold, q_pos, k_pos)[0]
    ref = reference_attention(q, k, v, bias, causal=True)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    params = [fire.w1, fire.b1, fire.w2, fire.b2, fire.c, fire.threshold]
    params_ref = [clone.w1, clone.b1, clone.w2, clone.b2, clone.c, clone.threshold]
    for name, a, b_ in zip("w1 b1 w2 b2 c threshold".split(), grads_of(out, params), grads_of(ref, params_ref)):
        # fp64 both ways (the reference path and fire_bias' backward): rounding only.
        assert torch.allclose(a, b_, atol=1e-9, rtol=0), name


def test_gradcheck():
    q, k, v = inputs(b=1, sq=5, sk=7, h=2, g=1, d=4)
    alibi = posenc.ALiBi(2)  # slopes are a buffer: assigning a tensor to it is allowed
    slopes = alibi.slopes.double().requires_grad_()

    def fused(q, k, v, s):
        alibi.slopes = s
        return posenc.attention(q, k, v, alibi, causal=True, softcap=3.0)

    assert torch.autograd.gradcheck(fused, (q, k, v, slopes))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_attention_matches_eager_with_its_gradients(dtype):
    # Llama 4's chunked layers: RoPE and a causal mask inside chunks; Sq < Sk puts the queries at
    # the end of a cache, across a chunk boundary.
    q, k, v = inputs(b=2, sq=40, sk=90, h=4, g=2, d=16, dtype=dtype)
    out = posenc.attention(q, k, v, "rope", causal=True, chunk_size=32)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(reference_rope(qd, torch.arange(50, 90)), reference_rope(kd, torch.arange(90)), vd,
                              causal=True, chunk_size=32)
    tol = 1e-12 if dtype == torch.float64 else 2e-5  # f32: a few ulps of O(1) outputs over 32 keys
    assert torch.allclose(out.double(), ref, atol=tol, rtol=0)
    for got, want in zip(grads_of(out, (q, k, v)), grads_of(ref, (qd, kd, vd))):
        assert torch.allclose(got.double(), want, atol=10 * tol, rtol=0)
    # Bidirectional chunks (a block-diagonal mask), and errors naming the argument.
    out = posenc.attention(q, k, v, chunk_size=30)
    assert torch.allclose(out.double(), reference_attention(qd, kd, vd, chunk_size=30), atol=tol, rtol=0)
    with pytest.raises(ValueError, match="chunk_size = 0"):
        posenc.attention(q, k, v, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size is float"):
        posenc.attention(q, k, v, chunk_size=2.0)
    with pytest.raises(ValueError, match="non-decreasing"):
        posenc.attention(q, k, v, chunk_size=8, k_positions=torch.arange(90).flip(0))


def test_bhsd_layout_is_a_view_and_matches():
    q, k, v = inputs(dtype=torch.float32)
    out = posenc.attention(q, k, v, causal=True)
    out_bhsd = posenc.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, layout="bhsd")
    assert torch.equal(out, out_bhsd.transpose(1, 2))


def test_errors():
    q, k, v = inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="KV head count dividing"):
        posenc.attention(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1))
    with pytest.raises(ValueError, match="window_left"):
        posenc.attention(q, k, v, window=(-5, -1))
    with pytest.raises(TypeError, match="dtype"):
        posenc.attention(q.int(), k.int(), v.int())
    with pytest.raises(ValueError, match="scheme"):
        posenc.attention(q, k, v, "fire")
    if torch.cuda.is_available():  # pragma: no cover - no CUDA here
        with pytest.raises(TypeError, match="device"):
            posenc.attention(q.cuda(), k.cuda(), v.cuda())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_transformer_xl_and_tupe_match_eager_with_every_gradient(dtype):
    """XL's terms (u·k + (q + v)·W_R r(i - j), scaled) and TUPE's biases inside the kernel against
    eager attention with the library's materialising ops (themselves checked against formulas in
    test_ops.py), forward and the gradients of q, k, v and every parameter."""
    q, k, v = inputs(dtype=dtype)
    sq, sk = q.shape[1], k.shape[1]
    q_pos = torch.arange(sq) + (sk - sq)
    k_pos = torch.arange(sk)
    xl = posenc.TransformerXLRelative(4, 32, 24, std=0.5).to(dtype)
    tupe = posenc.TUPE(4, 32, 16, max_len=64, cls_reset=True, std=0.5).to(dtype)
    with torch.no_grad():
        tupe.theta1.normal_()
        tupe.theta2.normal_()
    for module, causal in ((xl, True), (tupe, False)):
        out = posenc.attention(q, k, v, module, causal=causal, softcap=6.0)
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
        params = [p.detach().double().requires_grad_() for p in module.parameters()]
        if module is xl:
            u, vv, w_r = params
            bias = posenc.xl_scores(qr, kr.repeat_interleave(2, dim=2), u, vv, w_r, q_pos, k_pos, 0.0, xl.base)
        else:
            table, u_q, u_k, theta1, theta2 = params
            bias = posenc.tupe_bias(table, u_q, u_k, theta1, theta2, q_pos, k_pos, 4, True)[0]
        ref = reference_attention(qr, kr, vr, bias, causal=causal, softcap=6.0)
        # float32: f32 tables (P = W_R·r, the TUPE projections) and f32 sums over D and Sk; 2e-5 of
        # O(1) outputs covers them; float64 runs the fp64 reference (1e-12).
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        assert torch.allclose(out.double(), ref, atol=tol, rtol=0), type(module).__name__
        got = grads_of(out, (q, k, v, *module.parameters()))
        want = grads_of(ref, (qr, kr, vr, *params))
        names = ["q", "k", "v"] + [n for n, _ in module.named_parameters()]
        # Gradients sum up to Sq·Sk products (and the tables' contractions over positions and
        # d_model): 5e-4 relative to their scale for float32.
        for name, a, b in zip(names, got, want):
            scale = b.abs().max().item() + 1e-3
            assert (a.double() - b).abs().max().item() <= (1e-10 if dtype == torch.float64 else 5e-4) * scale, name


def test_gradcheck_transformer_xl_and_tupe():
    """torch.autograd.gradcheck through the fused op with XL's and TUPE's parameters."""
    q, k, v = inputs(b=1, sq=5, sk=7, h=2, g=1, d=4)
    xl = posenc.TransformerXLRelative(2, 4, 6, std=0.5).double()
    tupe = posenc.TUPE(2, 4, 6, max_len=8, cls_reset=True, std=0.5).double()
    for module in (xl, tupe):
        names = [n for n, _ in module.named_parameters()]

        def fused(q, k, v, *params):
            for name, p in zip(names, params):
                module._parameters[name] = p  # the very tensors gradcheck perturbs
            return posenc.attention(q, k, v, module, causal=module is xl, softcap=3.0)

        params = tuple(p.detach().clone().requires_grad_() for p in module.parameters())
        assert torch.autograd.gradcheck(fused, (q, k, v, *params)), type(module).__name__


def test_decode_against_a_long_cache_matches_eager():
    """One query over a KV cache long enough to be split into chunks (> 8192 keys), GQA, with
    RoPE on an already rotated cache and with ALiBi."""
    b, sk, h, g, d = 1, 9000, 4, 2, 32
    q = torch.randn(b, 1, h, d)
    k = torch.randn(b, sk, g, d)
    v = torch.randn(b, sk, g, d)
    qd, kd, vd = q.double(), k.double(), v.double()
    k_pos = torch.arange(sk)
    q_pos = torch.tensor([sk - 1])
    k_rot = reference_rope(kd, k_pos).float()
    out = posenc.attention(q, k_rot, v, posenc.RotaryPositionalEncoding(d), causal=True, keys_rotated=True)
    ref = reference_attention(reference_rope(qd, q_pos), reference_rope(kd, k_pos), vd, causal=True)
    # f32 sums over D and 9000 keys (in chunks merged in fp64): 1e-5 of O(1) outputs.
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)
    alibi = posenc.ALiBi(h)
    out = posenc.attention(q, k, v, alibi, causal=True)
    ref = reference_attention(qd, kd, vd, alibi_reference_bias(alibi.slopes.double(), 1, sk), causal=True)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)


def test_huge_page_zeros_is_a_kv_cache_like_any_other():
    """posenc.huge_page_zeros gives a zero, writable, 2 MiB-aligned tensor; decode from a KV cache
    held in it gives bit for bit what the same cache in an ordinary tensor gives."""
    k_cache = posenc.huge_page_zeros(1, 3000, 2, 64)
    v_cache = posenc.huge_page_zeros((1, 3000, 2, 64), dtype=torch.float32)
    assert k_cache.shape == (1, 3000, 2, 64) and k_cache.dtype == torch.float32 and k_cache.is_contiguous()
    assert k_cache.data_ptr() % (2 << 20) == 0
    assert torch.count_nonzero(k_cache) == 0
    k_cache.copy_(torch.randn(1, 3000, 2, 64))
    v_cache.copy_(torch.randn(1, 3000, 2, 64))
    q = torch.randn(1, 1, 8, 64)
    alibi = posenc.ALiBi(8)
    out = posenc.attention(q, k_cache, v_cache, alibi, causal=True)
    ordinary = posenc.attention(q, k_cache.clone(), v_cache.clone(), alibi, causal=True)
    assert torch.equal(out, ordinary)
    assert posenc.huge_page_zeros(0, 5).numel() == 0
    assert posenc.huge_page_zeros(4, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"huge_page_zeros: shape\[1\] = -2; expected >= 0"):
        posenc.huge_page_zeros(3, -2)
    with pytest.raises(ValueError, match="huge_page_zeros: shape"):
        posenc.huge_page_zeros(1 << 40, 1 << 40)


def test_position_temperature_matches_queries_scaled_eagerly():
    # Llama 4's NoPE layers (a small floor_scale, so the factor moves within 90 positions) and
    # Mistral's form: the fused kernel equals eager attention on s(p)·q, with every gradient.
    for temp, s_of in ((posenc.PositionTemperature(kind="llama4", floor_scale=16, attn_scale=0.5),
                        lambda p: 1 + 0.5 * torch.log(torch.floor((p + 1) / 16) + 1)),
                       (posenc.PositionTemperature(kind="mistral", beta=0.3, original_max_position_embeddings=20),
                        lambda p: 1 + 0.3 * torch.log1p(torch.floor(p / 20)))):
        q, k, v = inputs(b=2, sq=30, sk=90, h=4, g=2, d=16)
        positions = torch.arange(60, 90, dtype=torch.float64)
        torch.testing.assert_close(temp.factor(torch.arange(60, 90)), s_of(positions), rtol=0, atol=1e-15)
        out = posenc.attention(q, k, v, causal=True, temperature=temp)
        ref = reference_attention(q * s_of(positions)[None, :, None, None], k, v, causal=True)
        assert torch.allclose(out, ref, atol=1e-12, rtol=0)
        for got, want in zip(grads_of(out, (q, k, v)), grads_of(ref, (q, k, v))):
            assert torch.allclose(got, want, atol=1e-11, rtol=0)
    with pytest.raises(ValueError, match="floor_scale = 0"):
        posenc.PositionTemperature(kind="llama4", floor_scale=0, attn_scale=0.1)
    with pytest.raises(TypeError, match="original_max_position_embeddings missing"):
        posenc.PositionTemperature(kind="mistral", beta=0.1)
    with pytest.raises(TypeError, match="floor_scale given"):
        posenc.PositionTemperature(kind="mistral", beta=0.1, original_max_position_embeddings=8, floor_scale=2)
    with pytest.raises(ValueError, match="kind = 'yarn'"):
        posenc.PositionTemperature(kind="yarn")
    with pytest.raises(TypeError, match="expected a posenc.PositionTemperature"):
        posenc.attention(q, k, v, temperature=1.1)


def test_mla_values_narrower_than_keys():
    # DeepSeek's training heads (q, k 192; v 128) and absorbed decode (one KV head; v the first
    # columns of k's rows, a view): eager attention, with gradients through the view.
    q, k, _ = inputs(b=1, sq=20, sk=20, h=4, g=4, d=24)
    v = torch.randn(1, 20, 4, 16, dtype=torch.float64, requires_grad=True)
    out = posenc.attention(q, k, v, causal=True)
    assert out.shape == (1, 20, 4, 16)
    ref = reference_attention(q, k, v, causal=True)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    for got, want in zip(grads_of(out, (q, k, v)), grads_of(ref, (q, k, v))):
        assert torch.allclose(got, want, atol=1e-11, rtol=0)
    cache = torch.randn(1, 300, 1, 36, dtype=torch.float64, requires_grad=True)
    q1 = torch.randn(1, 1, 8, 36, dtype=torch.float64)
    out = posenc.attention(q1, cache, cache[..., :32], causal=True)
    ref = reference_attention(q1, cache, cache[..., :32], causal=True)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    (g_fused,), (g_ref,) = grads_of(out, (cache,)), grads_of(ref, (cache,))
    assert torch.allclose(g_fused, g_ref, atol=1e-11, rtol=0)
    with pytest.raises(ValueError, match="head_dim of 1 to k's"):
        posenc.attention(q1[..., :32], cache[..., :32], cache, causal=True)


@pytest.mark.parametrize("scheme, options", [(None, {}), ("rope", {"causal": True}), ("alibi", {"causal": True}),
                                             (posenc.T5RelativeBias(4), {})])
def test_an_empty_batch_gives_empty_outputs_like_sdpa(scheme, options):
    q = torch.randn(0, 5, 4, 8, requires_grad=True)
    k, v = torch.randn(0, 7, 2, 8, requires_grad=True), torch.randn(0, 7, 2, 8, requires_grad=True)
    out, lse = posenc.attention(q, k, v, scheme, return_lse=True, **options)
    assert out.shape == (0, 5, 4, 8) and lse.shape == (0, 4, 5)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.detach().transpose(1, 2) for t in (q, k, v)),
                                                            enable_gqa=True)
    assert sdpa.transpose(1, 2).shape == out.shape
    # Explicit positions of an empty batch, [0, S], name no token either.
    explicit = posenc.attention(q.detach(), k.detach(), v.detach(), scheme, q_positions=torch.zeros(0, 5,
                                dtype=torch.long), k_positions=torch.zeros(0, 7, dtype=torch.long), **options)
    assert explicit.shape == (0, 5, 4, 8)


def test_multipliers_past_f32_are_refused_for_f32_math():
    # f32 math rounds the scale and each query's temperature factor to f32: past FLT_MAX every score
    # of the row would be ±inf and the row NaN. fp64 inputs take them (and give finite rows).
    torch.manual_seed(11)
    q, k, v = (torch.randn(1, 40, 2, 8, dtype=torch.float64) for _ in range(3))
    huge = posenc.PositionTemperature(kind="llama4", floor_scale=1, attn_scale=1e38)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match=r"temperature = 3\.7.*e\+38 at query position 39; expected a factor "
                                             r"s\(p\) with s\(p\) and s\(p\) · scale"):
            posenc.attention(q.to(dtype), k.to(dtype), v.to(dtype), temperature=huge, causal=True)
        with pytest.raises(ValueError, match=r"scale = 1e\+39; expected at most 3\.40282"):
            posenc.attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=1e39, causal=True)
    assert torch.isfinite(posenc.attention(q, k, v, temperature=huge, causal=True)).all()
    assert torch.isfinite(posenc.attention(q, k, v, scale=1e39, causal=True)).all()
    # Below the limit the f32 call runs (factors up to 3.7e37 times 1/sqrt(8)).
    fine = posenc.PositionTemperature(kind="llama4", floor_scale=1, attn_scale=1e37)
    assert torch.isfinite(posenc.attention(q.float(), k.float(), v.float(), temperature=fine, causal=True)).all()
    with pytest.raises(ValueError, match="attn_scale = -1; expected a finite number >= 0"):
        posenc.PositionTemperature(kind="llama4", floor_scale=1, attn_scale=-1)
