"""posenc's ops under torch.compile and torch.library.opcheck: the attention, the sinusoid table,
the ALiBi, T5, Kerple, FIRE and TUPE biases, the learned and FLOATER tables, and Shaw's and
Transformer-XL's terms.

opcheck: the op's schema (no input mutated or aliased), its autograd registration, its fake kernel
against the real kernel's outputs (shapes, dtypes, strides), and AOTAutograd's traced forward and
backward against eager, with dynamic shapes; over schemes, head groups, gates, sinks, masks and
layouts. torch.compile(fullgraph=True): a small model of posenc.nn.SelfAttention head groups and a
FoX block with sinks, against eager, forward and every gradient, with inductor and dynamic shapes.

Run: PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python -m pytest -q python/tests/test_compile.py
"""
import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import posenc

ops = torch.ops.posenc


def op_args(q, k, v, scheme, **options):
    """The attention op's arguments for posenc.attention(q, k, v, scheme, **options), typed objects
    made from their specs."""
    defaults = dict(causal=False, window=(-1, -1), chunk_size=None, temperature=None, softcap=0.0, scale=None,
                    q_positions=None, k_positions=None, keys_rotated=False, skip_vanishing_tiles=True, sinks=None,
                    cu_seqlens=None)
    a = {**defaults, **options}
    args = list(posenc._attention_args(q, k, v, scheme, a["causal"], a["window"], a["chunk_size"], a["temperature"],
                                       a["softcap"], a["scale"], a["q_positions"], a["k_positions"],
                                       a["keys_rotated"], a["skip_vanishing_tiles"], a["sinks"], a["cu_seqlens"]))
    args[3] = [posenc._object(s) for s in args[3]]
    args[11] = None if args[11] is None else posenc._object(args[11])
    return tuple(args)


def qkv(b=2, s=11, h=4, g=2, d=8, dv=None, dtype=torch.float32, grad=True):
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, s, g, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, s, g, dv or d, dtype=dtype, requires_grad=grad)
    return q, k, v


def cases():
    """(name, args of the attention op) over the op's paths."""
    q, k, v = qkv()
    yield "alibi-trainable", op_args(q, k, v, posenc.ALiBi(4, trainable=True), causal=True)
    yield "groups-rope-t5-fire", op_args(q, k, v, [(2, "rope"), (1, posenc.T5RelativeBias(1)), (1, posenc.FIRE(1))],
                                         causal=True)
    gate = F.logsigmoid(torch.randn(2, 11, 4)).requires_grad_()
    sinks = torch.zeros(4, requires_grad=True)
    yield "fox-rope-sinks", op_args(q, k, v, posenc.Forgetting(gate, base="rope"), causal=True, sinks=sinks)
    yield "forgetting-scheme-input", op_args(q, k, v, posenc.Scheme("forgetting", 4, 8, log_fgate=gate), causal=True)
    llama4 = posenc.PositionTemperature(kind="llama4", floor_scale=4, attn_scale=0.1)
    yield "temperature-chunks-window-softcap", op_args(q, k, v, "none", causal=True, chunk_size=4, temperature=llama4,
                                                       window=(5, 0), softcap=20.0)
    yield "kerple-xl-bidirectional", op_args(q, k, v, [(2, posenc.Kerple(2)), (2, posenc.TransformerXLRelative(2, 8, 16))])
    tq, tk, tv = (x.reshape(22, *x.shape[2:]).detach().requires_grad_() for x in qkv())
    yield "packed-cu-seqlens", op_args(tq, tk, tv, "rope", causal=True, cu_seqlens=torch.tensor([0, 5, 22]))
    mq, mk, mv = qkv(d=12, dv=8)
    yield "mla-narrow-values", op_args(mq, mk, mv, "alibi", causal=True)
    yield "float64", op_args(*qkv(dtype=torch.float64), "rope", causal=True)
    yield "bfloat16", op_args(*qkv(dtype=torch.bfloat16), "alibi", causal=True)


CASES = dict(cases())


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck_attention(name):
    opcheck(ops.attention.default, CASES[name])


