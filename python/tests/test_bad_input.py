"""Bad input found by probing (issue 26): each is refused with a ValueError or TypeError that names
the argument — never a JSON parser's message, a hang, or a silent fallback."""
import math

import pytest
import torch

import posenc
from posenc._functional import _rope_params


@pytest.mark.parametrize("call, match", [
    (lambda: posenc.alibi_slopes(2**62), r"heads = 4611686018427387904; expected 1 to 2\^31"),
    (lambda: posenc.alibi_slopes(4, float("nan")), r"max_bias = nan; expected a finite number > 0"),
    (lambda: posenc.alibi_slopes(4, -8.0), r"max_bias = -8.0"),
    (lambda: posenc.rope(torch.randn(1, 4, 2, 8), base=float("nan")), r"\['base'\] = nan; expected a finite number"),
    (lambda: posenc.rope(torch.randn(1, 4, 2, 8), scaling={"rope_type": "linear", "factor": math.inf}),
     r"\['factor'\] = inf"),
    (lambda: posenc.Sandwich(2, base=float("nan")), r"\['base'\] = nan"),
    (lambda: posenc.PositionTemperature(attn_scale=float("nan")), r"PositionTemperature\['attn_scale'\] = nan"),
    # A misspelt scaling key is refused by name (the typed Rope knows every key it reads).
    (lambda: posenc.rope(torch.randn(1, 4, 2, 8), scaling={"rope_type": "linear", "factr": 2.0}),
     r"scaling = factr; expected factor, "),
    (lambda: posenc.rope(torch.randn(1, 4, 2, 8), scaling={"rope_type": "yarn", "factor": 2.0, "truncate": 0.5}),
     r"scaling.truncate = 0.5; expected 0 or 1"),
    (lambda: posenc.rope(torch.randn(1, 4, 2, 8), xpos=(512.0, 0.0, 1.0)), r"xpos = \(512.0, 0.0, 1.0\); expected"),
    (lambda: posenc.RotaryPositionalEncoding(8, layout="halfsplit")(torch.randn(1, 4, 2, 8)),
     r"layout = halfsplit; expected half-split or interleaved"),
])
def test_bad_values_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_alibi_slopes_types():
    with pytest.raises(TypeError, match="heads is bool"):
        posenc.alibi_slopes(True)
    with pytest.raises(TypeError, match="heads is float"):
        posenc.alibi_slopes(4.0)


def test_non_finite_values_reach_only_the_rows_that_see_them():
    # docs/attention.md, "Non-finite inputs": a NaN value at key 2 of a causal call reaches rows
    # 2 and 3, not rows 0 and 1 (which share its tile); a NaN query gives its row NaN, not 0.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    v[0, 2, 0, 3] = float("nan")
    out = posenc.attention(q, k, v, causal=True)
    assert torch.isnan(out[0, :, 0]).any(-1).tolist() == [False, False, True, True]
    q[0, 1, 1, 0] = float("nan")
    out = posenc.attention(q, k, v.nan_to_num(), causal=True)
    assert torch.isnan(out[0, :, 1]).any(-1).tolist() == [False, True, False, False]


def test_shaw_distance_that_would_overflow_the_table():
    # 2k + 1 rows of a k = 2^62 overflow int64: refused by name, not a crash or zeros.
    q, p = torch.randn(1, 4, 2, 8), torch.arange(4)
    with pytest.raises(ValueError, match="max_distance = 4611686018427387904"):
        posenc.shaw_scores(q, torch.randn(5, 8), p, p, 2**62)
    with pytest.raises(ValueError, match="max_distance = 4611686018427387904"):
        posenc.shaw_values(torch.rand(1, 2, 4, 4), torch.randn(5, 8), p, p, 2**62)


def _qkv():
    return torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)


@pytest.mark.parametrize("call, error, match", [
    # No silent truncation, no bool as 1, no string or None reaching float().
    (lambda q, k, v: posenc.rope(q, k, rotary_dim=8.7), TypeError, "rope: rotary_dim is float; expected an int"),
    (lambda q, k, v: posenc.rope(q, k, rotary_dim=True), TypeError, "rope: rotary_dim is bool"),
    (lambda q, k, v: posenc.rope(q, k, base="x"), TypeError, "rope: base is str; expected a number"),
    (lambda q, k, v: posenc.rope(q, k, base=None), TypeError, "rope: base is NoneType"),
    (lambda q, k, v: posenc.rope(q, k, seq_len=2**70), ValueError, r"seq_len = 1180591620717411303424; expected an int"),
    # An explicit 0 is not "unset": None asks for 1/sqrt(D).
    (lambda q, k, v: posenc.attention(q, k, v, scale=0.0), ValueError, r"scale = 0.0; expected a number > 0, or None"),
    (lambda q, k, v: posenc.attention(q, k, v, causal="yes"), TypeError, "causal is str; expected True or False"),
    (lambda q, k, v: posenc.attention(q, k, v, window=2.5), TypeError, r"window = 2.5; expected a pair"),
    (lambda q, k, v: posenc.attention(q, k, v, window=(1.5, 0)), TypeError, r"window\[0\] is float"),
    (lambda q, k, v: posenc.attention(q, k, v, softcap="3"), TypeError, "softcap is str"),
    (lambda q, k, v: posenc.PositionTemperature(attn_scale=-0.1), ValueError, r"attn_scale = -0.1; expected a finite number >= 0"),
])
def test_types_and_explicit_values_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call(*_qkv())


def test_typed_boundary_keeps_values_and_refuses_by_name():
    import copy
    import pickle
    # A temperature is a plain value: it copies and pickles (the op's object is built per call).
    t = posenc.PositionTemperature(kind="mistral", beta=0.1, original_max_position_embeddings=16)
    for other in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        torch.testing.assert_close(other.factor(torch.arange(40)), t.factor(torch.arange(40)), rtol=0, atol=0)
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"seq_len = -1; expected an int >= 0"):
        posenc.rope(q, seq_len=-1)
    with pytest.raises(ValueError, match=r"seq_len = -3; expected >= 0"):
        torch.ops.posenc.rope(q, q.new_empty(0), torch.arange(4), _rope_params(8, 8, 1e4, "half-split", None, 64),
                              -3, 0)
    # transformers' rope_parameters carry rope_theta: equal to base it is accepted, else refused.
    same, _ = posenc.rope(q, base=5e5, scaling={"rope_type": "default", "rope_theta": 5e5})
    torch.testing.assert_close(same, posenc.rope(q, base=5e5)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"rope_theta'\] = 500000.0 but base = 10000.0"):
        posenc.rope(q, scaling={"rope_type": "default", "rope_theta": 5e5})


def test_positions_changed_after_forward_do_not_change_the_backward():
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    positions = torch.arange(6)

    def grads(change):
        pos = positions.clone()
        out = posenc.attention(q, k, v, "alibi", causal=True, q_positions=pos, k_positions=pos)
        if change:
            pos.mul_(7)
        return torch.autograd.grad(out.sum(), [q, k, v])
    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
