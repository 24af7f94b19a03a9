"""posenc.flex against posenc's fused kernel and its fp64 reference: every scheme and mask the
FlexAttention path supports, eager and compiled, float32 and bfloat16, forward and gradients.

POSENC_DEVICE=cuda runs the flex side on a GPU (scripts/gpu_check.sh); the fused kernel and the
reference stay on the CPU. The bar is flash-attention's: the flex output's largest error against
the fp64 reference is at most twice the fused kernel's, in the same dtype, plus a floor (FLOOR: 2e-6 in
float32, about 16 ulps at 1, where both errors are rounding; 2e-3 in bfloat16, a quarter ulp)."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

import posenc
import posenc.flex

DEVICE = torch.device(os.environ.get("POSENC_DEVICE", "cpu"))
CPU = DEVICE.type == "cpu"
B, S, H, G, D = 2, 40, 4, 2, 32
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 2e-3}


def _inputs(seed=0, sq=S, sk=S, packed=None):
    g = torch.Generator().manual_seed(seed)
    if packed:
        shape_q, shape_k = (packed[0], H, D), (packed[1], G, D)
    else:
        shape_q, shape_k = (B, sq, H, D), (B, sk, G, D)
    q = torch.randn(*shape_q, generator=g)
    k = torch.randn(*shape_k, generator=g)
    v = torch.randn(*shape_k, generator=g)
    return q, k, v


def _gate(seed=1, shape=(B, S, H)):
    return F.logsigmoid(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) + 3.0)


def _trained(module, seed=2):
    """A module whose parameters are random (zeros at first would hide a wrong lookup); positive
    ones (slopes, Kerple's r, FIRE's c and L) stay positive."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            noise = 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)
            if (p > 0).all():
                p.mul_(noise.exp())
            else:
                p.add_(noise)
    return module


def _fire():
    return _trained(posenc.FIRE(H, hidden=8, threshold=16.0))


def _sink_group():
    return _trained(posenc.Scheme("sinks", 2, D))


