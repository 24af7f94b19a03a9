"""posenc's functional ops: tables, RoPE (one axis and several), the relative biases, learned
and FLOATER positions, Shaw's and Transformer-XL's terms, the quantized caches' rows, and the
attentions with their own normalisers (stick-breaking, CoPE)."""
import math
import numbers

import torch

from ._checks import _concrete, _cu_seqlens, _finite, _flag, _int, _number, _object, _ops, _positions
from .registry import _scheme_spec, _score_bias_op


def empty_cache():
    """Return the memory posenc keeps for reuse to the system: freed large outputs (up to 1 GiB;
    outputs of 1 MiB or more reuse blocks of the same size), the blocks of attention calls'
    position tables (up to 256 MiB) and RoPE's rows over positions from 0 (up to 128 MiB). A loop
    that asks for the same shapes every step, or a decode loop one key longer each step, then pays
    no first-touch page faults and does not tabulate RoPE again."""
    _ops.empty_cache()


def bf16_dot_products():
    """Whether attention over bfloat16 q, k and v runs its products (prefill and backward) on this
    CPU's bf16 dot-product units (AVX512-BF16 with the avx512 target): queries, rotated keys,
    probabilities and dS are then rounded to bf16 before their products, f32 sums
    (docs/attention.md, "Native bf16 products", bounds the error). Elsewhere every product is f32."""
    return bool(_ops.bf16_dot_products())


def huge_page_zeros(*shape, dtype=torch.float32):
    """A zero-filled contiguous CPU tensor on 2 MiB pages (posenc::HugePageBuffer; Linux's
    transparent huge pages, where the system grants them), like ``torch.zeros(*shape, dtype=dtype)``.
    Meant for KV caches [B, S, G, D]: decode reads one head's row of each key, and at G·D·4 = 4 KiB
    per key every such row lies on its own ordinary page; docs/attention.md measures decode from
    both kinds of memory. The memory goes back to the system when the tensor is freed."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    return _ops.huge_page_zeros([int(s) for s in shape], dtype)


def sinusoidal_table(positions, dim, base=10000.0, interleaved=True, dtype=torch.float32):
    """The sinusoidal encoding (Vaswani et al. 2017) of ``positions`` (an int, meaning 0..n-1, or
    an int64 tensor [S]): ``[S, dim]``, pairs (sin, cos) interleaved or split in halves. Angles are
    formed and reduced in fp64, so the values stay exact at long positions."""
    if isinstance(positions, int):
        positions = torch.arange(positions, dtype=torch.long)
    return _ops.sinusoidal_table(_positions(positions, 0), dim, float(base), bool(interleaved), dtype)


_DIRECTIONS = {"forward": 0, "backward": 1, "inverse": 2}


def _rope_params(head_dim, rotary_dim, base, layout, scaling, max_position_embeddings, freq_factors=None, xpos=None,
                 rotary_offset=0):
    """RoPE's parameters as the ops take them: a ``torch.classes.posenc.Rope`` (posenc/torch/classes.hpp),
    whose typed fields the library validates. ``scaling`` holds Hugging Face's ``rope_scaling``
    keys: ``rope_type`` (or the legacy ``type``), numbers, flags and the lists of factors."""
    return _object(("Rope", _rope_args(head_dim, rotary_dim, base, layout, scaling, max_position_embeddings,
                                       freq_factors, xpos, rotary_offset), None))


def _rope_spec(*args):
    """``_rope_params``' Rope as a spec (``_object`` makes it): plain values that torch.compile keeps
    as constants of its graph."""
    return "Rope", _rope_args(*args), None


@torch.compiler.allow_in_graph
def _rope_op(name, q, k, positions, spec, *rest):
    """The op ``name`` (rope, rope_ or rope_multi) with the Rope made here from its spec: torch.compile
    puts this call into its graph as it is, and its autograd then traces the op's _pickled form."""
    return getattr(_ops, name)(q, k, positions, _object(spec), *rest)


