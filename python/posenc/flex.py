"""posenc's schemes through PyTorch's FlexAttention (``torch.nn.attention.flex_attention``): the
same semantics as ``posenc.attention`` (its masks, positions, head groups, sinks, temperature and
soft-cap), on any device FlexAttention runs on.

``prepare(q, k, v, scheme, …)`` builds a ``FlexCall``: q and k with their transforms applied (any
registered transform, RoPE and Shortformer's sinusoid among them, from posenc's fp64 tables read
through the qk_transform op and moved to the tensors' device; a position temperature folded into
q), a ``score_mod`` and a ``block_mask``; ``attention(…)`` runs it. Each head group is handled by
its scheme's family (``posenc.schemes()``). The terms a score function adds are tabulated in fp64
by posenc through the ``score_bias`` op, which carries their parameters' gradients: a relative
bias (ALiBi, T5, Kerple, Sandwich, …) over the key − query distances the call meets, a position
bias (TUPE, …) over its distinct query × key positions. FIRE's MLP is computed in the score
function instead, from captured tensors (no table), and so is the forget gate's running sum, kept
as two float32 halves so that long sequences lose no precision. Sinks are exact: one more key
with a zero value whose score is the sink's logit. Schemes whose terms read the query and a
per-pair table (Shaw, Transformer-XL), the normalisers that replace the softmax (stick-breaking,
CoPE) and terms given only by their fp64 definition are refused: see ``_REFUSED``."""
import torch
from torch.nn.attention import flex_attention as _flex

from ._checks import _flag, _object, _ops
from ._functional import _qkv_layout
from ._modules import Forgetting
from ._attention import _attention_args
from .registry import Scheme, _score_bias_op, _scheme_entry

__all__ = ["FlexCall", "prepare", "attention"]

# Why a family's schemes have no FlexAttention form here (posenc.schemes()' families).
_REFUSED = {
    "relative-terms": "its terms read the query or the key through a per-pair table (Shaw's q·a^K[clip(j − i)] "
                      "and Σ p·a^V, Transformer-XL's (q + v)·W_R r(i − j)) and may add to the output, which a "
                      "score function of one pair cannot do without materialising [Sq, Sk, D]",
    "normaliser": "its weights replace the softmax (stick-breaking's σ(z)·Π(1 − σ), CoPE's positions counted by "
                  "gates over the scores themselves), and FlexAttention always applies the softmax",
    "term": "a term given by its fp64 definition in C++ (posenc/term.hpp) has no score_mod form",
}
_INSTEAD = "; use backend='fused' (posenc's CPU kernel) for it"
# The relative-bias table is [H, span of key − query] floats: past this many per head the
# positions are too scattered for a table. A position bias's is [H, query positions, key
# positions]: past this many in all the call is too long for one (fp64 on the host first). The
# fused kernel computes such biases per pair instead.
_TABLE_LIMIT = 1 << 24


def _refuse(name, why):
    raise ValueError(f"posenc.flex: scheme {name} is not supported through FlexAttention: {why}{_INSTEAD}")


class FlexCall:
    """One attention call in FlexAttention's terms: ``q``, ``k``, ``v`` ``[B, H, S, D]`` (q and k
    transformed; with sinks, k and v end with one zero key whose score is the sink's logit),
    ``score_mod``, ``block_mask`` (None: every key visible), ``scale`` and ``enable_gqa``.
    ``run(flex)`` calls ``flex`` (``flex_attention`` or a compiled one) and returns ``(out, lse)``
    in posenc's layout (lse None unless asked for)."""

    def __init__(self, q, k, v, score_mod, block_mask, scale, packed, layout, learned):
        self.q, self.k, self.v = q, k, v
        self.learned = learned  # the tensors the score function captures that may carry gradients
        self.score_mod, self.block_mask, self.scale = score_mod, block_mask, scale
        self.enable_gqa = q.shape[1] != k.shape[1]
        self.packed, self.layout = packed, layout
        self.empty_lse = None  # an empty call's lse: the sinks' logits (zero keys, zero outputs), else −inf

    def run(self, flex=None, return_lse=False):
        if 0 in self.q.shape[:3] or self.k.shape[2] == 0:
            # Nothing to attend: zero outputs, as every fully masked row of the fused kernel, and an
            # lse of −inf, or the sinks' logits (FlexAttention is not called with empty tensors).
            b, h, sq = self.q.shape[:3]
            out = self.q.new_zeros(b, h, sq, self.v.shape[-1])
            lse = torch.full((b, h, sq), float("-inf"), device=self.q.device) if self.empty_lse is None else \
                self.empty_lse[None, :, None].expand(b, h, sq).clone()
        else:
            out, lse = self._flex(flex, return_lse)
        if self.packed:
            return out[0].transpose(0, 1), None if lse is None else lse[0]
        return (out if self.layout == "bhsd" else out.transpose(1, 2)), lse

    def _flex(self, flex, return_lse):
        flex = _flex.flex_attention if flex is None else flex
        result = flex(self.q, self.k, self.v, score_mod=self.score_mod, block_mask=self.block_mask, scale=self.scale,
                      enable_gqa=self.enable_gqa, return_aux=_flex.AuxRequest(lse=True) if return_lse else None)
        return (result[0], result[1].lse) if return_lse else (result, None)


