"""The registry from Python: posenc.schemes(); posenc.Scheme for every registered scheme (gradcheck
of the fused op in float64, float32 against float64); posenc.RelativeBias for every registered
scheme of the relative-bias family (against eager PyTorch in float64, gradcheck); head groups in
one posenc.attention call, and the errors.

Run: PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python -m pytest -q python/tests
"""
import math

import pytest
import torch

import posenc
from posenc._attention import _attention_args, _attention_op
from posenc.registry import _scheme_entry

torch.manual_seed(0)


def eager(q, k, v, bias, causal=True):
    """softmax(q·kᵀ/sqrt(D) + bias + causal mask)·v in the input's dtype; bias [1 or B, H, Sq, Sk]."""
    h, g = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]) + bias
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def relative_bias_names():
    return [e["name"] for e in posenc.schemes() if e["family"] == "relative-bias"]


def test_the_listing_describes_every_scheme():
    entries = posenc.schemes()
    names = [e["name"] for e in entries]
    for name in ["none", "rope", "alibi", "t5", "kerple", "fire", "tupe", "shaw", "xl"]:
        assert name in names
    for e in entries:
        assert e["summary"] and e["source"] and e["family"]
        for option in e["options"]:
            assert set(option) == {"name", "default", "integer", "description"}
        assert isinstance(e["causal_only"], bool)
        # Fixed parameters are some: a scheme without any has nothing to fix.
        assert isinstance(e["parameters_fixed"], bool) and (bool(e["parameters"]) or not e["parameters_fixed"])
        for i in e["inputs"]:
            assert set(i) == {"name", "description", "typical", "logit_form"} and i["description"]
            assert len(i["typical"]) == 2 and i["typical"][0] <= i["typical"][1]
            assert i["logit_form"] in ("", "sum_after_key")
        for variant in e["length_variants"]:
            assert set(variant) == {"name", "summary"} and variant["name"] and variant["summary"]
    assert [v["name"] for v in entries[names.index("rope")]["length_variants"]] == ["ntk", "yarn"]


@pytest.mark.parametrize("name", relative_bias_names())
def test_every_relative_bias_module_matches_eager_attention(name):
    module = posenc.RelativeBias(name, 4)
    if module.parameters_ is not None:  # off the initial values (T5's zeros, equal slopes); signs kept
        with torch.no_grad():
            module.parameters_.mul_(torch.empty_like(module.parameters_).uniform_(0.5, 1.5))
            module.parameters_.add_(torch.empty_like(module.parameters_).uniform_(0.0, 0.1))
    q = torch.randn(2, 33, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 40, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 40, 2, 16, dtype=torch.float64, requires_grad=True)
    q_pos, k_pos = torch.arange(7, 40), torch.arange(40)
    bias = module(q_pos, k_pos, dtype=torch.float64)  # the fp64 values the fp64 attention uses
    assert bias.shape == (1, 4, 33, 40)
    expected = eager(q, k, v, bias)
    fused = posenc.attention(q, k, v, module, causal=True)
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(fused.sum(), [q, k, v] + ([module.parameters_] if module.parameters_ is not None
                                                           else []))
    wanted = torch.autograd.grad(eager(q, k, v, module(q_pos, k_pos, dtype=torch.float64)).sum(),
                                 [q, k, v] + ([module.parameters_] if module.parameters_ is not None else []))
    for got, want in zip(grads, wanted):
        # The module's parameters are float32; their gradient is summed in fp64 then rounded once.
        torch.testing.assert_close(got.to(torch.float64), want.to(torch.float64), rtol=1e-6, atol=1e-6)
    # float32 through the fused kernel against the float64 composition: f32 accuracy.
    fused32 = posenc.attention(q.float(), k.float(), v.float(), module, causal=True)
    torch.testing.assert_close(fused32.to(torch.float64), expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", [n for n in relative_bias_names()
                                  if posenc.RelativeBias(n, 3).parameters_ is not None])
def test_materialised_biases_pass_gradcheck(name):
    module = posenc.RelativeBias(name, 3)
    params = (module.parameters_.detach().to(torch.float64) + 0.1).requires_grad_()
    q_pos, k_pos = torch.tensor([0, 3, 9, 20]), torch.arange(12)
    scheme = torch.classes.posenc.Scheme(name, 3, {}, None)
    assert torch.autograd.gradcheck(
        lambda p: torch.ops.posenc.score_bias(scheme, p, q_pos, k_pos, torch.float64), (params,))