# name -> (options of posenc.attention, input shapes): schemes, then masks and positions.
CASES = {
    "nope": dict(scheme=None),
    "rope": dict(scheme="rope"),
    "rope-interleaved-partial-xpos": dict(scheme=posenc.RotaryPositionalEncoding(D, rotary_dim=16,
                                                                                 layout="interleaved", xpos=512)),
    "rope-yarn": dict(scheme=posenc.RotaryPositionalEncoding(D, scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    "keys-rotated": dict(scheme="rope", keys_rotated=True),
    "shortformer": dict(scheme=posenc.SinusoidalPositionalEncoding(D)),
    "alibi": dict(scheme="alibi"),
    "alibi-trainable": dict(scheme=_trained(posenc.ALiBi(H, trainable=True))),
    "t5": dict(scheme=_trained(posenc.T5RelativeBias(H, num_buckets=8, max_distance=16))),
    "kerple": dict(scheme=_trained(posenc.Kerple(H))),
    "sandwich": dict(scheme=posenc.Sandwich(H, dim=32)),
    "fire": dict(scheme=_fire()),
    "forgetting": dict(scheme="gate"),
    "fox-pro": dict(scheme="gate+rope"),
    "sinks": dict(scheme="rope", sinks="sinks"),
    "sinks-group": dict(scheme=[(2, _sink_group()), (2, "alibi")]),
    "head-groups": dict(scheme=[(2, _trained(posenc.ALiBi(2, trainable=True))), (2, "rope")]),
    "llama4-temperature": dict(scheme=None, temperature=posenc.PositionTemperature("llama4", floor_scale=8,
                                                                                  attn_scale=0.1)),
    "softcap": dict(scheme="alibi", softcap=2.0),
    "bidirectional": dict(scheme=_trained(posenc.T5RelativeBias(H, num_buckets=8, max_distance=16)), causal=False),
    "window": dict(scheme="alibi", window=(6, 0)),
    "window-both-sides": dict(scheme="rope", causal=False, window=(5, 3)),
    "chunked": dict(scheme="rope", chunk_size=16),
    "cache-offset": dict(scheme="alibi", shape=dict(sq=7, sk=S)),
    "decode": dict(scheme=_fire(), shape=dict(sq=1, sk=S)),
    "positions": dict(scheme=_trained(posenc.Kerple(H)), q_positions=torch.arange(S) * 3 + 5,
                      k_positions=torch.arange(S) * 3 + 5),
    # Rows at different offsets, under schemes that read absolute positions (a wrong row would show).
    "positions-per-row": dict(scheme=posenc.SinusoidalPositionalEncoding(D),
                              q_positions=torch.stack([torch.arange(S), torch.arange(S) + 100]),
                              k_positions=torch.stack([torch.arange(S), torch.arange(S) + 100])),
    "positions-per-row-fire": dict(scheme=_fire(), q_positions=torch.stack([torch.arange(S), torch.arange(S) + 60]),
                                   k_positions=torch.stack([torch.arange(S), torch.arange(S) + 60])),
    # A position bias tabulated over the distinct query × key positions, rows at different offsets;
    # bidirectional, so that both [CLS] parameters reach a row of more than one key.
    "tupe-positions-per-row": dict(scheme=_trained(posenc.TUPE(H, D, 16, 64, cls_reset=True)), causal=False,
                                   q_positions=torch.stack([torch.arange(S), torch.arange(S) + 20]),
                                   k_positions=torch.stack([torch.arange(S), torch.arange(S) + 20])),
    "chunked-by-position": dict(scheme="alibi", chunk_size=16, q_positions=torch.arange(S) * 2 + 3,
                                k_positions=torch.arange(S) * 2 + 3),
    "layout-bhsd": dict(scheme="rope", layout="bhsd"),
    "more-queries-than-keys": dict(scheme="alibi", shape=dict(sq=S, sk=20)),
    "no-keys": dict(scheme="alibi", sinks="sinks", shape=dict(sq=3, sk=0)),
    "shortformer-in-a-later-group": dict(scheme=[(2, "alibi"), (2, posenc.SinusoidalPositionalEncoding(D))]),
    "packed-sinks-window": dict(scheme="rope", sinks="sinks", window=(4, 0), cu_seqlens=[0, 9, 9, 30, 41],
                                shape=dict(packed=(41, 41))),
    "packed-queries-and-keys": dict(scheme=_trained(posenc.Kerple(H)), cu_seqlens=([0, 3, 10, 14], [0, 9, 30, 41]),
                                    shape=dict(packed=(14, 41))),
    "packed": dict(scheme="alibi", cu_seqlens=[0, 9, 30, 41], shape=dict(packed=(41, 41))),
    "packed-forgetting": dict(scheme="gate", cu_seqlens=[0, 9, 30, 41], shape=dict(packed=(41, 41))),
}


def _options(name, dtype, device):
    """posenc.attention's keyword arguments and (q, k, v) of a case in dtype on device."""
    options = dict(CASES[name])
    shape = options.pop("shape", {})
    options.setdefault("causal", True)
    q, k, v = _inputs(packed=shape.get("packed"), **{k: v for k, v in shape.items() if k != "packed"})
    packed = "packed" in shape
    if options.get("layout") == "bhsd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if options["scheme"] in ("gate", "gate+rope"):
        gate = _gate(shape=(k.shape[0], H) if packed else (B, k.shape[1], H))
        options["scheme"] = posenc.Forgetting(gate.to(device, dtype if dtype != torch.float64 else dtype),
                                              base="rope" if options["scheme"] == "gate+rope" else None)
    if options.get("sinks") == "sinks":
        options["sinks"] = torch.randn(H, generator=torch.Generator().manual_seed(3)).to(device)
    return options, (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype))


def _on(options, device, dtype=None):
    """The options with their tensors (sinks, gates) moved; modules stay where they are."""
    out = dict(options)
    if isinstance(out.get("sinks"), torch.Tensor):
        out["sinks"] = out["sinks"].to(device)
    if isinstance(out["scheme"], posenc.Forgetting):
        gate = out["scheme"].log_fgate.to(device, dtype or out["scheme"].log_fgate.dtype)
        out["scheme"] = posenc.Forgetting(gate, base=out["scheme"].base)
    return out


def _modules_to(options, device):
    scheme = options["scheme"]
    for _, s in (scheme if isinstance(scheme, list) else [(None, scheme)]):
        if isinstance(s, torch.nn.Module):
            s.to(device)


def _errors(name, dtype, compiled):
    options, (q, k, v) = _options(name, dtype, torch.device("cpu"))
    _modules_to(options, torch.device("cpu"))
    ref = posenc.attention(q.double(), k.double(), v.double(), **_on(options, "cpu", torch.float64))
    fused = posenc.attention(q, k, v, **options)
    _modules_to(options, DEVICE)
    try:
        with torch.no_grad():
            flex = posenc.flex.attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), compiled=compiled,
                                         **_on(options, DEVICE))
    finally:
        _modules_to(options, torch.device("cpu"))
    return (fused.double() - ref).abs().max().item(), (flex.cpu().double() - ref).abs().max().item(), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_eager(name, dtype):
    fused, flex, ref = _errors(name, dtype, compiled=False)
    assert flex <= 2 * fused + FLOOR[dtype] * max(1.0, ref.abs().max().item()), (fused, flex)