@pytest.mark.parametrize("name", ["groups-rope-t5-fire", "fox-rope-sinks"])
def test_opcheck_traced_path_ops(name):
    """The two ops the autograd kernel calls while it is traced: the forward with its plan, and the
    backward from the plan; attention_grad refuses a plan that is not one."""
    args = CASES[name]
    def detach(a):
        return a.detach() if isinstance(a, torch.Tensor) else [detach(t) for t in a] if isinstance(a, list) else a
    detached = [detach(a) for a in args]
    # The schemes and the temperature travel pickled, as the autograd kernel passes them.
    objects = torch.frombuffer(bytearray(torch._C._pickle_save((detached[3], detached[11]))), dtype=torch.uint8)
    planned = (*detached[:3], objects, *detached[4:11], *detached[12:])
    # Its plan tensor holds a new id at every call, so no two calls' outputs are equal: AOTAutograd's
    # comparison with eager does not apply (the attention op's opcheck covers that path).
    opcheck(ops.attention_planned.default, planned, test_utils=("test_schema", "test_faketensor"))
    out, lse, plan = ops.attention_planned(*planned)
    with pytest.raises(ValueError, match="attention_planned: objects are not the pickled"):
        ops.attention_planned(*planned[:3], torch.zeros(5, dtype=torch.uint8), *planned[4:])
    q, k, v, _, params, gates, sinks = detached[:7]
    wanted_params = [p.numel() > 0 for p in params]
    grad_args = (plan, q, k, v, params, gates, sinks, out, lse, torch.randn_like(out), wanted_params,
                 [g.numel() > 0 for g in gates], sinks is not None)
    opcheck(ops.attention_grad.default, grad_args)
    with pytest.raises(ValueError, match="attention_grad: plan = 0; expected the plan tensor"):
        ops.attention_grad(torch.zeros(1, dtype=torch.long), *grad_args[1:])
    with pytest.raises(ValueError, match="attention_grad: plan shape"):
        ops.attention_grad(torch.zeros(2), *grad_args[1:])


def table_and_bias_cases():
    """(name, op, args) for the materialising ops that trace: the sinusoid table, the ALiBi, T5,
    Kerple, FIRE and TUPE biases, the learned and FLOATER tables, Shaw's score and value terms and
    Transformer-XL's, with [S] and [B, S] positions, differentiable in their parameters."""
    torch.manual_seed(4)
    q, k = torch.arange(5) + 3, torch.arange(7)
    qb, kb = torch.stack([q, q + 9]), torch.stack([k, k + 4])
    yield "sinusoidal-interleaved", ops.sinusoidal_table, (torch.arange(7) + 100, 16, 10000.0, True, torch.float32)
    yield "sinusoidal-halves-f64", ops.sinusoidal_table, (torch.arange(9), 6, 500.0, False, torch.float64)
    slopes = posenc.alibi_slopes(4).float().requires_grad_()
    yield "alibi", ops.alibi_bias, (slopes, q, k, False)
    yield "alibi-batched-symmetric", ops.alibi_bias, (slopes, qb, kb, True)
    table = torch.randn(32, 4, requires_grad=True)
    yield "t5-bidirectional", ops.t5_bias, (table, q, k, 32, 128, True)
    yield "t5-batched-causal", ops.t5_bias, (table.detach().double().requires_grad_(), qb, kb, 32, 64, False)
    r1, r2 = (torch.rand(4, dtype=torch.float64).add(0.5).requires_grad_() for _ in range(2))
    yield "kerple-log", ops.kerple_bias, (r1, r2, q, k, False)
    yield "kerple-power-batched", ops.kerple_bias, (r1, r2, qb, kb, True)
    fire = posenc.FIRE(4)
    fire_params = (fire.w1, fire.b1, fire.w2, fire.b2, fire.c, fire.threshold)
    yield "fire", ops.fire_bias, (*fire_params, q, k)
    yield "fire-batched", ops.fire_bias, (*fire_params, qb, kb)
    table, x = torch.randn(64, 8, requires_grad=True), torch.randn(2, 5, 8, requires_grad=True)
    yield "learned", ops.learned, (table, x, q)
    yield "learned-batched-f64", ops.learned, (table.detach().double().requires_grad_(), x.detach().double(), qb)
    d_model, heads, head_dim = 8, 2, 4
    tupe = [torch.randn(*shape, dtype=torch.float64, requires_grad=True)
            for shape in ((32, d_model), (d_model, heads * head_dim), (d_model, heads * head_dim), (heads,), (heads,))]
    yield "tupe", ops.tupe_bias, (*tupe, q, k, heads, False)
    yield "tupe-batched-cls", ops.tupe_bias, (*tupe, qb, kb, heads, True)
    floater = [torch.randn(*shape, dtype=torch.float64).mul(0.5).requires_grad_()
               for shape in ((4, 3 + 1), (4,), (3, 4), (3,), (3,))]
    yield "floater", ops.floater_table, (*floater, 6, 0.1, 2)
    yield "floater-f32", ops.floater_table, (*(t.detach().float().requires_grad_() for t in floater), 3, 0.25, 1)
    sq = torch.randn(2, 5, heads, head_dim, requires_grad=True)
    key_table, value_table = (torch.randn(7, head_dim, requires_grad=True) for _ in range(2))
    yield "shaw-scores", ops.shaw_scores, (sq, key_table, q, k, 3)
    yield "shaw-scores-batched", ops.shaw_scores, (sq, key_table, qb, kb, 3)
    probs = torch.rand(2, heads, 5, 7).softmax(-1).requires_grad_()
    yield "shaw-values", ops.shaw_values, (probs, value_table, q, k, 3)
    sk = torch.randn(2, 7, heads, head_dim, requires_grad=True)
    u, v, w_r = (torch.randn(*shape, requires_grad=True) for shape in ((heads, head_dim), (heads, head_dim),
                                                                         (heads * head_dim, 6)))
    yield "xl", ops.xl_scores, (sq, sk, u, v, w_r, q, k, 0.5, 10000.0)
    yield "xl-batched-f64", ops.xl_scores, (*(t.detach().double().requires_grad_() for t in (sq, sk, u, v, w_r)),
                                            qb, kb, 0.5, 500.0)