def all_names():
    return [e["name"] for e in posenc.schemes()]


def small_options(entry, head_dim):
    """Options that keep every scheme's tables small (as the C++ matrix's)."""
    wanted = {"hidden": 6, "threshold": 4, "d_model": 12, "max_len": 32, "max_distance": 5, "num_buckets": 8,
              "dim": head_dim if entry["family"] == "transform" else 24}
    return {o["name"]: wanted[o["name"]] for o in entry["options"] if o["name"] in wanted}


def fused(q, k, v, module, params, scheme_inputs=None):
    """The attention op with `params` as the module's parameter tensor and `scheme_inputs` (a dict)
    as its per-token inputs (causal)."""
    if scheme_inputs:
        module = posenc.Scheme(module.name, module.heads, module.head_dim, **module.options, **scheme_inputs)
    args = list(_attention_args(q, k, v, module, True, (-1, -1), None, None, 0.0, None, None, None, False,
                                       True, None))
    if params is not None:
        args[4] = [params]
    return _attention_op(*args)[0]


def typical_inputs(entry, batch, keys, heads, dtype=torch.float64):
    """The entry's per-token inputs [B, Sk, heads], drawn from their typical ranges."""
    return {i["name"]: torch.empty(batch, keys, heads, dtype=dtype).uniform_(*i["typical"]) for i in entry["inputs"]}


@pytest.mark.parametrize("name", all_names())
def test_every_registered_scheme_runs_by_name_and_differentiates(name):
    entry = _scheme_entry(name)
    scheme_inputs = {n: t.requires_grad_() for n, t in typical_inputs(entry, 1, 9, 4).items()}
    module = posenc.Scheme(name, 4, 8, **small_options(entry, 8), **scheme_inputs)
    assert (module.parameters_ is None) == (entry["parameters"] == "")
    q = torch.randn(1, 6, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 9, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 9, 2, 8, dtype=torch.float64, requires_grad=True)
    inputs = [q, k, v]
    params = None
    if module.parameters_ is not None:
        # Off the initial values (zero tables, equal slopes); positive ones stay positive.
        p = module.parameters_.detach().to(torch.float64)
        p = torch.where(p == 0, torch.empty_like(p).uniform_(-0.5, 0.5), p * torch.empty_like(p).uniform_(0.5, 1.5))
        params = p.requires_grad_()
        inputs.append(params)
    names = list(scheme_inputs)
    inputs += [scheme_inputs[n] for n in names]
    with_params = params is not None

    def call(*x):
        ins = dict(zip(names, x[3 + with_params:]))
        return fused(x[0], x[1], x[2], module, x[3] if with_params else None, ins)

    # float64 runs the fp64 reference: its backward against central differences of its forward.
    assert torch.autograd.gradcheck(call, tuple(inputs))
    # The fused float32 kernel against it: f32 sums over 9 keys of terms |p·v| <= a few units
    # (2e-5); parameter and input gradients are summed over (query, key) pairs, 1e-3 of the largest.
    exact = call(*inputs)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs]
    out32 = call(*inputs32)
    torch.testing.assert_close(out32.double(), exact, rtol=0, atol=2e-5)
    w = torch.randn_like(exact)
    grads = torch.autograd.grad((exact * w).sum(), inputs)
    grads32 = torch.autograd.grad((out32 * w.float()).sum(), inputs32)
    for got, want in zip(grads32, grads):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-3 * (want.abs().max().item() + 1e-3))
    # The module itself in posenc.attention: its float32 parameters receive the gradient.
    if module.parameters_ is not None:
        posenc.attention(*inputs32[:3], module, causal=True).sum().backward()
        assert module.parameters_.grad is not None and module.parameters_.grad.shape == module.parameters_.shape


def test_a_generic_rope_reads_a_rotated_cache():
    q = torch.randn(1, 1, 4, 16, dtype=torch.float64)
    k, v = torch.randn(1, 12, 2, 16, dtype=torch.float64), torch.randn(1, 12, 2, 16, dtype=torch.float64)
    rope = posenc.Scheme("rope", 4, 16)
    k_rotated = posenc.rope(k, None, torch.arange(12))[0]
    expected = posenc.attention(q, k, v, rope, causal=True)
    torch.testing.assert_close(posenc.attention(q, k_rotated, v, rope, causal=True, keys_rotated=True), expected,
                               rtol=1e-12, atol=1e-12)
    assert "head_dim" not in repr(posenc.RelativeBias("alibi", 4)) and "head_dim=16" in repr(rope)