def _rope_args(head_dim, rotary_dim, base, layout, scaling, max_position_embeddings, freq_factors=None, xpos=None,
               rotary_offset=0):
    """The arguments of ``torch.classes.posenc.Rope`` (see ``_rope_params``), checked."""
    head_dim = _int("rope", "head_dim", head_dim)
    rotary_dim = head_dim if rotary_dim is None else _int("rope", "rotary_dim", rotary_dim)
    rotary_offset = 0 if rotary_offset is None else rotary_offset
    if isinstance(rotary_offset, bool) or not isinstance(rotary_offset, int):
        raise TypeError(f"rope: rotary_offset is {type(rotary_offset).__name__}; expected an int")
    params = {"head_dim": head_dim, "rotary_dim": rotary_dim, "base": _number("rope", "base", base),
              "max_position_embeddings": _int("rope", "max_position_embeddings", max_position_embeddings)}
    xpos_values = []
    if xpos is not None:
        if not isinstance(xpos, numbers.Real) and not (isinstance(xpos, (list, tuple)) and len(xpos) == 2):
            raise ValueError(f"rope: xpos = {xpos!r}; expected None, a scale_base or (scale_base, center)")
        scale_base, center = (xpos, 0.0) if isinstance(xpos, numbers.Real) else tuple(xpos)
        xpos_values = [_number("rope", "xpos scale_base", scale_base), _number("rope", "xpos center", center)]
        params["xpos"] = {"scale_base": xpos_values[0], "center": xpos_values[1]}
    rope_type, values, factors = "default", {}, {}
    for key, value in (scaling or {}).items():
        if key in ("type", "rope_type"):
            if key == "rope_type" or "rope_type" not in scaling:
                rope_type = value
        elif key in ("mrope_section", "mrope_interleaved"):
            continue  # Qwen-VL's M-RoPE layout: rope_multi's sections, not the frequencies
        elif key == "rope_theta":
            # transformers' rope_parameters carry the base too: it must be the one given.
            if _number("rope", "scaling['rope_theta']", value) != params["base"]:
                raise ValueError(f"rope: scaling['rope_theta'] = {value} but base = {params['base']}; expected "
                                 "them equal (pass the config's rope_theta as base)")
        elif isinstance(value, (list, tuple)):
            factors[key] = [_number("rope", f"scaling[{key!r}][{i}]", x) for i, x in enumerate(value)]
        else:
            values[key] = float(value) if isinstance(value, bool) else _number("rope", f"scaling[{key!r}]", value)
    if not isinstance(rope_type, str):
        raise TypeError(f"rope: scaling['rope_type'] is {type(rope_type).__name__}; expected a str")
    if freq_factors is not None:
        factors["freq_factors"] = [_number("rope", f"freq_factors[{i}]", x) for i, x in enumerate(freq_factors)]
    _finite("rope parameters", {**params, **values, **factors})
    if not isinstance(layout, str):
        raise TypeError(f"rope: layout is {type(layout).__name__}; expected 'half-split' or 'interleaved'")
    return (head_dim, rotary_dim, params["base"], layout, params["max_position_embeddings"], rotary_offset, rope_type,
            values, factors, xpos_values)


def rope(q, k=None, positions=None, *, head_dim=None, rotary_dim=None, base=10000.0, layout="half-split",
         scaling=None, max_position_embeddings=2048, freq_factors=None, xpos=None, seq_len=0, direction="forward",
         rotary_offset=0):
    """Rotary embedding of q [B, S, H, D] (or [T, H, D]) and optionally k (same tokens, its own head
    count), out of place. ``positions``: int64 [S] or [B, S] (default 0..S-1). ``scaling``: a dict
    with Hugging Face's ``rope_scaling`` keys (rope_type, factor, …). ``xpos``: None, a scale_base
    (e.g. 512), or (scale_base, center) — xPos decay (q scaled by ζ^e, k by ζ^-e). ``seq_len``: the
    length that selects dynamic / longrope frequencies (0: max position + 1). ``direction``:
    forward, backward (the gradient) or inverse. ``rotary_offset``: the first rotated entry (MLA
    rotates the trailing 64 of 192: ``rotary_dim=64, rotary_offset=128``). Returns (q_out, k_out),
    k_out None without k. Differentiable in q and k."""
    head_dim = q.shape[-1] if head_dim is None else head_dim
    seq = q.shape[-3]
    spec = _rope_spec(head_dim, rotary_dim, base, layout, scaling, max_position_embeddings, freq_factors, xpos,
                      rotary_offset)
    if direction not in _DIRECTIONS:
        raise ValueError(f"rope: direction = {direction}; expected forward, backward or inverse")
    k_in = k if k is not None else q.new_empty(0)
    q_out, k_out = _rope_op("rope", q, k_in, _positions(positions, seq), spec, _int("rope", "seq_len", seq_len, 0),
                            _DIRECTIONS[direction])
    return q_out, (k_out if k is not None else None)