def _positions_grid(positions, batch, length, default, device, what):
    """Positions as an int64 [batch, length] tensor on device (``default`` when None)."""
    if positions is None:
        return default
    if isinstance(positions, torch.Tensor) and (positions.is_floating_point() or positions.is_complex() or
                                                positions.dtype == torch.bool):
        raise TypeError(f"posenc.flex: {what} dtype {positions.dtype}; expected an integer tensor")
    p = torch.as_tensor(positions, dtype=torch.long).to(device)
    if p.numel() and (int(p.min()) < 0 or int(p.max()) > 1 << 40):
        raise ValueError(f"posenc.flex: {what} from {int(p.min())} to {int(p.max())}; expected positions in [0, 2^40]")
    if p.dim() == 1 and p.shape[0] == length:
        p = p.expand(batch, length)
    if tuple(p.shape) != (batch, length):
        raise ValueError(f"posenc.flex: {what} shape {tuple(p.shape)}; expected [{length}] or [{batch}, {length}]")
    return p


def _unique_positions(*grids):
    positions = torch.cat([g.reshape(-1) for g in grids])
    return torch.unique(positions)


_PARTNERS = {}


def _partners(scheme, key, head_dim, seq_len):
    """partner[j], the entry a transform mixes entry j with (j itself if none), read from the
    library: the unit vectors transformed at position 1 (where every RoPE frequency turns), less
    the transform of zero (the rows an additive transform adds)."""
    if key not in _PARTNERS:
        eye = torch.eye(head_dim, dtype=torch.float64)
        pos = torch.ones(head_dim, dtype=torch.long)
        out = _ops.qk_transform(scheme, eye, pos, False, seq_len) - \
            _ops.qk_transform(scheme, torch.zeros_like(eye), pos, False, seq_len)
        partner = []
        for j in range(head_dim):
            others = [i for i in torch.nonzero(out[j]).reshape(-1).tolist() if i != j]
            if len(others) > 1:
                raise ValueError(f"posenc.flex: transform {key[0]} mixes entry {j} with entries {others}; expected "
                                 "pairs at most (the form x' = A ⊙ x + B ⊙ x[partner] + C)")
            partner.append(others[0] if others else j)
        if any(partner[partner[j]] != j for j in range(head_dim)):
            raise ValueError(f"posenc.flex: transform {key[0]} pairs its entries one way only ({partner}); expected "
                             "pairs (j mixed with p and p with j)")
        _PARTNERS[key] = torch.tensor(partner)
    return _PARTNERS[key]