def test_head_groups_equal_separate_calls():
    q = torch.randn(1, 30, 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 30, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 30, 2, 16, dtype=torch.float64, requires_grad=True)
    alibi = posenc.ALiBi(2, trainable=True)
    kerple = posenc.RelativeBias("kerple", 2)
    out = posenc.attention(q, k, v, [(2, alibi), (2, kerple)], causal=True)
    first = posenc.attention(q[:, :, :2], k[:, :, :1], v[:, :, :1], alibi, causal=True)
    second = posenc.attention(q[:, :, 2:], k[:, :, 1:], v[:, :, 1:], kerple, causal=True)
    torch.testing.assert_close(out, torch.cat([first, second], dim=2), rtol=0, atol=0)
    (d_slopes,) = torch.autograd.grad(out.sum(), [alibi.slopes])
    (d_first,) = torch.autograd.grad(first.sum(), [alibi.slopes])
    torch.testing.assert_close(d_slopes, d_first, rtol=0, atol=0)
    # RoPE on a group that covers whole KV groups.
    rope = posenc.attention(q, k, v, [(2, "rope"), (2, "none")], causal=True)
    torch.testing.assert_close(rope[:, :, :2], posenc.attention(q[:, :, :2], k[:, :, :1], v[:, :, :1], "rope",
                                                                causal=True), rtol=0, atol=0)


def test_errors_name_the_argument():
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="learned parameters"):
        posenc.attention(q, k, v, "t5")
    with pytest.raises(ValueError, match="bogus"):
        posenc.attention(q, k, v, "bogus")
    with pytest.raises(ValueError, match="relative-bias"):
        posenc.RelativeBias("rope", 4)
    with pytest.raises(ValueError, match="option.*bogus_option"):
        posenc.RelativeBias("alibi", 4, bogus_option=1)
    with pytest.raises(ValueError, match="num_buckets.*2.5.*an integer"):
        posenc.RelativeBias("t5", 4, num_buckets=2.5)
    with pytest.raises(ValueError, match="sum to 3"):
        posenc.attention(q, k, v, [(2, "none"), (1, "none")])
    with pytest.raises(ValueError, match="heads = 0"):
        posenc.attention(q, k, v, [(0, "none"), (4, "none")])
    with pytest.raises(TypeError, match="pairs"):
        posenc.attention(q, k, v, [("none",)])
    with pytest.raises(ValueError, match="whole KV groups"):
        posenc.attention(q, k, v, [(1, "rope"), (3, "none")])
    # The op's typed arguments (torch/classes.hpp), as C++ callers pass them.
    scheme = torch.classes.posenc.Scheme

    def op(schemes, params, scale=None):
        return torch.ops.posenc.attention(q, k, v, schemes, params, [], None, True, -1, -1, None, None, 0.0, scale,
                                          None, None, [], [], True)
    with pytest.raises(ValueError, match="no learned parameters"):  # a 0-d tensor is one value
        op([scheme("none", 4, {}, None)], [torch.tensor(1.0)])
    with pytest.raises(ValueError, match="heads sum to 3"):
        op([scheme("none", 3, {}, None)], [])
    with pytest.raises(ValueError, match="one per head group"):
        op([scheme("none", 2, {}, None), scheme("none", 2, {}, None)], [torch.empty(0)])
    with pytest.raises(ValueError, match=r"params\[0\] shape \[0\]; expected \[2, 4\]"):
        op([scheme("kerple", 4, {}, None)], [torch.empty(0)])
    # ALiBi's slopes are fixed by its definition (parameters_fixed): an empty tensor stands for them.
    alibi = scheme("alibi", 4, {}, None)
    assert torch.equal(op([alibi], [torch.empty(0)])[0], op([alibi], [])[0])
    with pytest.raises(ValueError, match=r"params\[0\] shape \[3\]; expected \[4\]"):
        op([alibi], [torch.ones(3)])
    with pytest.raises(ValueError, match="scale = 0"):
        op([scheme("none", 4, {}, None)], [], scale=0.0)
    with pytest.raises(RuntimeError, match="int"):
        scheme("none", 2.5, {}, None)
    with pytest.raises(ValueError, match="heads = 0"):
        scheme("none", 0, {}, None)
    with pytest.raises(ValueError, match="option = bogus"):
        scheme("alibi", 4, {"bogus": 1.0}, None)
    with pytest.raises(ValueError, match="symmetric = 3"):
        posenc.RelativeBias("alibi", 4, symmetric=3)
    with pytest.raises(ValueError, match="expected the group's 2"):
        posenc.attention(q, k, v, [(2, posenc.RelativeBias("kerple", 3)), (2, "none")])
    with pytest.raises(ValueError, match=r"posenc.Scheme\('fire'"):
        posenc.attention(q, k, v, "fire")
    with pytest.raises(ValueError, match="bogus"):
        posenc.Scheme("bogus", 4, 16)
    with pytest.raises(ValueError, match="head_dim = 0"):
        posenc.Scheme("fire", 4, 0)
    with pytest.raises(TypeError, match="heads is float"):
        posenc.Scheme("fire", 4.0, 16)
    with pytest.raises(ValueError, match="head_dim = 8; expected q's 16"):
        posenc.attention(q, k, v, posenc.Scheme("shaw", 4, 8))
    with pytest.raises(ValueError, match="heads = 2; expected the group's 4"):
        posenc.attention(q, k, v, posenc.Scheme("fire", 2, 16))