def rope_(q, k=None, positions=None, *, head_dim=None, rotary_dim=None, base=10000.0, layout="half-split",
          scaling=None, max_position_embeddings=2048, freq_factors=None, xpos=None, seq_len=0, direction="forward"):
    """``rope`` in place: q (and k) are rotated where they lie (no new memory) and returned. Works
    under autograd for tensors that may be modified in place (not leaves requiring grad)."""
    head_dim = q.shape[-1] if head_dim is None else head_dim
    spec = _rope_spec(head_dim, rotary_dim, base, layout, scaling, max_position_embeddings, freq_factors, xpos)
    if direction not in _DIRECTIONS:
        raise ValueError(f"rope_: direction = {direction}; expected forward, backward or inverse")
    k_in = k if k is not None else q.new_empty(0)
    q, k_out = _rope_op("rope_", q, k_in, _positions(positions, q.shape[-3]), spec,
                        _int("rope_", "seq_len", seq_len, 0), _DIRECTIONS[direction])
    return q, (k_out if k is not None else None)


def rope_multi(q, k, positions, sections=None, *, interleave_axes=False, axis_of_pair=None,
               restart_frequencies=False, head_dim=None, rotary_dim=None, base=10000.0, layout="half-split",
               scaling=None, max_position_embeddings=2048, seq_len=0, direction="forward"):
    """Multi-axis RoPE: each rotary pair turns by the positions of one axis. ``sections`` (pairs per
    axis) assigns them in consecutive blocks — M-RoPE (Qwen2-VL: [16, 24, 24] for time, height,
    width) or, with ``restart_frequencies=True``, 2-D axial RoPE for images — or, with
    ``interleave_axes=True``, interleaved (Qwen3-VL's M-RoPE: pair i follows height when
    i % 3 == 1 and i < 3·sections[1], width when i % 3 == 2 and i < 3·sections[2], else time).
    ``axis_of_pair``: any other map instead of sections, one axis per pair.
    ``positions``: int64 [axes, S] or [axes, B, S]. Returns (q_out, k_out); differentiable."""
    head_dim = q.shape[-1] if head_dim is None else head_dim
    spec = _rope_spec(head_dim, rotary_dim, base, layout, scaling, max_position_embeddings)
    if direction not in _DIRECTIONS:
        raise ValueError(f"rope_multi: direction = {direction}; expected forward, backward or inverse")
    if (sections is None) == (axis_of_pair is None):
        raise ValueError("rope_multi: sections and axis_of_pair both given or both None; expected exactly one")
    if axis_of_pair is not None and interleave_axes:
        raise ValueError("rope_multi: interleave_axes = True with axis_of_pair; expected it only with sections")
    k_in = k if k is not None else q.new_empty(0)
    positions = torch.as_tensor(positions, dtype=torch.long)
    q_out, k_out = _rope_op("rope_multi", q, k_in, positions, spec, _int("rope_multi", "seq_len", seq_len, 0),
                                   [] if sections is None else [int(x) for x in sections], bool(interleave_axes),
                                   [] if axis_of_pair is None else [int(x) for x in axis_of_pair],
                                   bool(restart_frequencies), _DIRECTIONS[direction])
    return q_out, (k_out if k is not None else None)


def alibi_slopes(heads, max_bias=8.0):
    """The ALiBi slopes of Press et al. for any head count (posenc::alibi_slopes): a float64 tensor."""
    if isinstance(heads, bool) or not isinstance(heads, int):
        raise TypeError(f"alibi_slopes: heads is {type(heads).__name__}; expected an int")
    if heads < 1 or heads > 2**31:
        raise ValueError(f"alibi_slopes: heads = {heads}; expected 1 to 2^31")
    if isinstance(max_bias, bool) or not isinstance(max_bias, (int, float)):
        raise TypeError(f"alibi_slopes: max_bias is {type(max_bias).__name__}; expected a number")
    if not (math.isfinite(max_bias) and max_bias > 0):
        raise ValueError(f"alibi_slopes: max_bias = {max_bias}; expected a finite number > 0")
    n = 1 << (heads.bit_length() - 1)
    exponents = [(h + 1) / n if h < n else (2 * (h - n) + 1) / (2 * n) for h in range(heads)]
    return torch.tensor([2.0 ** (-max_bias * e) for e in exponents], dtype=torch.float64)