def _transform_tables(scheme, head_dim, positions, seq_len, keys, partner):
    """(A, B, C) [P, D] for x' = A ⊙ x + B ⊙ x[partner] + C at each of ``positions`` (int64 [P],
    CPU): a registered transform by its fp64 definition (the qk_transform op), read by applying it
    to zero (C) and to ones in the first and in the second entry of every pair. Queries and keys
    apart (xPos scales them apart; a cache of rotated keys stays as it is)."""
    first = torch.arange(head_dim) <= partner
    p = positions.numel()

    def apply(x):
        return _ops.qk_transform(scheme, x.expand(p, head_dim).contiguous(), positions, keys, seq_len)

    c = apply(torch.zeros(head_dim, dtype=torch.float64))
    o1 = apply(first.to(torch.float64)) - c
    o2 = apply((~first).to(torch.float64)) - c
    a, b = torch.where(first, o1, o2), torch.where(first, o2, o1)
    # The form holds for this transform at these positions: a random row through both.
    x = torch.randn(p, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = _ops.qk_transform(scheme, x, positions, keys, seq_len)
    got = a * x + b * x[:, partner] + c
    if p and not torch.allclose(got, want, rtol=1e-12, atol=1e-12 * (1.0 + float(want.abs().max()))):
        raise ValueError(f"posenc.flex: transform {scheme.name()} is not of the form x' = A ⊙ x + B ⊙ x[partner] + C "
                         "at the call's positions; expected a transform by pairs (use backend='fused')")
    return a, b, c


class _Plan:
    """The pieces of one call, gathered over its head groups."""

    def __init__(self, q, k, heads, device):
        self.q, self.k, self.heads, self.device = q, k, heads, device
        self.rel = []        # (h0, h1, spec, parameters): tabulated together by _relative_table
        self.fire = []       # (h0, h1, hidden, parameter tensor)
        self.pos = []        # (h0, h1, spec, parameters, head_dim): position biases, tabulated by _position_table
        self.forget = []     # (h0, h1, log_fgate [B, Sk, h])
        self.sinks = None    # [H] logits of "sinks" groups, −inf elsewhere
        # No query or no key: the groups are checked, nothing is computed (FlexCall.run's zeros).
        self.empty = q.numel() == 0 or k.shape[1] == 0


def prepare(q, k, v, scheme=None, *, causal=False, window=(-1, -1), chunk_size=None, temperature=None, softcap=0.0,
            scale=None, layout="bshd", q_positions=None, k_positions=None, keys_rotated=False, sinks=None,
            cu_seqlens=None):
    """A ``FlexCall`` for ``posenc.attention``'s arguments (the same meaning, checked the same
    way). Raises ValueError for a scheme this path cannot express (Shaw, Transformer-XL, the
    normalisers), naming why."""
    q, k, v, cu_q, cu_k = _qkv_layout("posenc.flex", q, k, v, layout, cu_seqlens)
    args = _attention_args(q, k, v, scheme, causal, window, chunk_size, temperature, softcap, scale, q_positions,
                           k_positions, keys_rotated, True, sinks, cu_seqlens)
    (_, _, _, specs, params, gates, sinks, causal, window_left, window_right, chunk_size, _, softcap, scale,
     q_positions, k_positions, cu_q, cu_k, _) = args
    for spec in specs:  # the library checks each group's options against the call (RoPE's head size, …)
        _object(spec)
    if temperature is not None:
        temperature._object()
    _check_call(q, k, v, cu_q, cu_k, causal, window_left, window_right, softcap, sinks)
    device = q.device
    heads = q.shape[-2]
    kv_heads = k.shape[-2]
    packed = bool(cu_q)
    if packed:
        q, k, v = q[None], k[None], v[None]
    batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]

    # Per token: its sequence, its index in it, and (queries) the key index its diagonal meets —
    # the masks are by token index, bottom-right aligned per sequence.
    if packed:
        cq, ck = torch.tensor(cu_q, dtype=torch.long), torch.tensor(cu_k, dtype=torch.long)
        lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        q_doc = torch.repeat_interleave(torch.arange(len(lq)), lq)
        k_doc = torch.repeat_interleave(torch.arange(len(lk)), lk)
        q_index = torch.arange(sq) - cq[q_doc]
        k_index = torch.arange(sk) - ck[k_doc]
        q_diag = q_index + (lk - lq)[q_doc]
        q_default = (q_index + (lk - lq).clamp(min=0)[q_doc])[None]
        k_default = k_index[None]
        q_key = ck[q_doc] + q_diag  # the key token a query is (forget gates)
        q_doc, k_doc, q_diag, k_index = (t[None].to(device) for t in (q_doc, k_doc, q_diag, k_index))
    else:
        q_doc = k_doc = None
        q_diag = (torch.arange(sq) + (sk - sq)).expand(batch, sq).to(device)
        k_index = torch.arange(sk).expand(batch, sk).to(device)
        q_default = (torch.arange(sq) + max(0, sk - sq)).expand(batch, sq)
        k_default = torch.arange(sk).expand(batch, sk)
        q_key = torch.arange(sq) + (sk - sq)
    qpos = _positions_grid(q_positions, batch, sq, q_default.to(device), device, "q_positions")
    kpos = _positions_grid(k_positions, batch, sk, k_default.to(device), device, "k_positions")

    if chunk_size is not None and kpos.shape[1] > 1:
        step = kpos[:, 1:] - kpos[:, :-1]
        same = torch.ones_like(step, dtype=torch.bool) if k_doc is None else k_doc[:, 1:] == k_doc[:, :-1]
        if bool(((step < 0) & same).any()):
            raise ValueError("posenc.flex: k_positions decrease within a sequence with chunk_size; expected "
                             "non-decreasing key positions (a query's chunk is a run of keys)")
    # Head groups: transforms of q and k now, terms of the score function later.
    plan = _Plan(q, k, heads, device)
    group_schemes = scheme if isinstance(scheme, (list, tuple)) else [(heads, scheme)]
    h0 = 0
    gate_list = list(gates)
    for g, ((group_heads, group_scheme), spec, group_params) in enumerate(zip(group_schemes, specs, params)):
        h1 = h0 + group_heads
        if isinstance(group_scheme, Forgetting) or _sums_after_key(group_scheme):
            plan.forget.append((h0, h1, gate_list[g]))
        elif isinstance(group_scheme, Scheme) and group_scheme.inputs:
            _refuse(group_scheme.name, "its per-token input has no FlexAttention form here")
        _group(plan, spec, group_params, h0, h1, kv_heads, qpos, kpos)
        h0 = h1
    for h0, h1, gate in plan.forget:
        want = (sk, h1 - h0) if packed else (batch, sk, h1 - h0)
        if tuple(gate.shape) != want:
            raise ValueError(f"posenc.flex: log_fgate shape {tuple(gate.shape)}; expected {list(want)} (the keys' grid "
                             "and the group's heads)")
        if gate.numel() and bool((gate > 0).any()):
            raise ValueError("posenc.flex: log_fgate holds a value > 0; expected <= 0 (the log of a forget gate in "
                             "(0, 1], e.g. logsigmoid of its logit)")
    if plan.forget:
        longer = bool((lq > lk).any()) if packed else batch > 0 and sq > sk
        if longer:
            raise ValueError("posenc.flex: a forget gate with more queries than keys in a sequence; expected at most "
                             "as many queries as keys (query i is the key token Lk − Lq + i)")
    q, k = plan.q, plan.k
    if temperature is not None:
        factor = _temperature_factors(temperature, qpos)
        q = (q.to(torch.float32) * factor[:, :, None, None]).to(q.dtype)

    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if sinks is not None:
        sinks = sinks.to(device, torch.float32)
    if plan.sinks is not None:  # a "sinks" group's logits beside the call's: both in the denominator
        sinks = plan.sinks if sinks is None else torch.logaddexp(plan.sinks, sinks)
    if plan.empty:
        _check_bias_positions(plan, (q_positions, k_positions, qpos, kpos))
        call = FlexCall(q, k[:, :, :0], v[:, :, :0], None, None, scale, packed, layout, [])
        call.empty_lse = sinks
        return call
    if sinks is not None:
        # The sinks as one more key: a zero value, its score the head's logit, seen by every query;
        # the per-key tensors get an entry for it that no term reads.
        k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[3])], dim=2)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)
        kpos, k_index = (torch.cat([t, t[:, -1:]], dim=1) for t in (kpos, k_index))
        k_doc = None if k_doc is None else torch.cat([k_doc, k_doc[:, -1:]], dim=1)
    score_mod = _score_mod(plan, qpos, kpos, q_key, softcap, batch, sk, sinks, cu_k if packed else None)
    block_mask = _block_mask(causal, window_left, window_right, chunk_size, q_doc, k_doc, q_diag, k_index, qpos,
                             kpos, batch, sq, sk, device, packed, sinks is not None)
    learned = [p for _, _, _, p in plan.rel] + [p for _, _, _, p in plan.fire] + [p for _, _, _, p, _ in plan.pos]
    learned += [g for _, _, g in plan.forget]
    learned += [] if sinks is None else [sinks]
    return FlexCall(q, k, v, score_mod, block_mask, scale, packed, layout, learned)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_call(q, k, v, cu_q, cu_k, causal, window_left, window_right, softcap, sinks):
    """What the fused kernel's planner refuses (include/posenc/attention.hpp, "Errors"), refused here
    in its terms, before anything is computed."""
    where = "posenc.flex"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"{where}: {name} dtype {t.dtype}; expected float32, bfloat16, float16 or float64")
        if t.dim() != q.dim():
            raise ValueError(f"{where}: {name} has {t.dim()} dimensions; expected {q.dim()}, as q")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{where}: q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype}; expected one dtype")
    if not q.device == k.device == v.device:
        raise ValueError(f"{where}: q, k, v on {q.device}, {k.device}, {v.device}; expected one device")
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{where}: k shape {tuple(k.shape)} and v shape {tuple(v.shape)}; expected the same tokens "
                         "and heads")
    if k.shape[-1] != q.shape[-1] or v.shape[-1] > q.shape[-1]:
        raise ValueError(f"{where}: head sizes q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}; expected k's "
                         "equal to q's and v's at most q's")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{where}: q has {heads} heads and k {kv_heads}; expected a divisor of {heads}")
    if not cu_q and q.shape[0] != k.shape[0]:
        raise ValueError(f"{where}: q's batch {q.shape[0]} and k's {k.shape[0]}; expected the same")
    if causal and window_right not in (0, -1):
        raise ValueError(f"{where}: window[1] = {window_right} with causal; expected 0 or -1 (causal sees no later "
                         "key)")
    if window_left < -1 or window_right < -1:
        raise ValueError(f"{where}: window = ({window_left}, {window_right}); expected entries >= -1 (-1: unlimited)")
    if not softcap >= 0 or softcap == float("inf"):
        raise ValueError(f"{where}: softcap = {softcap}; expected a finite number >= 0")
    for name, cu, total in (("cu_seqlens_q", cu_q, q.shape[0]), ("cu_seqlens_k", cu_k, k.shape[0])):
        if cu and (cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:]))):
            raise ValueError(f"{where}: {name} = {cu}; expected 0, then non-decreasing sums, ending at the "
                             f"{total} tokens")
    if cu_q and len(cu_q) != len(cu_k):
        raise ValueError(f"{where}: cu_seqlens_q has {len(cu_q) - 1} sequences and cu_seqlens_k {len(cu_k) - 1}; "
                         "expected as many")
    if sinks is not None and not sinks.is_floating_point():
        raise TypeError(f"{where}: sinks dtype {sinks.dtype}; expected a floating dtype")
    if sinks is not None and bool((torch.isnan(sinks) | (sinks == float("inf"))).any()):
        raise ValueError(f"{where}: sinks hold a NaN or +inf logit; expected finite numbers, or -inf for no sink")