TABLE_AND_BIAS_CASES = {name: (op, args) for name, op, args in table_and_bias_cases()}


@pytest.mark.parametrize("name", list(TABLE_AND_BIAS_CASES))
def test_opcheck_tables_and_biases(name):
    op, args = TABLE_AND_BIAS_CASES[name]
    opcheck(op.default, args)


def stickbreaking_and_cope_cases():
    """(name, op, args) for the two attentions with kernels of their own: stick-breaking (out and
    rem, both differentiable) and CoPE (out, and an lse without gradient), padded and packed, f32
    and bf16 (whose backward reads the forward's f32 out)."""
    q, k, v = qkv(b=2, s=9, h=4, g=2, d=8)
    packed = [t.detach()[0].requires_grad_() for t in (q, k, v)]
    wide = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    yield "stickbreaking", ops.stickbreaking_attention, (q, k, v, 0.0, False, [], [], True)
    yield "stickbreaking-current-packed", ops.stickbreaking_attention, (*packed, 0.5, True, [0, 4, 9], [0, 4, 9], False)
    yield "stickbreaking-bf16", ops.stickbreaking_attention, (*wide, 0.0, False, [], [], True)
    torch.manual_seed(8)
    table = torch.randn(12, 8).mul(0.1).requires_grad_()
    yield "cope", ops.cope_attention, (q, k, v, table, 0.0, [], [])
    yield "cope-packed", ops.cope_attention, (*packed, table, 0.3, [0, 4, 9], [0, 4, 9])
    yield "cope-bf16", ops.cope_attention, (*wide, table, 0.0, [], [])


STICKBREAKING_AND_COPE_CASES = {name: (op, args) for name, op, args in stickbreaking_and_cope_cases()}