def _score_bias(name, params, heads, options, q_positions, k_positions, head_dim=1, dtype=None):
    """A registered score-bias scheme (the relative-bias and bias families) over positions (the
    generic op), in ``dtype`` (default: params') and differentiable in params: the functions below
    give its parameters in the registry's shape, and its head count."""
    spec = _scheme_spec(name, _concrete(heads), options)
    return _score_bias_op(spec, params, _positions(q_positions, 0), _positions(k_positions, 0),
                          params.dtype if dtype is None else dtype, head_dim)


def _bias_params(where, shapes, **tensors):
    """Checks tensors against shapes (a name per dimension, whose extent every tensor naming it
    shares; (): one value) and returns the extents the names took."""
    extents = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: {key} is {type(value).__name__}; expected a torch.Tensor")
        if not value.is_floating_point():
            raise TypeError(f"{where}: {key} dtype {value.dtype}; expected a floating dtype")
    devices = {str(value.device) for value in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"{where}: " + ", ".join(f"{k} on {v.device}" for k, v in tensors.items()) +
                         "; expected one device")
    for key, value in tensors.items():
        want = shapes[key]
        if want == ():
            if value.numel() != 1:
                raise ValueError(f"{where}: {key} shape {list(value.shape)}; expected one value (a 0-d tensor)")
            continue
        fits = value.dim() == len(want)
        for letter, extent in zip(want, value.shape if fits else ()):
            extent = _concrete(extent)
            fits = fits and extents.setdefault(letter, extent) == extent
        if not fits:
            def shown(w):
                return "[" + ", ".join(w) + "]"
            given = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items() if shapes[k] != ())
            expected = ", ".join(f"{k} {shown(shapes[k])}" for k in tensors if shapes[k] != ())
            raise ValueError(f"{where}: {given}; expected {expected}")
    return extents


def alibi_bias(slopes, q_positions, k_positions, symmetric=False):
    """ALiBi biases [B, H, Sq, Sk]: -m_h·(i - j) (or -m_h·|i - j| when symmetric), differentiable in
    the slopes [H]."""
    _bias_params("alibi_bias", {"slopes": ("heads",)}, slopes=slopes)
    return _score_bias("alibi", slopes, slopes.shape[0], {"symmetric": bool(symmetric)}, q_positions,
                       k_positions)


def t5_bias(table, q_positions, k_positions, num_buckets=32, max_distance=128, bidirectional=True):
    """T5 relative biases [B, H, Sq, Sk] from a table [num_buckets, H], with transformers' bucket
    function; differentiable in the table."""
    options = {"num_buckets": _int("t5_bias", "num_buckets", num_buckets), "bidirectional": bool(bidirectional),
               "max_distance": _int("t5_bias", "max_distance", max_distance)}
    _bias_params("t5_bias", {"table": ("num_buckets", "heads")}, table=table)
    return _score_bias("t5", table, table.shape[1], options, q_positions, k_positions)


def kerple_bias(r1, r2, q_positions, k_positions, power=False):
    """Kerple biases [B, H, Sq, Sk]: -r1·log(1 + r2·|i - j|), or -r1·|i - j|^r2 with power=True
    (0 < r2 <= 2); r1, r2: [H], differentiable."""
    _bias_params("kerple_bias", {"r1": ("heads",), "r2": ("heads",)}, r1=r1, r2=r2)
    # The registry's parameters: [r1 | r2], [2, H], in r1's dtype.
    return _score_bias("kerple", torch.stack([r1, r2.to(r1.dtype)]), r1.shape[0],
                       {"power": bool(power)}, q_positions, k_positions)


