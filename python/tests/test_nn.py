"""posenc.nn.SelfAttention and posenc.KVCache: cached steps give what recomputing the whole
sequence gives (every registered scheme, head groups, GQA, windows; RoPE caches rotated or not,
through dynamic NTK's and LongRoPE's length thresholds; a context shift; a change of RoPE; 2 MiB
pages), the layer against an eager composition with its gradients, the tiny-model example, and
clear errors.

Tolerances: fp32 outputs of O(1) whose cached and whole-sequence paths sum in different orders
(decode splits the keys in chunks, the forward in tiles): 2e-5 absolute, about 100 ulps."""
import os
import subprocess
import sys

import pytest
import torch

import posenc
from posenc.nn import KVCache, SelfAttention

ATOL = 2e-5
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0], "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}


def perturbed(layer):
    """Parameters moved off their initial values (T5's table starts at 0, for one)."""
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return layer


def cached_run(layer, x, first, capacity=8, **cache_options):
    cache = layer.make_cache(x.shape[0], capacity=capacity, **cache_options)
    steps = [layer(x[:, :first], cache=cache)]
    steps += [layer(x[:, t:t + 1], cache=cache) for t in range(first, x.shape[1])]
    return torch.cat(steps, 1), cache


SCHEMES = [None, "rope", "alibi", "t5", "kerple", "fire", "sandwich", "shaw", "xl", "tupe", "absolute",
           [(4, "rope"), (4, "alibi")], [(2, "t5"), (2, None), (4, "kerple")]]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_cached_steps_equal_the_whole_sequence(scheme):
    torch.manual_seed(1)
    layer = perturbed(SelfAttention(64, 8, kv_heads=2, scheme=scheme))
    x = torch.randn(2, 40, 64)
    with torch.no_grad():
        full = layer(x)
        cached, cache = cached_run(layer, x, 13)
    assert cache.length == 40 and cache.capacity >= 40  # grew from 8
    torch.testing.assert_close(cached, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [5, (7, 0)])
def test_windows_with_a_cache(window):
    torch.manual_seed(2)
    layer = perturbed(SelfAttention(32, 4, scheme="rope", window=window))
    x = torch.randn(1, 30, 32)
    with torch.no_grad():
        torch.testing.assert_close(cached_run(layer, x, 4)[0], layer(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("rotated", [True, False], ids=["rotated", "raw"])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "dynamic", "factor": 2.0}, LONGROPE, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}],
                         ids=["default", "dynamic", "longrope", "yarn"])
def test_rope_caches_follow_the_frequencies_as_the_sequence_grows(rotated, scaling):
    """Past M (dynamic) or M0 (LongRoPE) the frequencies depend on the length: recomputing uses the
    current length's for every key, and a rotated cache re-rotates its keys to match."""
    torch.manual_seed(3)
    rope = posenc.RotaryPositionalEncoding(16, scaling=scaling, max_position_embeddings=32)
    layer = perturbed(SelfAttention(64, 4, kv_heads=2, scheme=rope))
    x = torch.randn(1, 48, 64)
    with torch.no_grad():
        cache = layer.make_cache(1, rotated=rotated)
        assert cache.rotated == rotated
        layer(x[:, :6], cache=cache)
        for t in range(6, 48):
            step = layer(x[:, t:t + 1], cache=cache)[:, 0]
            torch.testing.assert_close(step, layer(x[:, :t + 1])[:, -1], atol=ATOL, rtol=0, msg=f"token {t}")


@pytest.mark.parametrize("rotated", [True, False], ids=["rotated", "raw"])
def test_a_context_shift_moves_the_kept_keys(rotated):
    torch.manual_seed(4)
    rope = posenc.RotaryPositionalEncoding(16)
    cache = KVCache(1, 2, 16, capacity=64, rope=rope, rotated=rotated)
    k, v = torch.randn(1, 30, 2, 16), torch.randn(1, 30, 2, 16)
    cache.append(k, v)
    cache.shift(10)
    assert cache.positions.tolist() == list(range(20))
    q = torch.randn(1, 1, 4, 16)
    got = cache.attend(q, torch.tensor([20]))
    want = posenc.attention(q, k[:, 10:], v[:, 10:], rope, causal=True, q_positions=torch.tensor([20]),
                            k_positions=torch.arange(20))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    cache.append(torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16))  # the next token takes position 20
    assert cache.positions[-1].item() == 20


