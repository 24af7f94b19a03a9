"""posenc.attention: the fused op's arguments from the schemes, modules and options a caller
gives (and forgetting attention, its FoX form)."""
import torch

from ._checks import _EMPTY, _cu_seqlens, _flag, _int, _number, _object, _ops, _positions, _unset
from ._functional import _KV_FORMATS, _attention_op
from ._modules import Forgetting, PositionTemperature
from .registry import _ATTENTION_MODULES, Scheme, _scheme_entry, _scheme_spec


def forgetting_attention(q, k, v, log_fgate, *, cu_seqlens=None, scale=None, layout="bshd", return_lse=False):
    """Causal Forgetting Attention (``Forgetting``): ``attention(q, k, v, Forgetting(log_fgate),
    causal=True)``. Query i of Sq is key token Sk − Sq + i and reads that token's gate. Packed
    sequences (``cu_seqlens``, as ``attention`` takes them): q [Tq, H, D], log_fgate [Tk, H]; each
    sequence's running sum starts afresh."""
    return attention(q, k, v, Forgetting(log_fgate), causal=True, scale=scale, layout=layout, return_lse=return_lse,
                     cu_seqlens=cu_seqlens)


def _attention_scheme(scheme, heads, keys_rotated, head_dim):
    """(Scheme, parameter tensor) of one head group: None, a registered name (posenc.schemes(): its
    options' defaults), or a module, which says itself what it is to the op
    (``_attention_scheme(heads, keys_rotated, head_dim)``). The tensor is in the registry's
    parameter_shape, empty for a scheme without learned parameters."""
    if scheme is None:
        return _scheme_spec("none", heads), _EMPTY
    if isinstance(scheme, str):
        # A name means the scheme's defaults; a learned one needs a module (it owns the tensors),
        # and so does one that reads per-token inputs.
        entry = _scheme_entry(scheme)
        if entry.get("inputs"):
            names = ", ".join(i["name"] for i in entry["inputs"])
            raise ValueError(f"attention: scheme = {scheme!r} reads per-token inputs ({names}); pass "
                             f"posenc.Scheme({scheme!r}, heads, head_dim, {entry['inputs'][0]['name']}=...) instead of "
                             "its name")
        if entry["parameters"] and not entry["parameters_fixed"]:
            raise ValueError(f"attention: scheme = {scheme!r} has learned parameters ({entry['parameters']}); "
                             f"pass posenc.Scheme({scheme!r}, heads, head_dim) or its module instead of its name")
        # The call's keys_rotated (k: a cache of rotated keys) reaches a scheme that rotates keys.
        options = {"keys_rotated": True} if keys_rotated and any(
            o["name"] == "keys_rotated" for o in entry["options"]) else {}
        # Fixed parameters (ALiBi's slopes) travel as an empty tensor too: the op makes the definition's.
        return _scheme_spec(entry["name"], heads, options), _EMPTY
    if isinstance(scheme, torch.nn.Module) and hasattr(scheme, "_attention_scheme"):
        return scheme._attention_scheme(heads, keys_rotated, head_dim)
    modules = ", ".join(sorted({make.cls.__name__ for make in _ATTENTION_MODULES.values()}))
    raise TypeError(f"attention: scheme = {scheme!r}; expected None, a registered name (posenc.schemes()), a "
                    f"list of (heads, scheme) pairs, a posenc.Scheme (any registered scheme), or a scheme's module "
                    f"({modules}, …)")