def fire_bias(w1, b1, w2, b2, c, threshold, q_positions, k_positions):
    """FIRE biases [B, H, Sq, Sk] = MLP(log(1 + c|i - j|) / log(1 + c·max(L, i))): w1, b1 [hidden],
    w2 [H, hidden], b2 [H], c and threshold L 0-d tensors; all differentiable. In w2's dtype."""
    n = _bias_params("fire_bias", {"w1": ("hidden",), "b1": ("hidden",), "w2": ("heads", "hidden"), "b2": ("heads",),
                                   "c": (), "threshold": ()},
                     w1=w1, b1=b1, w2=w2, b2=b2, c=c, threshold=threshold)
    # The registry's parameters: [w1 | b1 | w2 | b2 | c | L], flat in float64 (each tensor as
    # precise as it is given; the library computes in fp64).
    params = torch.cat([t.reshape(-1).to(torch.float64) for t in (w1, b1, w2, b2, c, threshold)])
    return _score_bias("fire", params, n["heads"], {"hidden": n["hidden"]}, q_positions, k_positions,
                       dtype=w2.dtype)


def tupe_bias(table, u_q, u_k, theta1, theta2, q_positions, k_positions, heads, cls_reset=False):
    """TUPE biases [B, H, Sq, Sk] = (p_i U^Q)·(p_j U^K)/sqrt(2D): table [max_len, d_model], u_q and
    u_k [d_model, H·D], theta1, theta2 [H] (the [CLS] reset); all differentiable. In table's dtype."""
    heads = _int("tupe_bias", "heads", heads, 1)
    n = _bias_params("tupe_bias", {"table": ("max_len", "d_model"), "u_q": ("d_model", "heads·head_dim"),
                                   "u_k": ("d_model", "heads·head_dim"), "theta1": ("heads",), "theta2": ("heads",)},
                     table=table, u_q=u_q, u_k=u_k, theta1=theta1, theta2=theta2)
    if n["heads"] != heads or n["heads·head_dim"] % heads or n["heads·head_dim"] == 0:
        raise ValueError(f"tupe_bias: heads = {heads}, theta1 shape {list(theta1.shape)}, u_q shape "
                         f"{list(u_q.shape)}; expected theta1 [heads] and u_q [d_model, heads·head_dim]")
    # The registry's parameters: [table | U^Q | U^K | θ1 | θ2], flat in float64 (as FIRE's).
    params = torch.cat([t.reshape(-1).to(torch.float64) for t in (table, u_q, u_k, theta1, theta2)])
    options = {"d_model": n["d_model"], "max_len": n["max_len"], "cls_reset": bool(cls_reset)}
    return _score_bias("tupe", params, heads, options, q_positions, k_positions,
                       n["heads·head_dim"] // heads, dtype=table.dtype)


def learned(table, x, positions=None):
    """x + table[positions] (x: [B, S, D] or [S, D]; table [max_len, D]); differentiable in both."""
    return _ops.learned(table, x, _positions(positions, x.shape[-2]))


def floater_table(w1, b1, w2, b2, p0, length, time_per_position=0.1, substeps=1):
    """FLOATER's encodings of positions 0..length-1 [length, dim]: the RK4 trajectory of
    dp/dt = W2·tanh(W1·[t; p] + B1) + B2 from p0; differentiable in every parameter."""
    return _ops.floater_table(w1, b1, w2, b2, p0, int(length), float(time_per_position), int(substeps))


def shaw_scores(q, key_table, q_positions, k_positions, max_distance):
    """Shaw et al.'s score term [B, H, Sq, Sk]: q·a^K[clip(j - i, -k, k) + k] / sqrt(D), with q
    [B, S, H, D] and key_table [2k + 1, D]; differentiable in both."""
    return _ops.shaw_scores(q, key_table, _positions(q_positions, 0), _positions(k_positions, 0), int(max_distance))


def shaw_values(probs, value_table, q_positions, k_positions, max_distance):
    """Shaw et al.'s value term [B, Sq, H, D]: Σ_j p_ij·a^V[clip(j - i, -k, k) + k]; probs
    [B, H, Sq, Sk]; differentiable in both."""
    return _ops.shaw_values(probs, value_table, _positions(q_positions, 0), _positions(k_positions, 0), int(max_distance))


def xl_scores(q, k, u, v, w_r, q_positions, k_positions, scale=0.0, base=10000.0):
    """Transformer-XL's position terms [B, H, Sq, Sk]: scale·(u·k_j + (q_i + v)·W_R r(i - j)); q, k
    [B, S, H, D], u, v [H, D], w_r [H·D, d_model]; scale 0 means 1/sqrt(D). Differentiable in all."""
    return _ops.xl_scores(q, k, u, v, w_r, _positions(q_positions, 0), _positions(k_positions, 0), float(scale),
                          float(base))


def _qkv_layout(where, q, k, v, layout, cu_seqlens):
    """q, k, v as [B, S, H, D] (or packed [T, H, D]) views, and the op's (cu_q, cu_k) lists."""
    if layout == "bhsd":
        if cu_seqlens is not None:
            raise ValueError(f"{where}: layout = 'bhsd' with cu_seqlens; expected packed [T, H, D] tensors")
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    elif layout != "bshd":
        raise ValueError(f"{where}: layout = {layout!r}; expected 'bshd' or 'bhsd'")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} is {type(t).__name__}; expected a torch.Tensor")
    cu_q, cu_k = _cu_seqlens(cu_seqlens, where)
    if q.dim() != (3 if cu_q else 4):
        raise ValueError(f"{where}: q has {q.dim()} dimensions; expected " +
                         ("3 ([Tq, H, D] with cu_seqlens)" if cu_q else "4 ([B, Sq, H, D] or with layout='bhsd')"))
    return q, k, v, cu_q, cu_k