def test_a_scheme_with_a_per_token_input_is_the_forgetting_module():
    """posenc.Scheme("forgetting", …, log_fgate=…) is the registry's entry for what posenc.Forgetting
    builds by hand: the same bits, alone and as a head group beside another scheme, and the gate's
    gradient."""
    q = torch.randn(2, 12, 4, 16)
    k, v = torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16)
    gate = torch.nn.functional.logsigmoid(torch.randn(2, 12, 4) + 2).requires_grad_()
    by_name = posenc.attention(q, k, v, posenc.Scheme("forgetting", 4, 16, log_fgate=gate), causal=True)
    by_hand = posenc.attention(q, k, v, posenc.Forgetting(gate), causal=True)
    torch.testing.assert_close(by_name, by_hand, rtol=0, atol=0)
    (d_name,) = torch.autograd.grad(by_name.sum(), [gate])
    (d_hand,) = torch.autograd.grad(by_hand.sum(), [gate])
    torch.testing.assert_close(d_name, d_hand, rtol=0, atol=0)
    half = gate[..., :2].detach()
    groups = posenc.attention(q, k, v, [(2, posenc.Scheme("forgetting", 2, 16, log_fgate=half)), (2, "rope")],
                              causal=True)
    torch.testing.assert_close(groups[:, :, :2], posenc.attention(q[:, :, :2], k[:, :, :1], v[:, :, :1],
                                                                  posenc.Forgetting(half), causal=True), rtol=0, atol=0)
    entry = _scheme_entry("forgetting")
    assert entry["family"] == "token-term" and entry["causal_only"] and entry["inputs"][0]["name"] == "log_fgate"
    # fox, the alias, is the same entry and the same scheme (flex and the op see forgetting).
    assert _scheme_entry("fox") is entry or _scheme_entry("fox")["name"] == "forgetting"
    fox = posenc.Scheme("fox", 2, 16, log_fgate=half)
    assert fox.name == "forgetting"
    torch.testing.assert_close(posenc.attention(q[:, :, :2], k[:, :, :1], v[:, :, :1], fox, causal=True),
                               groups[:, :, :2], rtol=0, atol=0)


