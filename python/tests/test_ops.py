"""posenc's torch ops against independent pure-PyTorch references (the tutorial formulations) in
float64, torch.autograd.gradcheck on every differentiable op, and the error contract.

Run: PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python -m pytest -q python/tests
"""
import copy as copy_module
import json
import math
import os
import re

import pytest
import torch

import posenc

torch.manual_seed(0)


# ------------------------------------------------------------------ independent references

def reference_inv_freq(rotary_dim, base):
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rope_half_split(x, positions, base):
    """Hugging Face's tutorial form: x·cos + rotate_half(x)·sin, on [S, H, D]."""
    inv_freq = reference_inv_freq(x.shape[-1], base)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    return x * emb.cos() + rotate_half(x) * emb.sin()


def reference_rope_interleaved(x, positions, base):
    """Meta's original form: complex multiplication of (x[2i], x[2i+1]) by e^{iθ}."""
    inv_freq = reference_inv_freq(x.shape[-1], base)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    rotation = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rotation).reshape(x.shape)


def reference_t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(distance < max_exact, distance, large)


# ------------------------------------------------------------------ sinusoidal

def test_sinusoidal_table_matches_the_tutorial_formula():
    positions = torch.arange(50, dtype=torch.long) * 7
    dim = 16
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    angles = positions.to(torch.float64)[:, None] * div[None, :]
    want = torch.stack((angles.sin(), angles.cos()), dim=-1).reshape(50, dim)
    got = posenc.sinusoidal_table(positions, dim, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    module = posenc.SinusoidalPositionalEncoding(dim)
    x = torch.randn(2, 50, dim, dtype=torch.float64)
    torch.testing.assert_close(module(x, positions), x + want, rtol=0, atol=1e-12)


# ------------------------------------------------------------------ rope

@pytest.mark.parametrize("layout", ["half-split", "interleaved"])
def test_rope_matches_the_tutorial_forms(layout):
    q = torch.randn(1, 9, 4, 32, dtype=torch.float64)
    k = torch.randn(1, 9, 2, 32, dtype=torch.float64)
    positions = torch.arange(9, dtype=torch.long) + 100
    q_out, k_out = posenc.rope(q, k, positions, layout=layout)
    reference = reference_rope_half_split if layout == "half-split" else reference_rope_interleaved
    torch.testing.assert_close(q_out[0], reference(q[0], positions, 10000.0), rtol=0, atol=1e-12)
    torch.testing.assert_close(k_out[0], reference(k[0], positions, 10000.0), rtol=0, atol=1e-12)
    # f32 against the float64 reference: the angle is exact in posenc, the products f32.
    q32, _ = posenc.rope(q.float(), None, positions, layout=layout)
    torch.testing.assert_close(q32[0].double(), reference(q[0], positions, 10000.0), rtol=0, atol=1e-5)


def test_rope_gradcheck_and_module():
    q = torch.randn(2, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 1, 8, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 0, 1]], dtype=torch.long)
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    fn = lambda a, b: posenc.rope(a, b, positions, rotary_dim=6, scaling=scaling)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k))
    module = posenc.RotaryPositionalEncoding(8, 6, scaling=scaling)
    q_out, k_out = module(q, k, positions)
    torch.testing.assert_close(q_out, fn(q, k)[0])