@torch.compiler.allow_in_graph
def _attention_op(q, k, v, schemes, params, gates, sinks, causal, window_left, window_right, chunk_size, temperature,
                  *rest):
    """The attention op on ``_attention_args``' values, its typed arguments made here from their
    specs. torch.compile puts this call into its graph as it is, with the specs as constants; its
    autograd then traces it, and the objects reach the op's traced path as constants of the graph
    (the fake kernels: python/posenc/_fake.py)."""
    return _ops.attention(q, k, v, [_object(s) for s in schemes], params, gates, sinks, causal, window_left,
                          window_right, chunk_size, None if temperature is None else _object(temperature), *rest)


def stickbreaking_attention(q, k, v, *, scale=None, attend_current=False, cu_seqlens=None, layout="bshd",
                            skip_vanishing_tiles=True):
    """Stick-breaking attention (Tan et al., ICLR 2025): no softmax and no positional encoding.
    Query i breaks a stick of length 1 from its nearest key leftwards, key j taking σ(z_ij) of
    what the nearer keys left: A_ij = σ(z_ij)·Π_{j<m<i}(1 − σ(z_im)), z = scale·q·k (scale None:
    1/sqrt(D)), out_i = Σ_j A_ij·v_j over keys before the query's own token (``attend_current``:
    from it). Returns ``(out, rem)`` with rem_i = 1 − Σ_j A_ij, the stick left over, ``[B, Sq, H]``
    float32 (``[B, H, Sq]`` with ``layout="bhsd"``, ``[Tq, H]`` packed); the authors' models add
    ``rem[..., None] * b`` with a learned per-head vector b. Query i of Sq is key token Sk − Sq + i
    (decode: Sq = 1). q ``[B, Sq, H, D]``, k ``[B, Sk, G, D]`` (G divides H), v ``[B, Sk, G, Dv]``;
    float32, bfloat16, float16 or float64 (the fp64 reference). Differentiable in q, k and v
    through out and rem. ``cu_seqlens``: packed sequences as ``attention`` takes them.
    ``skip_vanishing_tiles``: a block of rows stops once every row's stick is used up below
    FLT_MIN, which changes no bit (non-finite inputs further left still run and spread)."""
    q, k, v, cu_q, cu_k = _qkv_layout("stickbreaking_attention", q, k, v, layout, cu_seqlens)
    if scale is not None and not _number("stickbreaking_attention", "scale", scale) > 0:
        raise ValueError(f"stickbreaking_attention: scale = {scale}; expected a number > 0, or None for 1/sqrt(D)")
    # The registered scheme "stickbreaking" on the attention op: rem is its lse, [B, H, Sq] ([H, Tq]).
    scheme = _scheme_spec("stickbreaking", q.shape[-2],
                          {"attend_current": _flag("stickbreaking_attention", "attend_current", attend_current)})
    out, rem = _attention_op(q, k, v, [scheme], [], [], None, True, -1, -1, None, None, 0.0,
                             None if scale is None else float(scale), None, None, cu_q, cu_k,
                             _flag("stickbreaking_attention", "skip_vanishing_tiles", skip_vanishing_tiles))
    if layout == "bhsd":
        return out.transpose(1, 2), rem
    return out, rem.transpose(-1, -2)