def test_per_token_inputs_are_checked_by_name():
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    gate = torch.full((1, 8, 4), -0.1)
    with pytest.raises(ValueError, match=r"reads per-token inputs \(log_fgate\)"):
        posenc.attention(q, k, v, "forgetting")
    with pytest.raises(ValueError, match="log_fgate=<tensor>"):
        posenc.Scheme("forgetting", 4, 16)
    with pytest.raises(TypeError, match="log_fgate is list"):
        posenc.Scheme("forgetting", 4, 16, log_fgate=[0.0])
    with pytest.raises(ValueError, match="causal = False with forgetting"):
        posenc.attention(q, k, v, posenc.Scheme("forgetting", 4, 16, log_fgate=gate))
    with pytest.raises(ValueError, match=r"log_fgate.*\[1, 8, 3\].*heads = 4"):
        posenc.attention(q, k, v, posenc.Scheme("forgetting", 4, 16, log_fgate=gate[..., :3]), causal=True)
    with pytest.raises(ValueError, match=r"log_fgate.*= 0.5; expected <= 0"):
        posenc.attention(q, k, v, posenc.Scheme("forgetting", 4, 16, log_fgate=gate + 0.6), causal=True)
    # The op itself (C++ callers): the group's input comes in `gates`.
    scheme = torch.classes.posenc.Scheme("forgetting", 4, {}, None)
    with pytest.raises(ValueError, match=r"gates\[0\] is absent; expected scheme forgetting's log_fgate"):
        torch.ops.posenc.attention(q, k, v, [scheme], [], [], None, True, -1, -1, None, None, 0.0, None, None, None,
                                   [], [], True)
    with pytest.raises(ValueError, match="2 gates; expected one per head group"):
        torch.ops.posenc.attention(q, k, v, [scheme], [], [gate, gate], None, True, -1, -1, None, None, 0.0, None,
                                   None, None, [], [], True)