@pytest.mark.parametrize("name", list(STICKBREAKING_AND_COPE_CASES))
def test_opcheck_stickbreaking_and_cope(name):
    op, args = STICKBREAKING_AND_COPE_CASES[name]
    opcheck(op.default, args)
    # The forward op the autograd kernel calls: the same out and per-row output, and the f32 out
    # for 16-bit inputs (an empty tensor otherwise).
    forward = ops.stickbreaking_attention_forward if name.startswith("stick") else ops.cope_attention_forward
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    opcheck(forward.default, detached, test_utils=("test_schema", "test_faketensor"))
    out, row, wide = forward(*detached)
    want_out, want_row = op(*detached)
    assert torch.equal(out, want_out) and torch.equal(row, want_row)
    assert wide.numel() == (out.numel() if out.dtype == torch.bfloat16 else 0)


class FoxBlock(torch.nn.Module):
    """Attention with a FoX forget gate on RoPE and learned sinks (gpt-oss)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.gate = torch.nn.Linear(dim, heads)
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        fox = posenc.Forgetting(F.logsigmoid(self.gate(x)), base="rope")
        return self.out(posenc.attention(q, k, v, fox, causal=True, sinks=self.sinks).reshape(b, s, d))


class Model(torch.nn.Module):
    """SelfAttention with RoPE, ALiBi, T5 and FIRE head groups (GQA), then a FoX block with sinks."""

    def __init__(self):
        super().__init__()
        self.attn = posenc.nn.SelfAttention(64, heads=8, kv_heads=4,
                                            scheme=[(2, "rope"), (2, "alibi"), (2, "t5"), (2, "fire")])
        self.fox = FoxBlock(64, 4)

    def forward(self, x):
        return self.fox(self.attn(x) + x)


def run(model, x, call=None):
    """model's output on x and its parameters' gradients, called as `call` (model, or compiled)."""
    model.zero_grad()
    y = (model if call is None else call)(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_without_inductor_is_bitwise_eager():
    """AOTAutograd's graphs with eager kernels: posenc's ops in the traced path give the bits of
    the eager path (no graph break: fullgraph)."""
    torch.manual_seed(1)
    model, x = Model(), torch.randn(2, 24, 64)
    want, want_grads = run(model, x)
    got, got_grads = run(model, x, torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert torch.equal(got, want)
    for name, g in want_grads.items():
        assert torch.equal(got_grads[name], g), name


def test_compile_with_inductor_and_dynamic_lengths_matches_eager():
    """Inductor compiles the model once for every sequence length (dynamic=True) and matches eager
    within float32 reassociation of the projections it fuses (posenc's ops are opaque to it); the
    same again from its FX graph cache."""
    torch.manual_seed(2)
    model = Model()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for i, length in enumerate((24, 37, 50)):
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            x = torch.randn(2, length, 64)
            want, want_grads = run(model, x)
            got, got_grads = run(model, x, compiled)
        finally:
            torch.compiler.set_stance("default")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for name, g in want_grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-4, msg=name)
    # Compiled again from inductor's FX graph cache: the graphs' constants (the pickled schemes)
    # must come back with them.
    torch._dynamo.reset()
    hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
    x = torch.randn(2, 29, 64)
    want, want_grads = run(model, x)
    got, got_grads = run(model, x, torch.compile(model, fullgraph=True, dynamic=True))
    assert torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] > hits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-4, msg=name)


def test_a_cache_runs_eagerly_inside_a_compiled_model_and_fullgraph_is_refused_by_reason():
    """KVCache changes Python state at every step: its steps run eagerly in a compiled model (the
    projections compiled), giving eager's outputs; fullgraph=True is refused with the reason."""
    torch.manual_seed(3)
    layer = posenc.nn.SelfAttention(64, heads=4, kv_heads=2, scheme="rope")
    steps = [torch.randn(1, 10, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)]
    eager_cache, compiled_cache = layer.make_cache(batch=1), layer.make_cache(batch=1)
    compiled = torch.compile(layer)
    with torch.no_grad():
        for x in steps:
            torch.testing.assert_close(compiled(x, cache=compiled_cache), layer(x, cache=eager_cache),
                                       rtol=1e-5, atol=1e-5)
    assert compiled_cache.length == eager_cache.length == 12
    with pytest.raises(Exception, match="posenc.KVCache's steps run eagerly"):
        torch.compile(layer, fullgraph=True)(steps[0], cache=layer.make_cache(batch=1))