def cope_attention(q, k, v, table, *, scale=None, cu_seqlens=None, layout="bshd", return_lse=False):
    """CoPE, contextual position encoding (Golovneva et al. 2024): causal softmax attention whose
    positions are counted by gates from the content. For query i and key j <= i: z = scale·q_i·k_j
    (scale None: 1/sqrt(D)), gate σ(z), position p_ij = min(Σ_{m=j..i} σ(z_im), npos − 1), and the
    logit z + ⟨q_i, e[p]⟩ interpolated between the rows ⌊p⌋ and ⌈p⌉ of ``table`` e ``[npos, D]``
    (1 <= npos <= 65536, shared by the heads). Query i of Sq is key token Sk − Sq + i (decode:
    Sq = 1). q ``[B, Sq, H, D]``, k ``[B, Sk, G, D]`` (G divides H), v ``[B, Sk, G, Dv]``; float32,
    bfloat16, float16 or float64 (the fp64 reference); the table in q's dtype or float32.
    Differentiable in q, k, v and the table. ``cu_seqlens``: packed sequences as ``attention``
    takes them, each counting its own positions. Returns out like q (and the log-sum-exp
    ``[B, Sq, H]`` float32, ``[B, H, Sq]`` with ``layout="bhsd"``, with ``return_lse=True``; it
    carries no gradient)."""
    q, k, v, cu_q, cu_k = _qkv_layout("cope_attention", q, k, v, layout, cu_seqlens)
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"cope_attention: table is {type(table).__name__}; expected a torch.Tensor")
    if scale is not None and not _number("cope_attention", "scale", scale) > 0:
        raise ValueError(f"cope_attention: scale = {scale}; expected a number > 0, or None for 1/sqrt(D)")
    if table.dim() != 2:
        raise ValueError(f"cope_attention: table shape {tuple(table.shape)}; expected [npos, D]")
    _flag("cope_attention", "return_lse", return_lse)
    # The registered scheme "cope" on the attention op: its lse is [B, H, Sq] ([H, Tq] packed).
    scheme = _scheme_spec("cope", q.shape[-2], {"positions": int(table.shape[0])})
    out, lse = _attention_op(q, k, v, [scheme], [table], [], None, True, -1, -1, None, None, 0.0,
                             None if scale is None else float(scale), None, None, cu_q, cu_k, True)
    if layout == "bhsd":
        out = out.transpose(1, 2)
    else:
        lse = lse.transpose(-1, -2)
    return (out, lse) if return_lse else out


_KV_FORMATS = ("q8_0", "q4_0", "fp8_e4m3")


def quantize_kv(x, format):
    """Rows ``x [..., D]`` (any float dtype, taken as float32) quantized into uint8 ``[..., row bytes]``
    of a KV cache format: ``"q8_0"`` and ``"q4_0"`` (ggml's blocks of 32 values with an f16 scale, 34
    and 18 bytes; D a multiple of 32) or ``"fp8_e4m3"`` (an f32 scale per row, then a byte per value).
    The reference quantiser of posenc/quantized.hpp."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_kv: x is {type(x).__name__}; expected a torch.Tensor")
    if format not in _KV_FORMATS:
        raise ValueError(f"quantize_kv: format = {format!r}; expected one of {', '.join(_KV_FORMATS)}")
    return _ops.quantize_kv(x, format)


def dequantize_kv(rows, format):
    """uint8 rows of ``quantize_kv`` back to float32 ``[..., D]``: the values attention reads from them."""
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"dequantize_kv: rows is {type(rows).__name__}; expected a torch.Tensor")
    if format not in _KV_FORMATS:
        raise ValueError(f"dequantize_kv: format = {format!r}; expected one of {', '.join(_KV_FORMATS)}")
    return _ops.dequantize_kv(rows, format)