def test_a_new_rope_rerotates_a_rotated_cache():
    torch.manual_seed(5)
    short = posenc.RotaryPositionalEncoding(16, base=10000.0)
    long = posenc.RotaryPositionalEncoding(16, base=500000.0, scaling={"rope_type": "linear", "factor": 4.0})
    cache = KVCache(2, 2, 16, rope=short)
    k, v = torch.randn(2, 25, 2, 16), torch.randn(2, 25, 2, 16)
    cache.append(k, v)
    cache.set_rope(long)
    q = torch.randn(2, 3, 4, 16)
    positions = torch.arange(22, 25)
    want = posenc.attention(q, k, v, long, causal=True, q_positions=positions, k_positions=torch.arange(25))
    torch.testing.assert_close(cache.attend(q, positions), want, atol=ATOL, rtol=0)


def test_huge_pages_and_sixteen_bit_caches():
    torch.manual_seed(6)
    layer = perturbed(SelfAttention(64, 4, scheme="rope"))
    x = torch.randn(1, 20, 64)
    with torch.no_grad():
        plain = cached_run(layer, x, 5)[0]
        huge = cached_run(layer, x, 5, huge_pages=True)[0]
        assert torch.equal(plain, huge)
        # A bf16 cache rounds each stored key and value (8 bits: 2^-9 relative).
        half = cached_run(layer, x, 5, dtype=torch.bfloat16)[0]
    torch.testing.assert_close(half, plain, atol=0.05, rtol=0)