def test_rope_gradient_of_one_output_alone():
    # Only k_out (or only q_out) reaches the loss: q and k have their own head counts, and xPos
    # scales them oppositely, so each gradient must come from its own slot.
    q = torch.randn(1, 6, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    for pick in (0, 1):
        for inplace in (False, True):
            def fn(a, b):
                if inplace:
                    return posenc.rope_(a * 1, b * 1, xpos=4, direction="backward")[pick]
                return posenc.rope(a, b, xpos=4)[pick]
            assert torch.autograd.gradcheck(fn, (q, k)), (pick, inplace)


def test_rope_in_place_bumps_the_version_of_what_it_rotates():
    leaf = torch.randn(1, 4, 2, 8, requires_grad=True)
    x = leaf * 1
    saved = x.sin()  # its backward reads x
    posenc.rope_(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_rope_from_hf_config_reproduces_transformers_inv_freq():
    # Llama 3.1's rope_scaling; the rotation at position 1 of a unit pair exposes ω_i = angle.
    config = {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 500000.0,
              "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    module = posenc.RotaryPositionalEncoding.from_hf_config(config)
    x = torch.zeros(1, 1, 1, 128, dtype=torch.float64)
    x[..., :64] = 1.0  # first members of every half-split pair
    out, _ = module(x, None, torch.tensor([1]))
    omega = torch.atan2(out[0, 0, 0, 64:], out[0, 0, 0, :64])
    inv_freq = reference_inv_freq(128, 500000.0)
    wavelen = 2 * math.pi / inv_freq
    low, high = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    want = torch.where(wavelen > low, inv_freq / 8.0, inv_freq)
    medium = (wavelen >= high) & (wavelen <= low)
    want = torch.where(medium, (1 - smooth) * inv_freq / 8.0 + smooth * inv_freq, want)
    torch.testing.assert_close(omega, want, rtol=1e-12, atol=0)


DATA = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data")


def test_rope_from_hf_config_per_layer_and_proportional():
    # Gemma 4 (tests/data/gemma-4-e2b.json): full layers turn int(0.25 * 512 // 2) = 64 pairs of
    # the 512-wide head at 1e6^(-2i/512) and leave the other 192 (transformers'
    # _compute_proportional_rope_parameters); sliding layers are default RoPE at 1e4 over 256.
    path = os.path.join(DATA, "gemma-4-e2b.json")
    full = posenc.RotaryPositionalEncoding.from_hf_config(path, layer=4)
    assert (full.layer_type, full.head_dim, full.rotary_dim) == ("full_attention", 512, 512)
    want = torch.cat((1.0 / 1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 512),
                      torch.zeros(192, dtype=torch.float64)))
    q = torch.randn(1, 3, 2, 512, dtype=torch.float64)
    positions = torch.tensor([0, 7, 1000])
    angles = positions[:, None].double() * want[None, :]
    emb = torch.cat((angles, angles), dim=-1)[None, :, None, :]
    half = 256
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    out, _ = full(q, None, positions)
    torch.testing.assert_close(out, q * emb.cos() + rotated * emb.sin(), rtol=0, atol=1e-12)
    assert torch.equal(out[..., 64:256], q[..., 64:256])  # pairs that do not turn are copied
    sliding = posenc.RotaryPositionalEncoding.from_hf_config(path, layer=0)
    assert (sliding.layer_type, sliding.head_dim, sliding.base) == ("sliding_attention", 256, 10000.0)
    # Gemma 3 (legacy keys): layer 5 is full (linear x8 at 1e6), layer 0 sliding (1e4, unscaled).
    gemma3 = os.path.join(DATA, "gemma-3-4b-it.json")
    assert posenc.RotaryPositionalEncoding.from_hf_config(gemma3, layer=5).scaling["rope_type"] == "linear"
    assert posenc.RotaryPositionalEncoding.from_hf_config(gemma3, layer=0).base == 10000.0
    deepseek = posenc.RotaryPositionalEncoding.from_hf_config(os.path.join(DATA, "deepseek-v3.json"))
    assert (deepseek.head_dim, deepseek.rotary_dim) == (64, 64)  # qk_rope_head_dim
    assert deepseek.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-15)
    assert full.softmax_scale is None
    with pytest.raises(ValueError, match="layer = missing"):
        posenc.RotaryPositionalEncoding.from_hf_config(path)
    with pytest.raises(ValueError, match="layer = 35"):
        posenc.RotaryPositionalEncoding.from_hf_config(path, layer=35)
    with pytest.raises(TypeError, match="layer is str"):
        posenc.RotaryPositionalEncoding.from_hf_config(path, layer="4")
    with pytest.raises(ValueError, match=r"config\['rope_theta'\] = nan; expected a finite number"):
        posenc.RotaryPositionalEncoding.from_hf_config({"head_dim": 64, "rope_theta": float("nan")})


def test_hf_config_errors_name_the_key_and_the_layer():
    from_hf = posenc.RotaryPositionalEncoding.from_hf_config
    longrope = {"head_dim": 4, "rope_theta": 1e4, "max_position_embeddings": 64,
                "rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 16,
                                 "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}}
    for path, key in ((("rope_scaling", "factor"), "['rope_scaling']['factor']"),
                      (("rope_scaling", "short_factor", 1), "['rope_scaling']['short_factor'][1]"),
                      (("text_config", "rope_theta"), "['text_config']['rope_theta']")):
        config = json.loads(json.dumps(longrope))
        node = config
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = float("inf") if len(path) == 3 else float("nan")
        with pytest.raises(ValueError, match=re.escape(f"config{key} = ")):
            from_hf(config)
    # layer: >= 0 always, and below num_hidden_layers where the config has it (also a text_config's).
    flat = {"head_dim": 64, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="layer = -1; expected >= 0"):
        from_hf(flat, layer=-1)
    assert from_hf(flat, layer=2**40).base == 1e4  # no layer count to check it against
    for config in (dict(flat, num_hidden_layers=4), {"text_config": dict(flat, num_hidden_layers=4)}):
        with pytest.raises(ValueError, match=r"layer = 1099511627776; expected in \[0, 4\)"):
            from_hf(config, layer=2**40)
        assert from_hf(config, layer=3).base == 1e4


def test_floater_refuses_unstable_steps_and_needless_substeps():
    with pytest.raises(ValueError, match=r"time_per_position / substeps = 1e\+30 / 1; expected a step h with h · L"):
        posenc.FLOATER(dim=8, hidden=4, time_per_position=1e30)
    with pytest.raises(ValueError, match=r"substeps = 10000000; expected in \[1, 65536\]"):
        posenc.FLOATER(dim=8, hidden=4, substeps=10_000_000)


def test_rope_reads_legacy_rope_type_names():
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    factors = {"short_factor": [1.0, 2.0, 3.0, 4.0], "long_factor": [2.0, 3.0, 4.0, 5.0], "factor": 4.0,
               "original_max_position_embeddings": 2}
    su, _ = posenc.rope(q, scaling=dict(factors, type="su"))
    longrope, _ = posenc.rope(q, scaling=dict(factors, rope_type="longrope"))
    torch.testing.assert_close(su, longrope, rtol=0, atol=0)
    mrope, _ = posenc.rope(q, scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    torch.testing.assert_close(mrope, posenc.rope(q)[0], rtol=0, atol=0)


# ------------------------------------------------------------------ biases

def test_alibi_matches_materialised_reference_and_gradcheck():
    slopes = posenc.alibi_slopes(6).requires_grad_(True)
    qp = torch.arange(5, dtype=torch.long) + 10
    kp = torch.arange(8, dtype=torch.long) + 7
    bias = posenc.alibi_bias(slopes, qp, kp)
    distance = (qp[:, None] - kp[None, :]).to(torch.float64)
    torch.testing.assert_close(bias[0], -slopes.detach()[:, None, None] * distance[None], rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda s: posenc.alibi_bias(s, qp, kp, True), (slopes,))
    module = posenc.ALiBi(6, trainable=True)
    assert isinstance(module.slopes, torch.nn.Parameter)
    assert "slopes" in posenc.ALiBi(6).state_dict()


def test_t5_matches_transformers_buckets_and_gradcheck():
    table = torch.randn(32, 3, dtype=torch.float64, requires_grad=True)
    qp = torch.arange(40, dtype=torch.long)
    kp = torch.arange(300, dtype=torch.long) * 3
    bias = posenc.t5_bias(table, qp, kp)
    buckets = reference_t5_bucket(kp[None, :] - qp[:, None], True, 32, 128)
    torch.testing.assert_close(bias[0], table.detach()[buckets].permute(2, 0, 1), rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda t: posenc.t5_bias(t, qp[:6], kp[:7]), (table,))
    module = posenc.T5RelativeBias(3)
    assert module(torch.arange(4)).shape == (1, 3, 4, 4)


def test_large_outputs_reuse_cached_blocks_safely():
    # 2 MiB outputs come from posenc's block cache: a freed block is reused for the next output of
    # the same size, and the values are the op's, never a stale result.
    q = torch.randn(1, 256, 16, 128)
    first, _ = posenc.rope(q, None, torch.arange(256))
    pointer = first.data_ptr()
    want = first.clone()
    del first
    second, _ = posenc.rope(q, None, torch.arange(256))
    assert second.data_ptr() == pointer
    torch.testing.assert_close(second, want, rtol=0, atol=0)
    other, _ = posenc.rope(q * 2, None, torch.arange(256))  # a new block while `second` lives
    assert other.data_ptr() != second.data_ptr()
    posenc.empty_cache()


def test_kerple_fire_tupe_against_formulas_and_gradcheck():
    qp, kp = torch.arange(6) + 3, torch.arange(9)
    distance = (qp[:, None] - kp[None, :]).abs().to(torch.float64)
    r1 = torch.tensor([0.5, 1.5], dtype=torch.float64, requires_grad=True)
    r2 = torch.tensor([0.3, 1.2], dtype=torch.float64, requires_grad=True)
    want = -r1.detach()[:, None, None] * torch.log1p(r2.detach()[:, None, None] * distance)
    torch.testing.assert_close(posenc.kerple_bias(r1, r2, qp, kp)[0], want, rtol=0, atol=1e-12)
    want_power = -r1.detach()[:, None, None] * distance ** r2.detach()[:, None, None]
    torch.testing.assert_close(posenc.kerple_bias(r1, r2, qp, kp, power=True)[0], want_power, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: posenc.kerple_bias(a, b, qp, kp), (r1, r2))
    assert torch.autograd.gradcheck(lambda a, b: posenc.kerple_bias(a, b, qp, kp, True), (r1, r2))

    # L = 4.5 is no query's position: at L = i the bias has a corner, where finite differences fail.
    fire = posenc.FIRE(heads=2, hidden=5, threshold=4.5).double()
    params = [fire.w1, fire.b1, fire.w2, fire.b2, fire.c, fire.threshold]
    x = torch.log1p(fire.c * distance) / torch.log1p(fire.c * torch.clamp(qp.double(), min=4.5))[:, None]
    hidden = torch.relu(x[..., None] * fire.w1 + fire.b1)
    want_fire = torch.einsum("qkm,hm->hqk", hidden, fire.w2) + fire.b2[:, None, None]
    torch.testing.assert_close(fire(qp, kp)[0], want_fire.detach(), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *p: posenc.fire_bias(*p, qp, kp), tuple(params))

    tupe = posenc.TUPE(heads=2, head_dim=3, d_model=4, max_len=20, cls_reset=True).double()
    with torch.no_grad():
        tupe.theta1.fill_(0.25)
        tupe.theta2.fill_(-0.5)
    pq = (tupe.table[qp] @ tupe.u_q).view(-1, 2, 3)
    pk = (tupe.table[kp] @ tupe.u_k).view(-1, 2, 3)
    want_tupe = torch.einsum("qhd,khd->hqk", pq, pk) / (2 * 3) ** 0.5
    want_tupe[:, :, kp == 0] = -0.5
    torch.testing.assert_close(tupe(qp, kp)[0], want_tupe.detach(), rtol=0, atol=1e-12)
    tparams = (tupe.table, tupe.u_q, tupe.u_k, tupe.theta1, tupe.theta2)
    assert torch.autograd.gradcheck(lambda *p: posenc.tupe_bias(*p, torch.arange(4), kp[:5], 2, True), tparams)


def test_learned_and_floater_gradcheck():
    table = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    torch.testing.assert_close(posenc.learned(table, x, positions), x + table[positions])
    assert torch.autograd.gradcheck(lambda t, a: posenc.learned(t, a, positions), (table, x))
    floater = posenc.FLOATER(dim=3, hidden=4, time_per_position=0.2, substeps=2).double()
    params = tuple(floater.parameters())
    assert torch.autograd.gradcheck(lambda *p: posenc.floater_table(*p, 6, 0.2, 2), params)
    long = floater.table(12)
    torch.testing.assert_close(floater.table(6), long[:6], rtol=0, atol=0)  # extends exactly
    module = posenc.LearnedPositionalEncoding(16, 4)
    assert module(torch.zeros(3, 4)).shape == (3, 4)


def test_shaw_and_xl_against_formulas_and_gradcheck():
    seq, heads, dim, k = 6, 2, 4, 2
    qp = torch.arange(seq)
    q = torch.randn(1, seq, heads, dim, dtype=torch.float64, requires_grad=True)
    keys = torch.randn(1, seq, heads, dim, dtype=torch.float64, requires_grad=True)
    shaw = posenc.ShawRelativePositions(k, dim, std=0.5).double()
    rows = (qp[None, :] - qp[:, None]).clamp(-k, k) + k  # [i, j]
    want = torch.einsum("ihd,ijd->hij", q[0].detach(), shaw.key_table.detach()[rows]) / dim ** 0.5
    torch.testing.assert_close(shaw.scores(q, qp)[0], want, rtol=0, atol=1e-12)
    probs = torch.rand(1, heads, seq, seq, dtype=torch.float64, requires_grad=True)
    want_values = torch.einsum("hij,ijd->ihd", probs[0].detach(), shaw.value_table.detach()[rows])
    torch.testing.assert_close(shaw.values(probs, qp)[0], want_values, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, t: posenc.shaw_scores(a, t, qp, qp, k), (q, shaw.key_table))
    assert torch.autograd.gradcheck(lambda p, t: posenc.shaw_values(p, t, qp, qp, k), (probs, shaw.value_table))

    xl = posenc.TransformerXLRelative(heads, dim, d_model=6, std=0.5).double()
    delta = (qp[:, None] - qp[None, :]).double()
    omega = 1.0 / 10000.0 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    r = torch.cat([torch.sin(delta[..., None] * omega), torch.cos(delta[..., None] * omega)], -1)  # [i, j, 6]
    projected = torch.einsum("ijm,em->ije", r, xl.w_r.detach()).view(seq, seq, heads, dim)
    want_xl = (torch.einsum("hd,jhd->hj", xl.u.detach(), keys[0].detach())[:, None, :]
               + torch.einsum("ihd,ijhd->hij", q[0].detach() + xl.v.detach()[None], projected)) / dim ** 0.5
    torch.testing.assert_close(xl(q, keys, qp, qp)[0], want_xl, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b, u, v, w: posenc.xl_scores(a, b, u, v, w, qp, qp),
                                    (q, keys, xl.u, xl.v, xl.w_r))


def test_modules_save_and_load():
    for module in (posenc.ALiBi(4, trainable=True), posenc.T5RelativeBias(3), posenc.Kerple(2), posenc.FIRE(2, 4),
                   posenc.TUPE(2, 2, 4, 8), posenc.FLOATER(3, 4), posenc.LearnedPositionalEncoding(8, 4),
                   posenc.ShawRelativePositions(3, 4), posenc.TransformerXLRelative(2, 2, 4)):
        state = module.state_dict()
        assert state, type(module).__name__
        copy = copy_module.deepcopy(module)
        for p in copy.parameters():
            torch.nn.init.zeros_(p)
        copy.load_state_dict(state)
        for (name, a), b in zip(module.state_dict().items(), copy.state_dict().values()):
            torch.testing.assert_close(a, b, msg=name)
        assert module.double().state_dict()[next(iter(state))].dtype == torch.float64


# ------------------------------------------------------------------ errors

def test_bad_values_raise_value_error_naming_the_parameter():
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match="rotary_dim = 7"):
        posenc.rope(q, rotary_dim=7)
    with pytest.raises(ValueError, match="num_buckets = 3"):
        posenc.t5_bias(torch.zeros(3, 2), torch.arange(2), torch.arange(2), num_buckets=3)
    with pytest.raises(ValueError, match=r"kerple_bias: r1 \[3\], r2 \[2\]; expected r1 \[heads\], r2 \[heads\]"):
        posenc.kerple_bias(torch.ones(3), torch.ones(2), torch.arange(2), torch.arange(2))
    with pytest.raises(TypeError, match="kerple_bias: r2 is list"):
        posenc.kerple_bias(torch.ones(3), [1.0, 1.0, 1.0], torch.arange(2), torch.arange(2))
    with pytest.raises(ValueError, match=r"alibi_bias: slopes \[\]; expected slopes \[heads\]"):
        posenc.alibi_bias(torch.tensor(1.0), torch.arange(2), torch.arange(2))
    with pytest.raises(TypeError, match="alibi_bias: slopes dtype torch.int64; expected a floating dtype"):
        posenc.alibi_bias(torch.ones(2, dtype=torch.long), torch.arange(2), torch.arange(2))
    fire = [torch.zeros(5), torch.zeros(5), torch.zeros(2, 5), torch.zeros(2), torch.tensor(1.0), torch.tensor(8.0)]
    with pytest.raises(ValueError, match=r"fire_bias: w1 \[5\], b1 \[5\], w2 \[2, 4\], b2 \[2\]; expected w1 "
                                         r"\[hidden\], b1 \[hidden\], w2 \[heads, hidden\], b2 \[heads\]"):
        posenc.fire_bias(*fire[:2], torch.zeros(2, 4), *fire[3:], torch.arange(2), torch.arange(2))
    with pytest.raises(ValueError, match=r"fire_bias: c shape \[2\]; expected one value"):
        posenc.fire_bias(*fire[:4], torch.ones(2), fire[5], torch.arange(2), torch.arange(2))
    with pytest.raises(TypeError, match="fire_bias: threshold is float; expected a torch.Tensor"):
        posenc.fire_bias(*fire[:5], 8.0, torch.arange(2), torch.arange(2))
    tupe = [torch.zeros(16, 4), torch.zeros(4, 6), torch.zeros(4, 6), torch.zeros(2), torch.zeros(2)]
    with pytest.raises(ValueError, match=r"tupe_bias: heads = 3, theta1 shape \[2\], u_q shape \[4, 6\]; expected "
                                         r"theta1 \[heads\]"):
        posenc.tupe_bias(*tupe, torch.arange(2), torch.arange(2), 3)
    with pytest.raises(ValueError, match=r"tupe_bias: table \[16, 4\], u_q \[4, 6\], u_k \[5, 6\]"):
        posenc.tupe_bias(*tupe[:2], torch.zeros(5, 6), *tupe[3:], torch.arange(2), torch.arange(2), 2)
    with pytest.raises(ValueError, match="position = 16; expected < max_len = 16"):
        posenc.tupe_bias(*tupe, torch.arange(2), torch.arange(17), 2)


def test_meta_tensors_give_shapes_and_other_dtypes_raise_type_error():
    # Meta tensors run the fake kernel (python/posenc/_fake.py), as torch's own ops infer shapes.
    q_out, k_out = posenc.rope(torch.empty(1, 3, 2, 8, device="meta"), torch.empty(1, 3, 1, 8, device="meta"))
    assert q_out.device.type == "meta" and q_out.shape == (1, 3, 2, 8) and k_out.shape == (1, 3, 1, 8)
    with pytest.raises(TypeError, match="dtype = Int"):
        posenc.rope(torch.zeros(1, 3, 2, 8, dtype=torch.int32))


# ------------------------------------------------------------------ rope: in place, xPos, multi-axis

def test_rope_in_place_matches_out_of_place_and_differentiates():
    q = torch.randn(2, 9, 4, 16, dtype=torch.float64)
    k = torch.randn(2, 9, 2, 16, dtype=torch.float64)
    positions = torch.arange(9) + 5
    want_q, want_k = posenc.rope(q, k, positions)
    got_q, got_k = q.clone(), k.clone()
    ret_q, ret_k = posenc.rope_(got_q, got_k, positions)
    assert ret_q.data_ptr() == got_q.data_ptr() and ret_k.data_ptr() == got_k.data_ptr()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # Under autograd: a non-leaf rotated in place gets the same gradient as the out-of-place op.
    leaf = q.clone().requires_grad_()
    y, _ = posenc.rope_(leaf * 1.0, None, positions)
    (g_inplace,) = torch.autograd.grad((y * y.detach()).sum(), leaf)
    leaf2 = q.clone().requires_grad_()
    y2, _ = posenc.rope(leaf2, None, positions)
    (g_out,) = torch.autograd.grad((y2 * y2.detach()).sum(), leaf2)
    assert torch.equal(g_inplace, g_out)
    with pytest.raises(RuntimeError):
        posenc.rope_(torch.randn(1, 3, 1, 4, requires_grad=True), None, torch.arange(3))


def test_rope_xpos_matches_the_formula():
    q = torch.randn(1, 12, 2, 16, dtype=torch.float64)
    k = torch.randn(1, 12, 2, 16, dtype=torch.float64)
    positions = torch.arange(12) * 7
    scale_base, center = 64.0, 30.0
    got_q, got_k = posenc.rope(q, k, positions, xpos=(scale_base, center))
    half = 8
    zeta = (2 * torch.arange(half, dtype=torch.float64) + 0.4 * 16) / (1.4 * 16)
    e = (positions.to(torch.float64) - center) / scale_base
    scale = zeta[None, :] ** e[:, None]  # [S, pairs]
    scale = torch.cat((scale, scale), dim=-1)[None, :, None, :]
    rotated_q = reference_rope_half_split(q[0], positions, 10000.0)[None]
    rotated_k = reference_rope_half_split(k[0], positions, 10000.0)[None]
    # fp64 kernels (the reference path) against the formula: a few ulps of values <= ~4.
    assert torch.allclose(got_q, rotated_q * scale, atol=1e-12, rtol=0)
    assert torch.allclose(got_k, rotated_k / scale, atol=1e-12, rtol=0)
    # q·k then depends on the distance only (up to the decay ζ^((m - n)/scale_base)).
    assert torch.autograd.gradcheck(lambda x: posenc.rope(x, None, positions, xpos=scale_base)[0],
                                    (q.clone().requires_grad_(),))


def test_rope_multi_interleaved_follows_qwen3_vl():
    # transformers' apply_interleaved_mrope (Qwen3-VL): the time axis' frequencies, overwritten at
    # slice(1, 3 * 20, 3) by height's and slice(2, 3 * 20, 3) by width's; sections [24, 20, 20].
    sections, d = [24, 20, 20], 128
    torch.manual_seed(31)
    positions = torch.randint(0, 3000, (3, 7))
    inv_freq = 1.0 / 5e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions[:, :, None].double() * inv_freq  # [3, S, 64]
    angles = freqs[0].clone()
    for dim, offset in ((1, 1), (2, 2)):
        angles[:, offset:sections[dim] * 3:3] = freqs[dim][:, offset:sections[dim] * 3:3]
    emb = torch.cat((angles, angles), dim=-1)[None, :, None, :]
    q = torch.randn(1, 7, 2, d, dtype=torch.float64)
    want = q * emb.cos() + torch.cat((-q[..., 64:], q[..., :64]), dim=-1) * emb.sin()
    got, _ = posenc.rope_multi(q, None, positions, sections, interleave_axes=True, base=5e6)
    # The eager angles p·θ (|p·θ| < 3000) carry up to 3000·2^-53 of rounding each, times |q| <= ~5.
    torch.testing.assert_close(got, want, rtol=0, atol=3e-12)
    axis = [1 if i % 3 == 1 and i < 60 else 2 if i % 3 == 2 and i < 60 else 0 for i in range(64)]
    assert torch.equal(posenc.rope_multi(q, None, positions, axis_of_pair=axis, base=5e6)[0], got)
    assert torch.autograd.gradcheck(
        lambda x: posenc.rope_multi(x, None, positions[:, :2], sections, interleave_axes=True)[0],
        (torch.randn(1, 2, 1, d, dtype=torch.float64, requires_grad=True),))
    with pytest.raises(ValueError, match="both given or both None"):
        posenc.rope_multi(q, None, positions, sections, axis_of_pair=axis)
    with pytest.raises(ValueError, match="interleaving gives axis 0"):
        posenc.rope_multi(q, None, positions, [4, 30, 30], interleave_axes=True)


def test_rope_multi_matches_per_axis_angles():
    q = torch.randn(1, 10, 2, 16, dtype=torch.float64)
    k = torch.randn(1, 10, 1, 16, dtype=torch.float64)
    sections = [2, 3, 3]  # pairs per axis (8 pairs)
    positions = torch.stack([torch.arange(10), torch.arange(10) % 3, torch.arange(10) // 3 + 4])
    got_q, got_k = posenc.rope_multi(q, k, positions, sections)
    inv_freq = reference_inv_freq(16, 10000.0)
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
    angles = positions[axis].T.to(torch.float64) * inv_freq[None, :]  # [S, pairs]
    emb = torch.cat((angles, angles), dim=-1)[None, :, None, :]
    for got, x in ((got_q, q), (got_k, k)):
        assert torch.allclose(got, x * emb.cos() + rotate_half(x) * emb.sin(), atol=1e-12, rtol=0)
    # Equal ids on every axis: plain RoPE.
    same = torch.arange(10).repeat(3, 1)
    assert torch.allclose(posenc.rope_multi(q, None, same, sections)[0], posenc.rope(q, None, torch.arange(10))[0],
                          atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda x: posenc.rope_multi(x, None, positions, sections)[0],
                                    (q.clone().requires_grad_(),))
    with pytest.raises(ValueError, match="one Positions per section"):
        posenc.rope_multi(q, None, positions, [2, 2])


def test_rope_with_an_offset_rotates_only_its_slice():
    # DeepSeek's MLA: RoPE on the trailing 64 of 192 dims, interleaved pairs; the rest passes.
    q = torch.randn(1, 6, 2, 192, dtype=torch.float64)
    positions = torch.arange(100, 106)
    out, _ = posenc.rope(q, None, positions, rotary_dim=64, layout="interleaved", rotary_offset=128)
    assert torch.equal(out[..., :128], q[..., :128])
    tail, _ = posenc.rope(q[..., 128:].contiguous(), None, positions, layout="interleaved")
    torch.testing.assert_close(out[..., 128:], tail, rtol=0, atol=1e-14)
    module = posenc.RotaryPositionalEncoding(192, 64, layout="interleaved", rotary_offset=128)
    k = torch.randn(1, 6, 2, 192, dtype=torch.float64)
    v = torch.randn(1, 6, 2, 128, dtype=torch.float64)
    fused = posenc.attention(q, k, v, module, causal=True, q_positions=positions, k_positions=positions)
    qr, kr = module(q, k, positions)
    eager = torch.softmax((torch.einsum("bqhd,bkhd->bhqk", qr, kr) / 192 ** 0.5).masked_fill(
        torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
    torch.testing.assert_close(fused, torch.einsum("bhqk,bkhd->bqhd", eager, v), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="rotary_offset = 130"):
        posenc.rope(q, None, positions, rotary_dim=64, rotary_offset=130)