def _sums_after_key(scheme):
    """Whether a registered scheme's one per-token input enters the logit as its sum over the tokens
    after the key up to the query (its entry's logit_form; FoX's log forget gates): the plan's
    running sums, as forget gates."""
    if not isinstance(scheme, Scheme) or len(scheme.inputs) != 1:
        return False
    return [i.get("logit_form") for i in scheme.entry.get("inputs", [])] == ["sum_after_key"]


def _group(plan, spec, group_params, h0, h1, kv_heads, qpos, kpos):
    """One head group's transform or term into the plan, by its scheme's family."""
    _, (name, _, options, _), _ = spec
    family = _scheme_entry(name)["family"]
    if family in _REFUSED:
        _refuse(name, _REFUSED[family])
    if family in ("none", "token-term"):  # a per-token input's term: the plan's forget gates
        return
    if family == "transform":
        _transform(plan, spec, h0, h1, kv_heads, qpos, kpos)
    elif family == "relative-bias":
        plan.rel.append((h0, h1, spec, group_params))
    elif family == "bias" and name == "fire":
        # FIRE's MLP evaluated in the score function: no [Sq, Sk] table (a speed-up of the rule below).
        plan.fire.append((h0, h1, int(options.get("hidden", 32)), group_params))
    elif family == "bias":
        plan.pos.append((h0, h1, spec, group_params, plan.q.shape[-1]))
    elif family == "sink":
        # The group's logits; −inf for the other heads: no sink in their denominators.
        logits = group_params.reshape(-1).to(plan.device, torch.float32)
        none = torch.full((plan.heads,), float("-inf"), device=plan.device)
        current = none if plan.sinks is None else plan.sinks
        plan.sinks = torch.cat([current[:h0], logits, current[h1:]])
    else:
        _refuse(name, f"its family ({family}) has no FlexAttention form here")


