"""posenc.attention and posenc.forgetting_attention on packed sequences (cu_seqlens): equal to one
call per sequence, forward and every gradient (q, k, v, the scheme's parameters, forget gates,
sinks), for RoPE, ALiBi, T5, Forgetting, head groups, no scheme, GQA, causal and bidirectional,
and queries shorter than their keys (cu_seqlens = (cu_q, cu_k)); bad cu_seqlens refused by name.

Tolerance: the same kernel over the same rows, tiled differently (a packed call's tiles may
start inside a sequence): fp32 sums of O(1) terms in another order, 2e-5 absolute."""
import pytest
import torch
import torch.nn.functional as F

import posenc

LENGTHS = [7, 30, 1, 64]
CU = [0, 7, 37, 38, 102]


def make(name):
    torch.manual_seed(3)
    if name == "rope":
        return posenc.RotaryPositionalEncoding(16)
    if name == "alibi":
        return posenc.ALiBi(4, trainable=True)
    if name == "t5":
        t5 = posenc.T5RelativeBias(4, num_buckets=8, max_distance=32)
        torch.nn.init.normal_(t5.table, std=0.3)
        return t5
    if name == "groups":
        return [(2, posenc.RotaryPositionalEncoding(16)), (2, posenc.ALiBi(2, trainable=True))]
    return None


def parameters(scheme):
    modules = [s for _, s in scheme] if isinstance(scheme, list) else [scheme]
    return [p for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters()]


def tensors(tq, tk, with_sinks):
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(tq, 4, 16, generator=gen)
    k, v = torch.randn(tk, 2, 16, generator=gen), torch.randn(tk, 2, 16, generator=gen)
    w = torch.randn(tq, 4, 16, generator=gen)
    gate = torch.randn(tk, 4, generator=gen)
    sinks = torch.randn(4, generator=gen) if with_sinks else None
    return [x.requires_grad_() if x is not None else None for x in (q, k, v, gate, sinks)] + [w]


@pytest.mark.parametrize("name, causal, with_sinks, decode", [
    ("rope", True, False, False), ("alibi", True, True, False), ("t5", False, False, False),
    ("groups", True, False, False), (None, False, True, False), ("forgetting", True, False, False),
    ("rope", True, False, True), ("forgetting", True, True, True)])
def test_packed_equals_one_call_per_sequence(name, causal, with_sinks, decode):
    cu_q = [0, 1, 3, 4, 7] if decode else CU  # decode: a few queries at the end of each sequence's keys
    results = []
    for packed in (True, False):
        q, k, v, gate, sinks, w = tensors(cu_q[-1], CU[-1], with_sinks)
        scheme = make(name)
        log_gate = F.logsigmoid(gate)

        def scheme_of(a, b):
            return posenc.Forgetting(log_gate[a:b] if packed else log_gate[None, a:b]) if name == "forgetting" \
                else scheme

        if packed:
            out = posenc.attention(q, k, v, scheme_of(0, CU[-1]), causal=causal, sinks=sinks,
                                   cu_seqlens=(torch.tensor(cu_q), CU) if decode else torch.tensor(CU))
        else:
            out = torch.cat([posenc.attention(q[None, cu_q[i]:cu_q[i + 1]], k[None, CU[i]:CU[i + 1]],
                                              v[None, CU[i]:CU[i + 1]], scheme_of(CU[i], CU[i + 1]), causal=causal,
                                              sinks=sinks)[0] for i in range(len(LENGTHS))])
        (out * w).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad, gate.grad if name == "forgetting" else None,
                        None if sinks is None else sinks.grad] + [p.grad for p in parameters(scheme)])
    for i, (got, want) in enumerate(zip(*results)):
        if want is None:
            assert got is None
            continue
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"result {i}")