@pytest.mark.parametrize("name", [e["name"] for e in posenc.schemes() if e["family"] in ("transform", "token-term")])
def test_every_registered_transform_and_token_term_by_name(name):
    """Each registered transform (xPos, Shortformer, …) by its name alone, read through the library's
    definition, and each token term whose input declares its logit form (FoX's gates as a
    posenc.Scheme), at positions past a cache's offset."""
    q, k, v = _inputs(sq=S // 2)
    inputs = {e["name"]: e for e in posenc.schemes()}[name]["inputs"]
    scheme = posenc.Scheme(name, H, D, **{i["name"]: _gate(shape=(B, S, H)) for i in inputs})
    options = dict(scheme=scheme, causal=True, q_positions=torch.arange(S // 2, S) + 300,
                   k_positions=torch.arange(S) + 300)
    ref = posenc.attention(q.double(), k.double(), v.double(), **options)
    fused = posenc.attention(q, k, v, **options)
    with torch.no_grad():
        flex = posenc.flex.attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), compiled=False, **options)
    fused_error = (fused.double() - ref).abs().max().item()
    flex_error = (flex.cpu().double() - ref).abs().max().item()
    assert flex_error <= 2 * fused_error + FLOOR[torch.float32] * max(1.0, ref.abs().max().item())


# Compiled FlexAttention: every case in float32, and a few in bfloat16 (each compiles its own kernel).
COMPILED = [(name, torch.float32) for name in CASES] + [
    (name, torch.bfloat16) for name in ("rope", "t5", "fire", "fox-pro", "sinks", "packed")]


@pytest.mark.parametrize("name,dtype", COMPILED, ids=[f"{n}-{'f32' if d == torch.float32 else 'bf16'}"
                                                      for n, d in COMPILED])
def test_forward_compiled(name, dtype):
    fused, flex, ref = _errors(name, dtype, compiled=True)
    assert flex <= 2 * fused + FLOOR[dtype] * max(1.0, ref.abs().max().item()), (fused, flex)


def test_an_error_in_a_term_fails_the_bar():
    """The bar can fail: a slope off by 0.1% shows."""
    q, k, v = _inputs()
    ref = posenc.attention(q.double(), k.double(), v.double(), "alibi", causal=True)
    fused = posenc.attention(q, k, v, "alibi", causal=True)
    wrong = posenc.ALiBi(H)
    wrong.slopes.mul_(1.001)
    with torch.no_grad():
        flex = posenc.flex.attention(q, k, v, wrong, causal=True, compiled=False)
    assert (flex.double() - ref).abs().max() > 2 * (fused.double() - ref).abs().max() + FLOOR[torch.float32]


# ─── Gradients ─────────────────────────────────────────────────────────────────────────────────

def _learned(options):
    """The tensors a case learns besides q, k, v: module parameters, gates and sinks."""
    scheme, tensors = options["scheme"], []
    for _, s in (scheme if isinstance(scheme, list) else [(None, scheme)]):
        if isinstance(s, torch.nn.Module):
            tensors += [p for p in s.parameters()]
        if isinstance(s, posenc.Forgetting):
            tensors.append(s.log_fgate)
    if isinstance(options.get("sinks"), torch.Tensor):
        tensors.append(options["sinks"])
    return tensors


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    """torch refuses FlexAttention's backward on the CPU at its entry only (``_validate_device``);
    its eager path, the one this test runs, has a dense backward. Lifted for the test's call."""
    if CPU:
        monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)


def _gradients(name, dtype, run):
    """d(Σ w·out)/d(q, k, v, learned) of run(q, k, v, options) in float64 on the CPU."""
    options, (q, k, v) = _options(name, dtype, torch.device("cpu"))
    scheme = options["scheme"]
    if isinstance(scheme, posenc.Forgetting):
        options["scheme"] = posenc.Forgetting(scheme.log_fgate.clone().requires_grad_(), base=scheme.base)
    if isinstance(options.get("sinks"), torch.Tensor):
        options["sinks"] = options["sinks"].clone().requires_grad_()
    learned = _learned(options)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = run(*inputs, options)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad((out.double().cpu() * weights.double()).sum(), inputs + learned, allow_unused=True)
    return [None if g is None else g.double().cpu() for g in grads]