def _kv_range(plan, h0, h1, kv_heads):
    per = plan.heads // kv_heads
    if h0 % per or h1 % per:
        raise ValueError(f"posenc.flex: a transform's group covers heads {h0}..{h1 - 1}; expected whole KV groups "
                         f"of {per} heads")
    return h0 // per, h1 // per


def _transform(plan, spec, h0, h1, kv_heads, qpos, kpos):
    """q's heads h0..h1 and their KV heads transformed by a registered transform (RoPE,
    Shortformer's sinusoid, …) from its fp64 tables at the call's positions, in float32."""
    kv0, kv1 = _kv_range(plan, h0, h1, kv_heads)
    dim = plan.q.shape[-1]
    scheme = _object(spec)
    # One row through the definition, so that a call with no tokens is refused as the fused kernel
    # refuses it (a sinusoid of an odd width, …).
    _ops.qk_transform(scheme, torch.zeros(1, dim, dtype=torch.float64), torch.zeros(1, dtype=torch.long), False, 1)
    if plan.empty:
        return
    all_positions = _unique_positions(qpos, kpos).cpu()
    seq_len = int(torch.cat([qpos.reshape(-1), kpos.reshape(-1)]).max()) + 1
    partner = _partners(scheme, (spec[1][0], repr(spec[1:]), dim), dim, seq_len)

    def apply(x, pos, keys):
        a, b, c = (t.to(plan.device, torch.float32)
                   for t in _transform_tables(scheme, dim, all_positions, seq_len, keys, partner))
        index = torch.searchsorted(all_positions.to(pos.device), pos.contiguous())
        a, b, c = a[index][:, :, None, :], b[index][:, :, None, :], c[index][:, :, None, :]
        xf = x.to(torch.float32)
        return (a * xf + b * xf[..., partner.to(plan.device)] + c).to(x.dtype)

    q, k = plan.q, plan.k
    plan.q = torch.cat([q[:, :, :h0], apply(q[:, :, h0:h1], qpos, False), q[:, :, h1:]], dim=2)
    plan.k = torch.cat([k[:, :, :kv0], apply(k[:, :, kv0:kv1], kpos, True), k[:, :, kv1:]], dim=2)