def test_forgetting_attention_takes_cu_seqlens():
    q, k, v, gate, _, _ = tensors(CU[-1], CU[-1], False)
    log_gate = F.logsigmoid(gate)
    packed = posenc.forgetting_attention(q, k, v, log_gate, cu_seqlens=CU)
    first = posenc.forgetting_attention(q[None, :7], k[None, :7], v[None, :7], log_gate[None, :7])[0]
    torch.testing.assert_close(packed[:7], first, atol=2e-5, rtol=0)
    _, lse = posenc.attention(q, k, v, "rope", causal=True, cu_seqlens=CU, return_lse=True)
    assert lse.shape == (4, CU[-1])


@pytest.mark.parametrize("cu, error, message", [
    ([1, 7, 102], ValueError, "cu_seqlens"),
    ([0, 7, 101], ValueError, "cu_seqlens"),
    ([0, 40, 7, 102], ValueError, "cu_seqlens"),
    (torch.tensor([0.0, 102.0]), TypeError, "cu_seqlens is a torch.float32 tensor"),
    ("0,102", TypeError, "cu_seqlens is str"),
    (([0, 102],), TypeError, "a tuple of 1 sequences"),
    (([0, 102], [0, 102], [0, 102]), TypeError, "a tuple of 3 sequences"),
    (([0, 102], torch.tensor([0.0, 102.0])), TypeError, "cu_seqlens_k is a torch.float32 tensor"),
    (torch.tensor([], dtype=torch.long), ValueError, r"len\(cu_seqlens\) = 0; expected at least 2"),
    ([], ValueError, r"len\(cu_seqlens\) = 0"),
    ((), ValueError, r"len\(cu_seqlens\) = 0"),
    ([102], ValueError, r"len\(cu_seqlens\) = 1"),
])
def test_bad_cu_seqlens_are_refused(cu, error, message):
    q, k, v = torch.randn(102, 4, 16), torch.randn(102, 2, 16), torch.randn(102, 2, 16)
    with pytest.raises(error, match=message):
        posenc.attention(q, k, v, "rope", causal=True, cu_seqlens=cu)


def test_an_empty_cu_seqlens_is_not_unset():
    # Explicit and empty is refused whatever q's rank: an unpacked [B, S, H, D] call with
    # cu_seqlens=[] does not run unpacked, and a packed one is not blamed on q's rank.
    for q in (torch.randn(102, 4, 16), torch.randn(1, 102, 4, 16)):
        with pytest.raises(ValueError, match=r"len\(cu_seqlens\) = 0"):
            posenc.attention(q, q, q, cu_seqlens=torch.tensor([], dtype=torch.long))
        with pytest.raises(ValueError, match=r"len\(cu_seqlens\) = 0"):
            posenc.stickbreaking_attention(q, q, q, cu_seqlens=[])


def test_a_tuple_of_ints_is_one_sequence():
    q, k, v = torch.randn(102, 4, 16), torch.randn(102, 2, 16), torch.randn(102, 2, 16)
    as_list = posenc.attention(q, k, v, "rope", causal=True, cu_seqlens=CU)
    as_tuple = posenc.attention(q, k, v, "rope", causal=True, cu_seqlens=tuple(CU))
    as_pair = posenc.attention(q, k, v, "rope", causal=True, cu_seqlens=(CU, tuple(CU)))
    as_scalars = posenc.attention(q, k, v, "rope", causal=True, cu_seqlens=tuple(torch.tensor(CU)))  # 0-dim ints
    assert torch.equal(as_list, as_tuple) and torch.equal(as_list, as_pair) and torch.equal(as_list, as_scalars)
    # Two ints are one sequence [0, T] too, not a pair.
    whole = posenc.attention(q, k, v, "rope", causal=True, cu_seqlens=(0, 102))
    assert torch.equal(whole, posenc.attention(q[None], k[None], v[None], "rope", causal=True)[0])


def test_packed_shapes_are_checked():
    q = torch.randn(1, 102, 4, 16)
    with pytest.raises(ValueError, match=r"q has 4 dimensions; expected 3 \(\[Tq, H, D\] with cu_seqlens\)"):
        posenc.attention(q, q, q, cu_seqlens=CU)
    with pytest.raises(ValueError, match="layout = 'bhsd' with cu_seqlens"):
        posenc.attention(q, q, q, layout="bhsd", cu_seqlens=CU)