def _run_flex(q, k, v, options):
    _modules_to(options, DEVICE)
    call = posenc.flex.prepare(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), **_on(options, DEVICE))
    flex = None if CPU else torch.compile(torch_flex.flex_attention)
    return call.run(flex)[0]


def _run_fused(dtype):
    def run(q, k, v, options):
        _modules_to(options, torch.device("cpu"))
        return posenc.attention(q.to(dtype), k.to(dtype), v.to(dtype), **_on(options, "cpu", dtype))
    return run


GRADIENT_CASES = ["rope", "alibi-trainable", "t5", "kerple", "fire", "forgetting", "fox-pro", "sinks",
                  "sinks-group", "head-groups", "softcap", "window", "chunked", "cache-offset", "packed",
                  "packed-forgetting", "bidirectional", "llama4-temperature", "shortformer", "positions-per-row-fire",
                  "tupe-positions-per-row", "packed-sinks-window", "packed-queries-and-keys", "layout-bhsd"]


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_gradients(name, cpu_flex_backward):
    """Every gradient (q, k, v, each parameter, gate and sink) within 2× the fused kernel's error."""
    dtype = torch.float32
    ref = _gradients(name, dtype, _run_fused(torch.float64))
    fused = _gradients(name, dtype, _run_fused(dtype))
    flex = _gradients(name, dtype, _run_flex)
    options, (q, k, _) = _options(name, dtype, torch.device("cpu"))
    rows = 1 if "cu_seqlens" in options else q.shape[0]
    pairs = H * (q.numel() // (H * D)) * (k.numel() // (G * D)) // rows  # (query, key) pairs of every head
    # Every learned tensor has a gradient to compare (none is left out of the graph).
    assert all(r is not None and r.abs().max() > 0 for r in ref), [r is None for r in ref]
    for i, (r, a, b) in enumerate(zip(ref, fused, flex)):
        err_fused, err_flex = (a - r).abs().max().item(), (b - r).abs().max().item()
        # q, k, v: a floor of float32 rounding. A parameter's gradient is a sum over every (query,
        # key) pair, which torch's FlexAttention forms in float32 (the fused kernel in fp64): the
        # floor is then a random walk of float32 roundings over those pairs, ε·√pairs, taken four
        # times: a correct sum passes but about once in 10^4 runs (at two, once in 20: FIRE's c,
        # one scalar, exceeded it).
        floor = 1e-5 if i < 3 else 4 * torch.finfo(torch.float32).eps * pairs ** 0.5
        assert err_flex <= 2 * err_fused + floor * max(1.0, r.abs().max().item()), (i, err_fused, err_flex)


# ─── The entry point, the limits, bad input ────────────────────────────────────────────────────

def test_backend_flex_is_posenc_flex():
    q, k, v = _inputs()
    with torch.no_grad():
        a = posenc.attention(q, k, v, "alibi", causal=True, backend="flex")
        b = posenc.flex.attention(q, k, v, "alibi", causal=True)
        fused = posenc.attention(q, k, v, "alibi", causal=True, backend="fused")
    assert torch.equal(a, b)
    assert (a - fused).abs().max() < 1e-5


def test_backend_must_be_known():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="backend = 'triton'"):
        posenc.attention(q, k, v, backend="triton")


@pytest.mark.parametrize("scheme,why", [
    (lambda: posenc.ShawRelativePositions(8, D), "Shaw"),
    (lambda: posenc.TransformerXLRelative(H, D, 64), "Transformer-XL"),
    (lambda: posenc.CoPE(16, D), "CoPE"),
    (lambda: "stickbreaking", "replace the softmax"),
    (lambda: posenc.Scheme("table", H, D, max_distance=8), "fp64 definition in C"),
])
def test_schemes_without_a_score_function_are_refused(scheme, why):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=f"not supported through FlexAttention: .*{why}.*backend='fused'"):
        posenc.flex.prepare(q, k, v, scheme(), causal=True)


def test_scattered_positions_beyond_a_table_are_refused():
    q, k, v = _inputs()
    far = torch.arange(S) * (1 << 20)
    with pytest.raises(ValueError, match="positions span .* values; expected at most"):
        posenc.flex.prepare(q, k, v, "alibi", causal=True, q_positions=far, k_positions=far)


def test_long_calls_beyond_a_position_table_are_refused(monkeypatch):
    q, k, v = _inputs()
    far = torch.arange(S) * 200
    monkeypatch.setattr(posenc.flex, "_TABLE_LIMIT", 1024)
    with pytest.raises(ValueError, match=r"4 heads × 40 query × 40 key positions; expected at most 1024 entries"):
        posenc.flex.prepare(q, k, v, posenc.TUPE(H, D, 16, 8000), causal=True, q_positions=far, k_positions=far)