def _temperature_factors(temperature, qpos):
    """s(p) of posenc/temperature.hpp for every query position, in fp64 by the library."""
    unique = torch.unique(qpos.cpu())
    t = temperature._object()
    factors = torch.tensor([t.factor(int(p)) for p in unique.tolist()], dtype=torch.float64)
    return factors.to(qpos.device, torch.float32)[torch.searchsorted(unique.to(qpos.device), qpos.contiguous())]


def _relative_table(plan, qpos, kpos):
    """[H, N] float32 on the device: every relative-bias group's b_h(r) for r = r_min + n, by the
    library in fp64 (differentiable in the groups' parameters), zero for the other heads."""
    r_min = int(kpos.min()) - int(qpos.max())
    r_max = int(kpos.max()) - int(qpos.min())
    span = r_max - r_min + 1
    if span > _TABLE_LIMIT:
        raise ValueError(f"posenc.flex: key − query positions span {span} values; expected at most {_TABLE_LIMIT} "
                         "for a relative-bias table (positions this scattered need backend='fused')")
    q0 = max(0, -r_min)
    q_positions = torch.tensor([q0], dtype=torch.long)
    k_positions = torch.arange(q0 + r_min, q0 + r_max + 1, dtype=torch.long)
    rows, h_at = [], 0
    for h0, h1, spec, group_params in sorted(plan.rel, key=lambda g: g[0]):
        if h0 > h_at:
            rows.append(torch.zeros(h0 - h_at, span, dtype=torch.float64))
        p = group_params.to("cpu", torch.float64) if group_params.numel() else group_params
        bias = _score_bias_op(spec[:2] + (None,), p if p.numel() else None, q_positions, k_positions,
                                 torch.float64)
        rows.append(bias.reshape(h1 - h0, span))
        h_at = h1
    if h_at < plan.heads:
        rows.append(torch.zeros(plan.heads - h_at, span, dtype=torch.float64))
    return torch.cat(rows).to(plan.device, torch.float32), r_min


def _check_bias_positions(plan, positions):
    """A call where no query meets a key computes no bias, but the fused kernel checks every position
    it is given (TUPE's table rows): each position bias checks them here, through the op, each
    position against the first."""
    given = [torch.as_tensor(p).reshape(-1).cpu().long() for p in positions if p is not None]
    given = torch.unique(torch.cat(given)) if given else torch.zeros(0, dtype=torch.long)
    if not plan.pos or not given.numel():
        return
    for _, _, spec, group_params, head_dim in plan.pos:
        p = group_params.to("cpu", torch.float64) if group_params.numel() else None
        _score_bias_op(spec[:2] + (None,), p, given, given[:1], torch.float64, head_dim)


def _position_table(plan, qpos, kpos):
    """([H, Uq, Uk] float32 on the device, query index [B, Sq], key index [B, Sk]): every
    position-bias group's b_h(p, p') over the call's distinct query and key positions, by the
    library in fp64 (differentiable in the groups' parameters), zero for the other heads."""
    uq, uk = torch.unique(qpos.cpu()), torch.unique(kpos.cpu())
    if plan.heads * uq.numel() * uk.numel() > _TABLE_LIMIT:
        raise ValueError(f"posenc.flex: {plan.heads} heads × {uq.numel()} query × {uk.numel()} key positions; "
                         f"expected at most {_TABLE_LIMIT} entries for a position-bias table (longer calls need "
                         "backend='fused')")
    rows, h_at = [], 0
    for h0, h1, spec, group_params, head_dim in sorted(plan.pos, key=lambda g: g[0]):
        if h0 > h_at:
            rows.append(torch.zeros(h0 - h_at, uq.numel(), uk.numel(), dtype=torch.float64))
        p = group_params.to("cpu", torch.float64) if group_params.numel() else group_params
        rows.append(_score_bias_op(spec[:2] + (None,), p if p.numel() else None, uq, uk, torch.float64,
                                   head_dim).reshape(h1 - h0, uq.numel(), uk.numel()))
        h_at = h1
    if h_at < plan.heads:
        rows.append(torch.zeros(plan.heads - h_at, uq.numel(), uk.numel(), dtype=torch.float64))
    qi = torch.searchsorted(uq.to(qpos.device), qpos.contiguous())
    ki = torch.searchsorted(uk.to(kpos.device), kpos.contiguous())
    return torch.cat(rows).to(plan.device, torch.float32), qi, ki