def test_the_layer_equals_an_eager_composition_with_its_gradients():
    """ALiBi, GQA: projections, softmax(q·kᵀ/√d + bias + causal mask)·v, output projection."""
    torch.manual_seed(7)
    layer = perturbed(SelfAttention(32, 4, kv_heads=2, scheme="alibi", bias=True)).double()
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    b, s, h, d = 2, 17, 4, 8
    q = layer.q_proj(x).view(b, s, h, d).transpose(1, 2)
    k = layer.k_proj(x).view(b, s, 2, d).repeat_interleave(2, dim=2).transpose(1, 2)
    v = layer.v_proj(x).view(b, s, 2, d).repeat_interleave(2, dim=2).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / d ** 0.5 + layer.scheme(torch.arange(s)).to(torch.float64)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    eager = layer.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h * d))
    fused = layer(x)
    torch.testing.assert_close(fused, eager, atol=1e-12, rtol=0)  # both fp64
    weights = [layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.o_proj.bias]
    g_fused = torch.autograd.grad(fused.square().sum(), weights)
    g_eager = torch.autograd.grad(eager.square().sum(), weights)
    for got, want in zip(g_fused, g_eager):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_learned_schemes_train_through_the_layer():
    layer = SelfAttention(32, 4, scheme=[(2, "t5"), (2, "fire")])
    layer(torch.randn(1, 12, 32)).sum().backward()
    names = {name for name, p in layer.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any("scheme_modules.0" in n for n in names) and any("scheme_modules.1" in n for n in names), names


def test_each_scheme_module_registers_itself_under_its_registry_name():
    """SelfAttention(scheme=name) builds the module the scheme's class registered for that name (no
    list in nn.py): each name is a registered scheme, and the module hands the op that scheme."""
    from posenc.registry import _ATTENTION_MODULES
    expected = {"rope": posenc.RotaryPositionalEncoding, "alibi": posenc.ALiBi, "t5": posenc.T5RelativeBias,
                "kerple": posenc.Kerple, "fire": posenc.FIRE, "sandwich": posenc.Sandwich,
                "shaw": posenc.ShawRelativePositions, "xl": posenc.TransformerXLRelative, "tupe": posenc.TUPE}
    assert set(_ATTENTION_MODULES) == set(expected)
    registered = {e["name"] for e in posenc.schemes()}
    for name, cls in expected.items():
        assert name in registered, name
        layer = SelfAttention(64, 8, kv_heads=2, scheme=name)
        assert type(layer.scheme) is cls, name
        spec, _ = layer.scheme._attention_scheme(8, False, 8)
        assert spec[1][0] == name, (name, spec)


def test_the_tiny_model_example_trains_and_generates_with_the_cache():
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "tiny_lm.py")
    run = subprocess.run([sys.executable, example, "--seconds", "2", "--generate", "40"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "generated with posenc.KVCache" in run.stdout and "largest |cached − recomputed|" in run.stdout


@pytest.mark.parametrize("make, error, message", [
    (lambda: KVCache(0, 2, 16), ValueError, "batch = 0"),
    (lambda: KVCache(1, 2, 16, dtype=torch.int32), TypeError, "dtype"),
    (lambda: KVCache(1, 2, 16, rope=posenc.RotaryPositionalEncoding(8)), ValueError, "rope.head_dim = 8"),
    (lambda: KVCache(1, 2, 16, capacity=2.5), TypeError, "capacity is float"),
    (lambda: KVCache(1, 2, 16).append(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 16)), ValueError, "k shape"),
    (lambda: KVCache(1, 2, 16).append(torch.randn(1, 3, 2, 16), torch.randn(1, 2, 2, 16)), ValueError, "tokens"),
    (lambda: KVCache(1, 2, 16).shift(1), ValueError, "n = 1"),
    (lambda: KVCache(1, 2, 16, rope=posenc.RotaryPositionalEncoding(16)).attend(torch.randn(1, 1, 2, 16), torch.tensor([0]), "alibi"),
     ValueError, "own rope"),
    (lambda: SelfAttention(30, 4), ValueError, "dim = 30"),
    (lambda: SelfAttention(32, 4, kv_heads=3), ValueError, "kv_heads = 3"),
    (lambda: SelfAttention(32, 4, scheme="bogus"), ValueError, "scheme = 'bogus'"),
    (lambda: SelfAttention(32, 4, window="wide"), TypeError, "window"),
    (lambda: SelfAttention(32, 4)(torch.randn(1, 3, 32), cache="cache"), TypeError, "cache is str"),
    (lambda: SelfAttention(32, 4)(torch.randn(1, 3, 31)), ValueError, "x shape"),
])
def test_bad_input_is_refused_by_name(make, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_set_rope_says_what_differs():
    cache = KVCache(1, 2, 16, rope=posenc.RotaryPositionalEncoding(16))
    cache.append(torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16))
    with pytest.raises(ValueError, match=r"rope.head_dim = 8; expected the cache's head_dim = 16"):
        cache.set_rope(posenc.RotaryPositionalEncoding(8))
    with pytest.raises(ValueError, match=r"rope.layout = 'interleaved'; expected the cache's rope.layout = "
                                         r"'half-split'"):
        cache.set_rope(posenc.RotaryPositionalEncoding(16, layout="interleaved"))
    with pytest.raises(ValueError, match=r"rope.rotary_dim = 8; expected the cache's rope.rotary_dim = 16"):
        cache.set_rope(posenc.RotaryPositionalEncoding(16, rotary_dim=8))
    with pytest.raises(TypeError, match="rope is ALiBi; expected a RotaryPositionalEncoding"):
        cache.set_rope(posenc.ALiBi(2))
    # An empty rotated cache and a cache of unrotated keys take any layout; the module's repr names
    # its arguments.
    empty = KVCache(1, 2, 16, rope=posenc.RotaryPositionalEncoding(16))
    empty.set_rope(posenc.RotaryPositionalEncoding(16, layout="interleaved"))
    assert empty.rope.layout == "interleaved"
    plain = KVCache(1, 2, 16, rope=posenc.RotaryPositionalEncoding(16), rotated=False)
    plain.set_rope(posenc.RotaryPositionalEncoding(16, layout="interleaved"))
    assert repr(plain.rope) == ("RotaryPositionalEncoding(head_dim=16, rotary_dim=16, base=10000.0, "
                                "layout='interleaved')")


def test_a_saved_layer_pickles_under_the_package_name_and_loads():
    """torch.save of a layer holds posenc's scheme modules under the package's name (posenc.ALiBi),
    not the part of the package that defines them, and the loaded layer gives the same output."""
    import io
    import pickletools

    layer = SelfAttention(32, 4, scheme=posenc.ALiBi(4, trainable=True))
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    names = [arg for op, arg, _ in pickletools.genops(_pickle_of(buffer.getvalue())) if isinstance(arg, str)]
    assert "posenc ALiBi" in names and not any(n.startswith("posenc._") for n in names), names
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(2, 10, 32)
    torch.testing.assert_close(loaded(x), layer(x), rtol=0, atol=0)


def _pickle_of(saved):
    """The pickle inside torch.save's zip archive."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(saved)) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