@pytest.mark.skipif(not CPU, reason="the CPU's FlexAttention limits")
def test_training_on_the_cpu_is_refused_with_the_reason():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="q, k or v requires grad on the CPU"):
        posenc.flex.attention(q.requires_grad_(), k, v, "alibi", causal=True, compiled=False)
    fire = posenc.FIRE(H, hidden=8)
    with pytest.raises(ValueError, match="scheme parameter .* requires grad on the CPU.*compiled"):
        posenc.flex.attention(q.detach(), k, v, fire, causal=True)
    with pytest.raises(ValueError, match="return_lse = True with compiled=True on the CPU"):
        with torch.no_grad():
            posenc.flex.attention(q.detach(), k, v, "alibi", causal=True, return_lse=True)


def test_lse_matches_the_fused_kernel():
    q, k, v = _inputs()
    sinks = torch.randn(H)
    with torch.no_grad():
        _, lse_flex = posenc.flex.attention(q, k, v, "alibi", causal=True, sinks=sinks, return_lse=True,
                                            compiled=False)
    _, lse = posenc.attention(q, k, v, "alibi", causal=True, sinks=sinks, return_lse=True)
    assert (lse_flex - lse).abs().max() < 1e-5


def test_the_call_is_usable_with_ones_own_flex_attention():
    """prepare() hands over FlexAttention's own arguments: a caller runs them with its flex call."""
    q, k, v = _inputs()
    call = posenc.flex.prepare(q, k, v, posenc.T5RelativeBias(H), causal=True, window=(8, 0))
    out = torch_flex.flex_attention(call.q, call.k, call.v, score_mod=call.score_mod, block_mask=call.block_mask,
                                    enable_gqa=call.enable_gqa)
    fused = posenc.attention(q, k, v, posenc.T5RelativeBias(H), causal=True, window=(8, 0))
    assert (out.transpose(1, 2) - fused).abs().max() < 1e-5


@pytest.mark.parametrize("scheme", ["rope", "alibi", "fire"])
def test_self_attention_runs_on_either_backend(scheme):
    """posenc.nn.SelfAttention with backend="flex" (the default off the CPU) gives the fused layer's output."""
    torch.manual_seed(0)
    layer = posenc.nn.SelfAttention(64, 4, kv_heads=2, scheme=scheme)
    x = torch.randn(2, 24, 64)
    with torch.no_grad():
        fused = layer(x)
        layer.backend = "flex"
        flex = layer.to(DEVICE)(x.to(DEVICE)).cpu()
    assert (flex - fused).abs().max() < 1e-5
    with pytest.raises(ValueError, match="backend = 'cuda'"):
        posenc.nn.SelfAttention(64, 4, backend="cuda")


@pytest.mark.parametrize("options,message", [
    (dict(causal=True, window=(-1, 2)), r"window\[1\] = 2 with causal"),
    (dict(window=(-3, 0)), r"window = \(-3, 0\); expected entries >= -1"),
    (dict(softcap=-1.0), "softcap = -1.0"),
    (dict(sinks=torch.tensor([float("nan"), 0.0, 0.0, 0.0])), "sinks hold a NaN"),
    (dict(q_positions=torch.arange(S, dtype=torch.float32)), "q_positions dtype torch.float32"),
    (dict(k_positions=torch.arange(S) - 1), r"k_positions from -1 to .*expected positions in \[0, 2\^40\]"),
    (dict(scheme="gate-short", causal=True), r"log_fgate shape \(2, 39, 4\); expected \[2, 40, 4\]"),
    (dict(scheme="gate-positive", causal=True), "log_fgate holds a value > 0"),
    (dict(chunk_size=8, k_positions=torch.arange(S).flip(0)), "k_positions decrease within a sequence"),
])
def test_bad_input_is_refused_as_the_fused_kernel_refuses_it(options, message):
    q, k, v = _inputs()
    options = dict(options)
    if options.get("scheme") == "gate-short":
        options["scheme"] = posenc.Forgetting(_gate(shape=(B, S - 1, H)))
    elif options.get("scheme") == "gate-positive":
        options["scheme"] = posenc.Forgetting(_gate().abs())
    with pytest.raises((ValueError, TypeError), match=message):
        posenc.flex.prepare(q, k, v, **options)
    with pytest.raises((ValueError, TypeError)):
        posenc.attention(q, k, v, **options)