def _split(x):
    """x (float64) as hi + lo float32 halves: differences of the two stay accurate where x is large."""
    hi = x.to(torch.float32)
    return hi, (x - hi.to(torch.float64)).to(torch.float32)


def _score_mod(plan, qpos, kpos, q_key, softcap, batch, sk, sinks, k_starts):
    """The score function of the plan's terms (None when there are none), then the soft-cap."""
    table = r_min = None
    if plan.rel:
        table, r_min = _relative_table(plan, qpos, kpos)
    position = _position_table(plan, qpos, kpos) if plan.pos else None
    fire = []
    for h0, h1, hidden, p in plan.fire:
        n = h1 - h0
        p = p.to(plan.device, torch.float32)
        # Separate tensors: inductor's CPU FlexAttention fails on views of one buffer.
        w1, b1 = p[:hidden].clone(), p[hidden:2 * hidden].clone()
        w2 = p[2 * hidden:2 * hidden + n * hidden].reshape(n, hidden).clone()
        b2 = p[2 * hidden + n * hidden:2 * hidden + n * hidden + n].clone()
        c, threshold = p[-2:-1].clone(), p[-1:].clone()
        fire.append((h0, h1, hidden, w1, b1, w2, b2, c, threshold))
    forget = None
    if plan.forget:
        # c[b, h, j] = Σ_{l<=j} log f_l (fp64), zero for heads without a gate; the term for query
        # token i and key j is c_i − c_j = Σ_{l=j+1..i} log f_l.
        parts, h_at = [], 0
        for h0, h1, gate in sorted(plan.forget, key=lambda g: g[0]):
            gate = gate if gate.dim() == 3 else gate[None]
            if h0 > h_at:
                parts.append(torch.zeros(batch, sk, h0 - h_at, dtype=torch.float64, device=plan.device))
            parts.append(gate.to(plan.device, torch.float64))
            h_at = h1
        if h_at < plan.heads:
            parts.append(torch.zeros(batch, sk, plan.heads - h_at, dtype=torch.float64, device=plan.device))
        gates = torch.cat(parts, dim=2)
        if k_starts is None:
            running = torch.cumsum(gates, dim=1)
        else:  # each packed sequence's sum starts afresh (a −inf gate stays in its sequence)
            running = torch.cat([torch.cumsum(gates[:, a:b], dim=1) for a, b in zip(k_starts, k_starts[1:])], dim=1)
        running = running.transpose(1, 2)  # [B, H, Sk]
        if sinks is not None:
            running = torch.cat([running, running[..., -1:]], dim=2)  # read at the sink's key, unused
        hi, lo = _split(running)
        q_key = q_key.to(plan.device).reshape(1, -1).expand(batch, -1)
        forget = (hi, lo, q_key.clamp(min=0, max=sk - 1))
    if table is None and position is None and not fire and forget is None and not softcap and sinks is None:
        return None
    # A tensor: a captured Python float would become a symbol FlexAttention's tracer refuses.
    cap = torch.tensor(float(softcap), device=plan.device) if softcap else None

    def score_mod(score, b, h, q_idx, kv_idx):
        x = score
        if table is not None:
            x = x + table[h, kpos[b, kv_idx] - qpos[b, q_idx] - r_min]
        if position is not None:
            ptable, qi, ki = position
            x = x + ptable[h, qi[b, q_idx], ki[b, kv_idx]]
        for h0, h1, hidden, w1, b1, w2, b2, c, threshold in fire:
            pq = qpos[b, q_idx].to(torch.float32)
            d = torch.abs(kpos[b, kv_idx] - qpos[b, q_idx]).to(torch.float32)  # exact in int64 first
            ratio = torch.log1p(c[0] * d) / torch.log1p(c[0] * torch.maximum(threshold[0], pq))
            g = torch.clamp(h - h0, 0, h1 - h0 - 1)
            value = b2[g]
            for m in range(hidden):
                value = value + w2[g, m] * torch.relu(w1[m] * ratio + b1[m])
            x = x + torch.where((h >= h0) & (h < h1), value, torch.zeros_like(value))
        if forget is not None:
            hi, lo, qk = forget
            i = qk[b, q_idx]
            x = x + ((hi[b, h, i] - hi[b, h, kv_idx]) + (lo[b, h, i] - lo[b, h, kv_idx]))
        if cap is not None:
            x = cap * torch.tanh(x / cap)
        if sinks is not None:
            x = torch.where(kv_idx == sk, sinks[h], x)
        return x

    return score_mod


