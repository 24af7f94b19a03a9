"""Quantized KV caches from Python: posenc.quantize_kv against torch's own float8_e4m3fn and a
hand-worked ggml block, posenc.attention(kv_format=...) against attention over the dequantised
rows (the same bits where keys are not transformed), posenc.KVCache(dtype="q8_0", ...) in a decode
loop against the float32 cache (rotated keys and rope_after_dequant, a context shift), and bad
input.

Run: PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python -m pytest -q python/tests/test_quantized.py
"""
import pytest
import torch

import posenc

FORMATS = ("q8_0", "q4_0", "fp8_e4m3")


def test_fp8_rows_are_torchs_float8_e4m3fn_of_the_scaled_row():
    torch.manual_seed(1)
    x = torch.randn(50, 96) * torch.logspace(-3, 3, 50)[:, None]
    rows = posenc.quantize_kv(x, "fp8_e4m3")
    assert rows.shape == (50, 100) and rows.dtype == torch.uint8
    scale = x.abs().amax(dim=1, keepdim=True) / 448.0
    want = (x * (1.0 / scale)).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(rows[:, 4:], want)
    assert torch.equal(rows[:, :4].contiguous().view(torch.float32), scale)
    assert torch.equal(posenc.dequantize_kv(rows, "fp8_e4m3"), scale * want.view(torch.float8_e4m3fn).float())


def test_q8_0_block_as_ggml_defines_it():
    x = torch.zeros(32)
    x[:4] = torch.tensor([127.0, -127.0, 63.5, -2.5])
    rows = posenc.quantize_kv(x, "q8_0")
    assert rows[:6].tolist() == [0x00, 0x3C, 0x7F, 0x81, 64, 0xFD]
    assert posenc.dequantize_kv(rows, "q8_0")[:4].tolist() == [127.0, -127.0, 64.0, -3.0]


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("q_len", [1, 2, 40])
def test_attention_reads_the_cache_as_its_dequantised_values(format, q_len):
    torch.manual_seed(2)
    b, s, h, g, d = 2, 130, 8, 2, 64
    q, k, v = torch.randn(b, q_len, h, d), torch.randn(b, s, g, d), torch.randn(b, s, g, d)
    kq, vq = posenc.quantize_kv(k, format), posenc.quantize_kv(v, format)
    kf, vf = posenc.dequantize_kv(kq, format), posenc.dequantize_kv(vq, format)
    with torch.no_grad():
        for scheme in (None, "alibi", posenc.ALiBi(8)):
            got = posenc.attention(q, kq, vq, scheme, causal=True, kv_format=format)
            assert torch.equal(got, posenc.attention(q, kf, vf, scheme, causal=True))
        rope = posenc.RotaryPositionalEncoding(d)
        got, lse = posenc.attention(q, kq, vq, rope, causal=True, kv_format=format, return_lse=True)
        want, want_lse = posenc.attention(q.double(), kf.double(), vf.double(), rope, causal=True, return_lse=True)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
        torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-5, rtol=0)
        half = posenc.attention(q.bfloat16(), kq, vq, "alibi", causal=True, kv_format=format)
        assert half.dtype == torch.bfloat16
        # bf16's rounding of the f32 result: half an ulp, 2^-8 relative.
        torch.testing.assert_close(half.float(), posenc.attention(q.bfloat16().float(), kf, vf, "alibi", causal=True),
                                   atol=1e-6, rtol=2 ** -8)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("after", [False, True])
def test_cache_decodes_as_the_float_cache(format, after):
    """A decode loop of 40 steps after a 60-token prompt: the quantized cache's outputs stay within the
    format's error of the float32 cache's (pre-RoPE keys, rope_after_dequant, against a float cache of
    pre-RoPE keys), through a context shift, which re-rotates and re-quantizes a rotated cache's keys."""
    torch.manual_seed(3)
    b, g, h, d = 1, 2, 8, 64
    rope = posenc.RotaryPositionalEncoding(d)
    cache = posenc.KVCache(b, g, d, dtype=format, rope=rope, rope_after_dequant=after, capacity=16)
    exact = posenc.KVCache(b, g, d, rope=rope, rotated=not after, capacity=16)
    assert cache.rotated is not after
    k, v = torch.randn(b, 60, g, d), torch.randn(b, 60, g, d)
    # About twice the largest error measured over the loop (q8_0 0.015, q4_0 0.24, fp8 0.10 at
    # |v| ~ 1): a regression, not a tolerance to grow into.
    bound = {"q8_0": 0.03, "q4_0": 0.5, "fp8_e4m3": 0.2}[format]
    for step in range(41):
        cache.append(k, v)
        exact.append(k, v)
        q = torch.randn(b, k.shape[1], h, d)
        pos = exact.positions[-k.shape[1]:]
        got, want = cache.attend(q, pos), exact.attend(q, pos)
        assert (got - want).abs().max() < bound, step
        k, v = torch.randn(b, 1, g, d), torch.randn(b, 1, g, d)
        if step == 30:
            cache.shift(50)
            exact.shift(50)
    assert cache.keys.dtype == torch.uint8 and cache.length == exact.length == 50
    keys = posenc.dequantize_kv(cache.keys, format)
    assert (keys - exact.keys).abs().max() < (3 if format == "q4_0" else 0.3)


def test_bad_input_is_named():
    q, k = torch.randn(1, 1, 2, 64), torch.randn(1, 5, 1, 64)
    kq = posenc.quantize_kv(k, "q8_0")
    with torch.no_grad():
        with pytest.raises(ValueError, match="kv_format = 'q5_0'; expected None or one of q8_0, q4_0, fp8_e4m3"):
            posenc.attention(q, kq, kq, kv_format="q5_0")
        with pytest.raises(TypeError, match=r"k is Float with kv_format = 'q8_0'; expected torch.uint8"):
            posenc.attention(q, k, kq, kv_format="q8_0")
        with pytest.raises(ValueError, match="row bytes = 68; expected a positive multiple of 18"):
            posenc.attention(q, kq, kq, kv_format="q4_0")
        with pytest.raises(ValueError, match="layout = 'bhsd' with kv_format"):
            posenc.attention(q, kq, kq, kv_format="q8_0", layout="bhsd")
    with pytest.raises(ValueError, match="with inputs that require grad; expected torch.no_grad()"):
        posenc.attention(q.requires_grad_(), kq, kq, kv_format="q8_0")
    with pytest.raises(ValueError, match="head_dim = 48 with dtype = 'q8_0'; expected a multiple of 32"):
        posenc.KVCache(1, 1, 48, dtype="q8_0")
    with pytest.raises(ValueError, match="dtype = 'int8'; expected a torch dtype or one of"):
        posenc.KVCache(1, 1, 64, dtype="int8")
    with pytest.raises(ValueError, match="format = 'q8'; expected one of q8_0, q4_0, fp8_e4m3"):
        posenc.quantize_kv(k, "q8")
    with pytest.raises(ValueError, match="dim = 48; expected a positive multiple of 32"):
        posenc.quantize_kv(torch.randn(2, 48), "q4_0")