def test_causal_only_schemes_run_where_no_query_sees_a_later_key():
    """Without the causal mask a forget gate is defined when no query sees a later key, as the engine
    allows: one query per sequence at the end of its keys (decode), or a window ending at the query.
    Those calls see the same keys as causal ones, so they agree to the bit."""
    torch.manual_seed(3)
    k, v = torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)
    gate = -torch.rand(2, 9, 4)
    for name, make in (("forgetting", lambda g: posenc.Scheme("forgetting", 4, 16, log_fgate=g)),
                       ("Forgetting", posenc.Forgetting)):
        one = torch.randn(2, 1, 4, 16)
        torch.testing.assert_close(posenc.attention(one, k, v, make(gate), causal=False),
                                   posenc.attention(one, k, v, make(gate), causal=True), rtol=0, atol=0)
        q = torch.randn(2, 9, 4, 16)
        torch.testing.assert_close(posenc.attention(q, k, v, make(gate), causal=False, window=(-1, 0)),
                                   posenc.attention(q, k, v, make(gate), causal=True), rtol=0, atol=0)
        with pytest.raises(ValueError, match=f"causal = False with {name} and 9 queries per sequence"):
            posenc.attention(q, k, v, make(gate), causal=False, window=(-1, 2))
    # Packed: the longest sequence counts.
    q, k, v = torch.randn(3, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    gate = -torch.rand(5, 4)
    scheme = posenc.Scheme("forgetting", 4, 16, log_fgate=gate)
    torch.testing.assert_close(posenc.attention(q, k, v, scheme, causal=False, cu_seqlens=([0, 1, 2, 3], [0, 2, 3, 5])),
                               posenc.attention(q, k, v, scheme, causal=True, cu_seqlens=([0, 1, 2, 3], [0, 2, 3, 5])),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="2 queries per sequence"):
        posenc.attention(q, k, v, scheme, causal=False, cu_seqlens=([0, 2, 3], [0, 3, 5]))


def test_per_token_inputs_beside_other_terms_get_their_own_gradients():
    """A registered gate, an added gate over RoPE and over the sinks entry, and the sinks argument
    in one call: each gradient is its own term's (packed sequences too), as separate eager
    compositions give them in float64."""
    q = torch.randn(1, 10, 6, 8, dtype=torch.float64)
    k, v = torch.randn(1, 10, 3, 8, dtype=torch.float64), torch.randn(1, 10, 3, 8, dtype=torch.float64)
    a = torch.nn.functional.logsigmoid(torch.randn(1, 10, 2, dtype=torch.float64) + 2).requires_grad_()
    b = torch.nn.functional.logsigmoid(torch.randn(1, 10, 2, dtype=torch.float64) + 2).requires_grad_()
    c = torch.nn.functional.logsigmoid(torch.randn(1, 10, 2, dtype=torch.float64) + 2).requires_grad_()
    sinks = torch.randn(6, dtype=torch.float64, requires_grad=True)
    sink_module = posenc.Scheme("sinks", 2, 8)

    def call(a, b, c, sinks):
        groups = [(2, posenc.Scheme("forgetting", 2, 8, log_fgate=a)), (2, posenc.Forgetting(b, base="rope")),
                  (2, posenc.Forgetting(c, base=sink_module))]
        return posenc.attention(q, k, v, groups, causal=True, sinks=sinks)

    assert torch.autograd.gradcheck(call, (a, b, c, sinks))
    # Packed: two sequences of 4 and 6 tokens, the gate [Tk, heads] restarting its sum in each.
    qp, kp, vp = q[0, :, :2], k[0, :, :1], v[0, :, :1]
    gate = a[0].detach().requires_grad_()
    cu = torch.tensor([0, 4, 10])
    packed = posenc.attention(qp, kp, vp, posenc.Scheme("forgetting", 2, 8, log_fgate=gate), causal=True,
                              cu_seqlens=cu)
    first = posenc.attention(qp[None, :4], kp[None, :4], vp[None, :4], posenc.Forgetting(gate[None, :4]), causal=True)
    second = posenc.attention(qp[None, 4:], kp[None, 4:], vp[None, 4:], posenc.Forgetting(gate[None, 4:]),
                              causal=True)
    torch.testing.assert_close(packed, torch.cat([first[0], second[0]]), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda g: posenc.attention(qp, kp, vp, posenc.Scheme("forgetting", 2, 8, log_fgate=g), causal=True,
                                   cu_seqlens=cu), (gate,))


def test_schemes_of_per_token_inputs_are_refused_where_nothing_computes_them():
    gate = torch.full((1, 8, 4), -0.1)
    scheme = posenc.Scheme("forgetting", 4, 16, log_fgate=gate)
    with pytest.raises(ValueError, match="base = forgetting, a scheme of per-token inputs"):
        posenc.Forgetting(gate, base=scheme)
    with pytest.raises(ValueError, match="SelfAttention: scheme = 'forgetting' reads per-token inputs"):
        posenc.nn.SelfAttention(64, 4, scheme="forgetting")
    with pytest.raises(ValueError, match="SelfAttention: scheme = forgetting with per-token inputs"):
        posenc.nn.SelfAttention(64, 4, scheme=scheme)
    with pytest.raises(ValueError, match="reads no per-token input log_fgate"):
        posenc.Scheme("rope", 4, 16, log_fgate=gate)
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    out = torch.randn(1, 8, 4, 16)
    lse = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match=r"schemes\[0\] = forgetting, a scheme of per-token inputs"):
        torch.ops.posenc.attention_backward(q, k, v, [torch.classes.posenc.Scheme("forgetting", 4, {}, None)], [],
                                            True, -1, -1, None, None, 0.0, None, None, None, out, lse, out, [], [],
                                            True)
    # The gate is saved: changed in place after the forward, the backward is refused.
    g = torch.full((1, 8, 4), -0.1, requires_grad=True)
    leaf = g * 1.0
    o = posenc.attention(q, k, v, posenc.Scheme("forgetting", 4, 16, log_fgate=leaf), causal=True)
    with torch.no_grad():
        leaf.sub_(0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


@pytest.mark.parametrize("name", ["stickbreaking", "cope"])
def test_normalisers_by_name_in_a_layer_generate_as_they_recompute(name):
    """The registered normalisers (family ``normaliser``) in posenc.nn.SelfAttention, which passes
    the tokens' positions: trainable, and a KVCache's steps give the whole sequence's outputs."""
    torch.manual_seed(3)
    layer = posenc.nn.SelfAttention(64, 4, kv_heads=2, scheme=name)
    x = torch.randn(2, 10, 64)
    layer(x).sum().backward()
    assert all(p.grad is not None for p in layer.parameters())
    with torch.no_grad():
        for p in layer.scheme.parameters() if isinstance(layer.scheme, torch.nn.Module) else ():
            p.normal_()
        whole = layer(x)
        cache = posenc.KVCache(2, 2, 16, capacity=16)
        steps = [layer(x[:, :3], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(3, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=0, atol=1e-6)


def test_stickbreaking_by_name_is_its_function_with_rem_as_lse():
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 9, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    out, lse = posenc.attention(q, k, v, "stickbreaking", causal=True, return_lse=True)
    want, rem = posenc.stickbreaking_attention(q, k, v)
    assert torch.equal(out, want) and torch.equal(lse, rem.transpose(1, 2))
    with pytest.raises(ValueError, match="mask.causal = false; expected a causal mask .stickbreaking replaces"):
        posenc.attention(q, k, v, "stickbreaking")
    with pytest.raises(ValueError, match=r"k_positions = 1 at key 0 of a sequence; expected 0, the tokens' order"):
        posenc.attention(q, k, v, "stickbreaking", causal=True, k_positions=torch.arange(1, 10))