def _block_mask(causal, window_left, window_right, chunk_size, q_doc, k_doc, q_diag, k_index, qpos, kpos, batch,
                sq, sk, device, packed, sink):
    if causal:
        window_right = 0
    if not packed and window_left < 0 and window_right < 0 and chunk_size is None and not causal:
        return None  # every key visible

    def mask_mod(b, h, q_idx, kv_idx):
        d, j = q_diag[b, q_idx], k_index[b, kv_idx]
        ok = torch.ones_like(d, dtype=torch.bool) if q_doc is None else q_doc[b, q_idx] == k_doc[b, kv_idx]
        if window_left >= 0:
            ok = ok & (j >= d - window_left)
        if window_right >= 0:
            ok = ok & (j <= d + window_right)
        if chunk_size is not None:
            ok = ok & (torch.div(kpos[b, kv_idx], chunk_size, rounding_mode="floor") ==
                       torch.div(qpos[b, q_idx], chunk_size, rounding_mode="floor"))
        return (ok | (kv_idx == sk)) if sink else ok

    return _create(mask_mod, batch, sq, sk + sink, device)


def _create(mask_mod, batch, sq, sk, device):
    # Off the CPU the mask is built by a compiled kernel block by block; eagerly it is a dense
    # [B, 1, Sq, Sk] boolean first (torch's advice for long sequences).
    return _flex.create_block_mask(mask_mod, batch, None, sq, sk, device=device, _compile=device.type != "cpu")


_COMPILED = {}


def _compiled(device):
    """flex_attention compiled for a device type. Off the CPU with torch's automatic dynamic shapes:
    a second length recompiles once with symbolic sizes, not once per length (decode would end at
    the recompile limit). On the CPU with static shapes: inductor's CPU template fails to compile
    symbolic sizes in torch 2.15 (CppCompileError, cur_kvSplitSize undeclared)."""
    kind = device.type
    if kind not in _COMPILED:
        _COMPILED[kind] = torch.compile(_flex.flex_attention, dynamic=False if kind == "cpu" else None)
    return _COMPILED[kind]


def attention(q, k, v, scheme=None, *, compiled=True, return_lse=False, layout="bshd", **options):
    """``posenc.attention`` through FlexAttention (``prepare`` then ``FlexCall.run``), compiled by
    default (uncompiled FlexAttention is a dense O(Sq·Sk) path, for tests). Same arguments and
    results; ``skip_vanishing_tiles`` is accepted (it changes no result)."""
    _flag("posenc.flex", "skip_vanishing_tiles", options.pop("skip_vanishing_tiles", True))
    call = prepare(q, k, v, scheme, layout=layout, **options)
    return_lse = _flag("posenc.flex", "return_lse", return_lse)
    compiled = _flag("posenc.flex", "compiled", compiled)
    if call.q.device.type == "cpu" and torch.is_grad_enabled():
        # torch's FlexAttention has no CPU backward for q, k, v, and its compiled CPU kernel none at all.
        inputs = [t for t in (call.q, call.k, call.v) if t.requires_grad]
        captured = [t for t in call.learned if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs or (compiled and captured):
            what = "q, k or v" if inputs else "a scheme parameter (or gate, or sink)"
            raise ValueError(f"posenc.flex: {what} requires grad on the CPU, where torch {torch.__version__}'s "
                             f"{'compiled ' if not inputs else ''}FlexAttention has no backward; use backend='fused' "
                             "(the default on the CPU) to train there, or run under torch.no_grad()")
    if compiled and return_lse and call.q.device.type == "cpu":
        raise ValueError(f"posenc.flex: return_lse = True with compiled=True on the CPU, where torch "
                         f"{torch.__version__}'s compiled FlexAttention gives no lse; expected compiled=False for it")
    out, lse = call.run(_compiled(call.q.device) if compiled else None, return_lse)
    return (out, lse) if return_lse else out