def attention(q, k, v, scheme=None, *, causal=False, window=(-1, -1), chunk_size=None, temperature=None, softcap=0.0,
              scale=None, layout="bshd", q_positions=None, k_positions=None, keys_rotated=False, return_lse=False,
              skip_vanishing_tiles=True, sinks=None, cu_seqlens=None, backend=None, kv_format=None):
    """Fused attention softmax(scale·q·kᵀ + positional terms + mask)·v, flash-style: no [S, S]
    matrix is ever stored, and the positional scheme runs inside the kernel.

    q ``[B, Sq, H, D]``, k and v ``[B, Sk, G, D]`` (G divides H: GQA/MQA), or ``[B, H, S, D]`` with
    ``layout="bhsd"`` (a view, no copy); float32, bfloat16 or float16 (math in float32), or float64
    (the fp64 reference). ``scheme``: None, a registered name (``posenc.schemes()``: ``"rope"``,
    ``"alibi"`` with the paper's slopes, … with their defaults), a list of
    ``(heads, scheme)`` pairs covering the query heads in order (e.g. ``[(4, posenc.ALiBi(4)),
    (4, "rope")]``; a group that transforms q and k covers whole KV groups), or a module — ``RotaryPositionalEncoding`` (RoPE from the positions; with
    ``keys_rotated=True`` k is a cache of already rotated keys), ``SinusoidalPositionalEncoding``
    (Shortformer's position-infused attention: the sinusoid added to q and k, not v), ``ALiBi``,
    ``T5RelativeBias``, ``Kerple``, ``FIRE``, ``ShawRelativePositions`` (Shaw et al.'s key and
    value terms, scale·q·a^K and Σ p·a^V), ``TransformerXLRelative`` (scale·(u·k + (q + v)·W_R r(i − j)),
    its module's scale is the attention's), ``TUPE`` (the projections' head_dim must be q's),
    ``Scheme`` (any registered scheme by name, with its learned parameters and its per-token
    inputs: ``Scheme("forgetting", H, D, log_fgate=...)``), ``RelativeBias`` (any
    registered relative-bias scheme), ``Forgetting`` (a forget gate per token
    and head; causal, or where no query sees a later key), ``CoPE`` (its table; as
    ``Scheme("cope", H, D, positions=n)``) — whose learned parameters (and the
    gate) receive gradients. ``"stickbreaking"`` and CoPE replace the softmax (the family
    ``normaliser``): causal, alone on every head, without window, chunks, temperature, soft-cap,
    positions (but the tokens' order) or sinks; stick-breaking's lse is the stick left over, rem
    ``[B, H, Sq]``, differentiable (the softmax's and CoPE's lse are not). ``causal`` aligns the mask
    bottom-right when Sq < Sk; ``window=(left, right)`` limits the keys a query sees (-1:
    unlimited); ``chunk_size`` C (Llama 4's ``attention_chunk_size``) lets a query see only keys in
    its chunk of positions, ⌊k_pos / C⌋ = ⌊q_pos / C⌋ (key positions must not decrease within a
    sequence); ``temperature``: a ``PositionTemperature`` that multiplies each query by a factor
    of its position (Llama 4's NoPE layers, Mistral), inside the kernel; ``softcap`` c > 0 caps logits to c·tanh(x/c). Positions default to 0..Sk-1 for
    keys and Sk-Sq.. for queries. Returns out like q (and the log-sum-exp ``[B, H, Sq]`` with
    ``return_lse=True``). Differentiable in q, k, v, the scheme's parameters and its per-token inputs.
    ``skip_vanishing_tiles`` (ALiBi-like steep biases): key tiles whose every probability would
    flush to 0 are skipped, which changes no bit for finite inputs; False runs every tile (a
    non-finite value in such a tile then reaches the output as NaN). ``sinks``: a ``[H]`` tensor of
    attention-sink logits (gpt-oss): each joins its head's softmax denominator with no value,
    differentiable. ``cu_seqlens``: packed sequences — q ``[Tq, H, D]``, k and v ``[Tk, G, D]``
    hold sequences one after another, the cumulative lengths ``[0, l1, l1 + l2, …, T]`` (an int64
    tensor, a list or a tuple of ints; a pair ``(cu_q, cu_k)`` of two such sequences when queries
    and keys differ; given, it holds at least ``[0, T]``); each sequence attends
    within itself, its positions restart at 0, and the lse is ``[H, Tq]``. ``backend``: None
    (posenc's fused kernel for CPU tensors, FlexAttention for others), ``"fused"`` or ``"flex"``
    (``posenc.flex.attention``, compiled: the same semantics through PyTorch's FlexAttention, on
    any device; on the CPU it serves inference only). ``kv_format``: ``"q8_0"``, ``"q4_0"`` or
    ``"fp8_e4m3"`` when k and v are a quantized cache, uint8 ``[B, Sk, G, row bytes]`` rows of
    ``posenc.quantize_kv`` (ggml's block layouts for the first two): dequantised inside the kernel, as
    attention over ``posenc.dequantize_kv`` of them; forward only (under ``torch.no_grad()``)."""
    if kv_format is not None:
        if not isinstance(kv_format, str) or kv_format not in _KV_FORMATS:
            raise ValueError(f"attention: kv_format = {kv_format!r}; expected None or one of {', '.join(_KV_FORMATS)}")
        for name, value, unset in (("backend", backend, ("fused", None)), ("layout", layout, ("bshd",)),
                                   ("cu_seqlens", cu_seqlens, (None,))):
            if not any(value is u or (isinstance(u, str) and value == u) for u in unset):
                raise ValueError(f"attention: {name} = {value!r} with kv_format; expected {unset[0]!r} (a quantized "
                                 "cache runs in the fused kernel, [B, S, G, row bytes])")
        _flag("attention", "return_lse", return_lse)
        out, lse = _attention_op(*_attention_args(q, k, v, scheme, causal, window, chunk_size, temperature, softcap,
                                                  scale, q_positions, k_positions, keys_rotated, skip_vanishing_tiles,
                                                  sinks), kv_format)
        return (out, lse) if return_lse else out
    if backend is None:
        # meta tensors (shape propagation) stay with the fused op's fake kernel.
        backend = "fused" if not isinstance(q, torch.Tensor) or q.device.type in ("cpu", "meta") else "flex"
    if backend == "flex":
        from . import flex
        return flex.attention(q, k, v, scheme, causal=causal, window=window, chunk_size=chunk_size,
                              temperature=temperature, softcap=softcap, scale=scale, layout=layout,
                              q_positions=q_positions, k_positions=k_positions, keys_rotated=keys_rotated,
                              return_lse=return_lse, sinks=sinks, cu_seqlens=cu_seqlens,
                              skip_vanishing_tiles=skip_vanishing_tiles)
    if backend != "fused":
        raise ValueError(f"attention: backend = {backend!r}; expected None, 'fused' or 'flex'")
    if layout == "bhsd":
        if cu_seqlens is not None:
            raise ValueError("attention: layout = 'bhsd' with cu_seqlens; expected packed [T, H, D] tensors")
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    elif layout != "bshd":
        raise ValueError(f"attention: layout = {layout!r}; expected 'bshd' or 'bhsd'")
    _flag("attention", "return_lse", return_lse)
    out, lse = _attention_op(*_attention_args(q, k, v, scheme, causal, window, chunk_size, temperature, softcap, scale,
                                              q_positions, k_positions, keys_rotated, skip_vanishing_tiles, sinks,
                                              cu_seqlens))
    if layout == "bhsd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _attention_args(q, k, v, scheme, causal, window, chunk_size, temperature, softcap, scale, q_positions,
                    k_positions, keys_rotated, skip_vanishing_tiles, sinks, cu_seqlens=None):
    """The arguments of the attention op for ``attention``'s (q, k, v in [B, S, H, D], or [T, H, D]
    packed), checked: (q, k, v, schemes, params, gates, sinks, causal, window_left, window_right,
    chunk_size, temperature, softcap, scale, q_positions, k_positions, cu_q, cu_k,
    skip_vanishing_tiles), the schemes (as specs: ``_object`` makes them) and params one per head
    group, the temperature a spec too."""
    cu_q, cu_k = _cu_seqlens(cu_seqlens)
    if q.dim() != (3 if cu_q else 4):
        raise ValueError(f"attention: q has {q.dim()} dimensions; expected " +
                         ("3 ([Tq, H, D] with cu_seqlens)" if cu_q else "4 ([B, Sq, H, D] or with layout='bhsd')"))
    _flag("attention", "keys_rotated", keys_rotated)
    gates = []  # per head group: its forget gate or its scheme's per-token input, or an empty tensor
    # A causal-only scheme (a decay over the keys before the query) runs without the causal mask too
    # when no query sees a later key: one query per sequence at the end of its keys (decode), or a
    # window that ends at the query; the engine makes the same exception.
    if not isinstance(window, (list, tuple)) or len(window) != 2:
        raise TypeError(f"attention: window = {window!r}; expected a pair (left, right) of ints (-1: unlimited)")
    queries = max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0) if cu_q else int(q.shape[1])
    later_keys = not causal and queries > 1 and _int("attention", "window[1]", window[1]) != 0

    def refuse_later_keys(name, why=""):
        if later_keys:
            raise ValueError(f"attention: causal = False with {name} and {queries} queries per sequence; expected "
                             f"causal=True, one query per sequence or window[1] = 0{why}")

    def gate_of(group_scheme, group_heads):
        if isinstance(group_scheme, Scheme) and group_scheme.inputs:
            if len(group_scheme.inputs) > 1:
                raise ValueError(f"attention: {group_scheme.name} reads {len(group_scheme.inputs)} per-token inputs; "
                                 "expected at most one per head group")
            if group_scheme.entry.get("causal_only"):
                refuse_later_keys(group_scheme.name)
            gates.append(group_scheme._attention_input())
            return group_scheme
        if not isinstance(group_scheme, Forgetting):
            gates.append(torch.empty(0))
            return group_scheme
        if group_scheme.heads != group_heads:
            raise ValueError(f"attention: Forgetting's log_fgate has {group_scheme.heads} heads; expected the "
                             f"group's {group_heads}")
        refuse_later_keys("Forgetting", " (the decay Σ log f is defined for keys at or before the query)")
        gates.append(group_scheme.log_fgate)
        return group_scheme.base

    if isinstance(scheme, (list, tuple)):
        # Head groups: (heads, scheme) pairs covering the query heads in order.
        if not scheme or not all(isinstance(g, (list, tuple)) and len(g) == 2 for g in scheme):
            raise TypeError(f"attention: scheme = {scheme!r}; expected a non-empty list of (heads, scheme) pairs")
        groups = []
        for group_heads, group_scheme in scheme:
            if not isinstance(group_heads, int) or isinstance(group_heads, bool) or group_heads < 1:
                raise ValueError(f"attention: a group's heads = {group_heads!r}; expected an int >= 1")
            groups.append((group_heads, gate_of(group_scheme, group_heads)))
        total = sum(h for h, _ in groups)
        if total != q.shape[-2]:
            raise ValueError(f"attention: the groups' heads sum to {total}; expected the {q.shape[-2]} heads of q")
    else:
        groups = [(q.shape[-2], gate_of(scheme, q.shape[-2]))]
    # One Scheme and one parameter tensor per group (empty for a scheme without learned parameters).
    schemes, params = [], []
    for group_heads, group_scheme in groups:
        group, group_params = _attention_scheme(group_scheme, group_heads, keys_rotated, int(q.shape[-1]))
        schemes.append(group)
        params.append(group_params)
    # No gate and no per-token input: the op's empty list (an input with no elements still counts).
    if all(g.numel() == 0 for g in gates) and not any(isinstance(s, Scheme) and s.inputs for _, s in groups):
        gates = []
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise TypeError(f"attention: sinks is {type(sinks).__name__}; expected a torch.Tensor [H] or None")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[-2]):
        raise ValueError(f"attention: sinks shape {tuple(sinks.shape)}; expected [{q.shape[-2]}] (one per query head)")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)):
        raise TypeError(f"attention: chunk_size is {type(chunk_size).__name__}; expected an int >= 1 or None")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"attention: chunk_size = {chunk_size}; expected an int >= 1 or None (no chunks)")
    if temperature is not None and not isinstance(temperature, PositionTemperature):
        raise TypeError(f"attention: temperature is {type(temperature).__name__}; expected a "
                        "posenc.PositionTemperature or None")
    if scale is not None and not _number("attention", "scale", scale) > 0:
        raise ValueError(f"attention: scale = {scale}; expected a number > 0, or None for 1/sqrt(D)")
    return (q, k, v, schemes, params, gates, sinks, _flag("attention", "causal", causal),
            _int("attention", "window[0]", window[0]), _int("attention", "window[1]", window[1]), chunk_size,
            None if temperature is None else temperature._spec(), _number("attention", "softcap", softcap),
            None if scale is None else float(scale), None if q_positions is None else _positions(q_positions, 0),
            None if k_positions is None else _positions(k_positions, 0), cu_q, cu_k,
            _flag("attention", "skip_vanishing_tiles", skip_vanishing_tiles))
