"""posenc: positional encodings for transformer models, as PyTorch ops and modules.

The ops run posenc's C++ kernels (``torch.ops.posenc.*``, loaded from the ``libposenc_torch.so``
next to this file) and differentiate through ``torch.autograd``. Tensors must be on the CPU;
positions are int64 tensors ``[S]`` (shared by the batch) or ``[B, S]``. Bad arguments raise
``ValueError`` (bad values or shapes; the message names the parameter, its value and what was
expected) or ``TypeError`` (wrong device or dtype).

Use with the set-up's environment (torch from PyPI) after either set-up command (a build with
``-DPOSENC_BUILD_TORCH=ON``), or install its wheel or ``cmake --install`` it (README)::

    PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python -c "import posenc"
"""
import json
import math
import numbers
import os

import torch

__all__ = [
    "empty_cache", "huge_page_zeros", "sinusoidal_table", "rope", "alibi_slopes", "alibi_bias", "t5_bias", "kerple_bias", "fire_bias",
    "tupe_bias", "learned", "floater_table", "shaw_scores", "shaw_values", "xl_scores", "attention", "rope_",
    "rope_multi",
    "SinusoidalPositionalEncoding", "LearnedPositionalEncoding", "RotaryPositionalEncoding", "ALiBi",
    "T5RelativeBias", "Kerple", "FIRE", "TUPE", "FLOATER", "ShawRelativePositions", "TransformerXLRelative",
    "schemes", "Scheme", "RelativeBias", "Sandwich", "Forgetting", "forgetting_attention", "PositionTemperature",
    "stickbreaking_attention", "CoPE", "cope_attention",
    "nn", "KVCache", "distributed", "quantize_kv", "dequantize_kv",
]


def _load():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libposenc_torch.so")
    if not os.path.exists(path):
        raise ImportError(f"posenc: {path} is missing; build with -DPOSENC_BUILD_TORCH=ON (both set-up commands do)")
    # The extension's C++ ABI is that of the torch it was built against: another major.minor would
    # abort the interpreter when the library loads, so it is refused here, in one line.
    from ._build import TORCH_VERSION
    built, running = TORCH_VERSION.split(".")[:2], torch.__version__.split("+")[0].split(".")[:2]
    if built != running:
        raise ImportError(f"posenc: built for torch {TORCH_VERSION}, but this interpreter has torch {torch.__version__}; "
                          f"install torch=={'.'.join(built)}.* or rebuild posenc against this torch")
    torch.ops.load_library(path)


def _finite(name, value):
    """value, after checking that every number in it (in dicts and lists too) is finite: the message
    names the entry."""
    def check(path, x):
        # While torch.compile traces, a module's floats may be symbolic (dynamic=True); they were
        # checked when the module was made, and the library checks them again.
        if isinstance(x, float) and not torch.compiler.is_compiling() and not math.isfinite(x):
            raise ValueError(f"{path} = {x}; expected a finite number")
        if isinstance(x, dict):
            for k, v in x.items():
                check(f"{path}[{k!r}]", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                check(f"{path}[{i}]", v)
    check(name, value)
    return value


def _int(where, name, value, minimum=None):
    """value as an int, refusing bools, floats (no silent truncation) and other types by name."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} is {type(value).__name__}; expected an int")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: {name} = {value}; expected an int >= {minimum}")
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{where}: {name} = {value}; expected an int in [-2^63, 2^63)")
    return int(value)


def _number(where, name, value):
    """value as a float, refusing bools, strings and None by name."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} is {type(value).__name__}; expected a number")
    return float(value)


def _flag(where, name, value):
    """value as a bool: only True or False (a string such as 'no' would otherwise count as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} is {type(value).__name__}; expected True or False")
    return value


_load()
from . import _fake  # noqa: E402,F401  the ops' fake kernels (torch.compile, opcheck)
_ops = torch.ops.posenc
_EMPTY = torch.empty(0, dtype=torch.float64)  # the parameter tensor of a scheme without any


def _positions(positions, length, device_like=None):
    if positions is None:
        return torch.arange(length, dtype=torch.long)
    if not isinstance(positions, torch.Tensor):
        positions = torch.as_tensor(positions, dtype=torch.long)
    return positions


def empty_cache():
    """Return the memory of freed large outputs, which posenc keeps (up to 1 GiB) for reuse, to
    the system. Outputs of 1 MiB or more reuse blocks of the same size: a loop that asks for the
    same shapes every step then pays no first-touch page faults."""
    _ops.empty_cache()


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

# transformers' model types whose apply_rotary_pos_emb rotates interleaved pairs (their cos and sin
# repeat_interleave'd, or rotate_half over x[..., ::2] and x[..., 1::2]; Llama 4's apply_rotary_emb
# multiplies the pairs as complex numbers), read from transformers 5.24's modeling files; every
# other config rotates half-split, as Llama's rotate_half does.
_INTERLEAVED_ROPE_MODEL_TYPES = frozenset({
    "glm", "glm4", "ernie4_5", "ernie4_5_moe", "helium", "cohere", "cohere2", "cohere2_moe", "moonshine",
    "moonshine_streaming", "hy_v4_vl", "llama4", "llama4_text"})


def _concrete(x):
    """x with symbolic numbers (torch.compile's dynamic=True traces a module's ints and floats as
    symbols) made plain: the objects are built from the values the graph is specialised on."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        return int(x) if isinstance(x, torch.SymInt) else float(x)
    if isinstance(x, dict):
        return {k: _concrete(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_concrete(v) for v in x)
    return x


def _object(spec):
    """A typed argument of the ops (torch.classes.posenc.Rope, Scheme or Temperature) from its spec
    (kind, constructor arguments, and for a Scheme its Rope's arguments or None)."""
    kind, args, rope_args = _concrete(spec)
    if rope_args is not None:
        args = (*args[:-1], torch.classes.posenc.Rope(*rope_args))
    return getattr(torch.classes.posenc, kind)(*args)


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


def alibi_bias(slopes, q_positions, k_positions, symmetric=False):
    """ALiBi biases [B, H, Sq, Sk]: -m_h·(i - j) (or -m_h·|i - j| when symmetric), differentiable in
    the slopes."""
    return _ops.alibi_bias(slopes, _positions(q_positions, 0), _positions(k_positions, 0), bool(symmetric))


def t5_bias(table, q_positions, k_positions, num_buckets=32, max_distance=128, bidirectional=True):
    """T5 relative biases [B, H, Sq, Sk] from a table [num_buckets, H], with transformers' bucket
    function; differentiable in the table."""
    return _ops.t5_bias(table, _positions(q_positions, 0), _positions(k_positions, 0), int(num_buckets),
                        int(max_distance), bool(bidirectional))


def kerple_bias(r1, r2, q_positions, k_positions, power=False):
    """Kerple biases [B, H, Sq, Sk]: -r1·log(1 + r2·|i - j|), or -r1·|i - j|^r2 with power=True
    (0 < r2 <= 2); r1, r2: [H], differentiable."""
    return _ops.kerple_bias(r1, r2, _positions(q_positions, 0), _positions(k_positions, 0), bool(power))


def fire_bias(w1, b1, w2, b2, c, threshold, q_positions, k_positions):
    """FIRE biases [B, H, Sq, Sk] = MLP(log(1 + c|i - j|) / log(1 + c·max(L, i))): w1, b1 [hidden],
    w2 [H, hidden], b2 [H], c and threshold L 0-d tensors; all differentiable."""
    return _ops.fire_bias(w1, b1, w2, b2, c, threshold, _positions(q_positions, 0), _positions(k_positions, 0))


def tupe_bias(table, u_q, u_k, theta1, theta2, q_positions, k_positions, heads, cls_reset=False):
    """TUPE biases [B, H, Sq, Sk] = (p_i U^Q)·(p_j U^K)/sqrt(2D): table [max_len, d_model], u_q and
    u_k [d_model, H·D], theta1, theta2 [H] (the [CLS] reset); all differentiable."""
    return _ops.tupe_bias(table, u_q, u_k, theta1, theta2, _positions(q_positions, 0), _positions(k_positions, 0),
                          int(heads), bool(cls_reset))


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


class SinusoidalPositionalEncoding(torch.nn.Module):
    """x + sinusoidal table for the tokens' positions (x: [B, S, D] or [S, D]). Nothing is stored:
    the table is recomputed, so the module has no state to save and extends to any length."""

    def __init__(self, dim, base=10000.0, interleaved=True):
        super().__init__()
        self.dim, self.base, self.interleaved = dim, base, interleaved

    def forward(self, x, positions=None):
        table = sinusoidal_table(_positions(positions, x.shape[-2]), self.dim, self.base, self.interleaved, x.dtype)
        return x + table

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        # Shortformer: the sinusoid added to q and k (not v) inside the fused attention.
        return _scheme_spec("absolute", heads, {"dim": self.dim, "base": self.base,
                                                "interleaved": bool(self.interleaved)}), _EMPTY


def _non_finite_key(value, path=""):
    """The path (``['rope_scaling']['factor']``) and value of the first non-finite float in a
    config's dicts and lists, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _non_finite_key(item, f"{path}[{key!r}]")
        if found is not None:
            return found
    return None


class RotaryPositionalEncoding(torch.nn.Module):
    """RoPE for q and k [B, S, H, D], with every layout and Hugging Face scaling of posenc."""

    def __init__(self, head_dim, rotary_dim=None, base=10000.0, layout="half-split", scaling=None,
                 max_position_embeddings=2048, xpos=None, rotary_offset=0):
        super().__init__()
        self.head_dim, self.rotary_dim, self.base, self.layout = head_dim, rotary_dim or head_dim, base, layout
        self.scaling, self.max_position_embeddings = dict(scaling or {}), max_position_embeddings
        self.xpos, self.rotary_offset = xpos, rotary_offset

    def extra_repr(self):
        # Every argument that is set, so that a message quoting the module shows what it is.
        text = f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, layout={self.layout!r}"
        if self.scaling:
            text += f", scaling={self.scaling!r}, max_position_embeddings={self.max_position_embeddings}"
        if self.xpos is not None:
            text += f", xpos={self.xpos!r}"
        if self.rotary_offset:
            text += f", rotary_offset={self.rotary_offset}"
        if self.mrope_section is not None:
            text += f", mrope_section={self.mrope_section!r}, mrope_interleaved={self.mrope_interleaved}"
        return text

    @classmethod
    def from_hf_config(cls, config, layer=None):
        """From a Hugging Face config (a dict, or a path to config.json), as transformers reads it
        (posenc's C++ reader, rotary.hpp: hf_rope_config_from_json): rope_theta, rope_scaling or
        rope_parameters, partial_rotary_factor, head_dim or hidden_size / num_attention_heads, a
        multimodal config's text_config. ``layer``: the layer of a config whose RoPE differs by
        layer (rope_parameters keyed by layer type with ``layer_types``, Gemma 3's
        rope_local_base_freq); the module's ``layer_type`` then names its type. An MLA config
        (DeepSeek: qk_rope_head_dim) gives RoPE over its rotated dims and ``softmax_scale``; an
        M-RoPE config (Qwen-VL) sets ``mrope_section`` and ``mrope_interleaved``, and forward then
        takes positions per axis."""
        if isinstance(config, (str, os.PathLike)):
            with open(config) as f:
                config = json.load(f)
        if not isinstance(config, dict):
            raise TypeError(f"from_hf_config: config is {type(config).__name__}; expected a dict or a path")
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
            raise TypeError(f"from_hf_config: layer is {type(layer).__name__}; expected an int or None")
        bad = _non_finite_key(config)
        if bad is not None:
            raise ValueError(f"from_hf_config: config{bad[0]} = {bad[1]!r}; expected a finite number")
        try:
            text = json.dumps(config, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"from_hf_config: config holds a value JSON cannot carry ({e})") from None
        p = json.loads(_ops.rope_config(text, layer))
        # The layout is in the model's code, not its config: these rotate pairs (2i, 2i + 1).
        layout = "interleaved" if config.get("model_type") in _INTERLEAVED_ROPE_MODEL_TYPES else "half-split"
        module = cls(p["head_dim"], p["rotary_dim"], p["base"], layout, p["scaling"],
                     p["max_position_embeddings"])
        module.layer_type = p["layer_type"] or None
        module.softmax_scale = p.get("softmax_scale")  # MLA configs: DeepSeek's softmax scale, else None
        # M-RoPE (Qwen2-VL, Qwen3-VL: mrope_section, mrope_interleaved): forward takes positions per axis.
        module.mrope_section = p.get("mrope_section")
        module.mrope_interleaved = bool(p.get("mrope_interleaved", False))
        return module

    mrope_section, mrope_interleaved = None, False

    def forward(self, q, k=None, positions=None):
        """q (and k) rotated at positions ([S] or [B, S]). A module with ``mrope_section`` (M-RoPE,
        from a Qwen-VL config) takes positions per axis (time, height, width): ``[3, S]`` or
        ``[3, B, S]`` (``rope_multi``); 1-D positions, a text-only sequence's, turn every axis alike."""
        if self.mrope_section is not None and positions is not None and torch.as_tensor(positions).dim() > 1:
            if self.xpos is not None or self.rotary_offset:
                raise ValueError(f"RotaryPositionalEncoding: mrope_section = {self.mrope_section} with xpos or "
                                 "rotary_offset; expected neither (rope_multi has no such terms)")
            return rope_multi(q, k, positions, self.mrope_section, interleave_axes=self.mrope_interleaved,
                              head_dim=self.head_dim, rotary_dim=self.rotary_dim, base=self.base, layout=self.layout,
                              scaling=self.scaling, max_position_embeddings=self.max_position_embeddings)
        return rope(q, k, positions, head_dim=self.head_dim, rotary_dim=self.rotary_dim, base=self.base,
                    layout=self.layout, scaling=self.scaling, max_position_embeddings=self.max_position_embeddings,
                    xpos=self.xpos, rotary_offset=self.rotary_offset)

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        if self.mrope_section is not None:
            raise ValueError(f"attention: a RotaryPositionalEncoding with mrope_section = {self.mrope_section} (M-RoPE); "
                             "expected q and k rotated per axis before attention (the module's forward, or "
                             "rope_multi) and no scheme, or a module without mrope_section")
        # head_dim 0 ("rope" by name) takes q's head size.
        dims = (self.head_dim, self.rotary_dim) if self.head_dim else (head_dim, head_dim)
        rope_args = _rope_args(dims[0], dims[1], self.base, self.layout, self.scaling,
                               self.max_position_embeddings, None, self.xpos, self.rotary_offset)
        return _scheme_spec("rope", heads, {"keys_rotated": _flag("attention", "keys_rotated", keys_rotated)},
                            rope_args=rope_args), _EMPTY


class ALiBi(torch.nn.Module):
    """ALiBi biases [B, H, Sq, Sk] to add to attention scores. The slopes are a buffer (saved in
    state_dict), or a Parameter with ``trainable=True``."""

    def __init__(self, heads, max_bias=8.0, symmetric=False, trainable=False):
        super().__init__()
        slopes = alibi_slopes(heads, max_bias).to(torch.float32)
        if trainable:
            self.slopes = torch.nn.Parameter(slopes)
        else:
            self.register_buffer("slopes", slopes)
        self.symmetric = symmetric

    def forward(self, q_positions, k_positions=None):
        k_positions = q_positions if k_positions is None else k_positions
        return alibi_bias(self.slopes, _positions(q_positions, 0), _positions(k_positions, 0), self.symmetric)

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        return _scheme_spec("alibi", heads, {"symmetric": bool(self.symmetric)}), self.slopes


class T5RelativeBias(torch.nn.Module):
    """T5's learned relative bias: a table [num_buckets, heads] and transformers' buckets."""

    def __init__(self, heads, num_buckets=32, max_distance=128, bidirectional=True):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(num_buckets, heads))
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional

    def forward(self, q_positions, k_positions=None):
        k_positions = q_positions if k_positions is None else k_positions
        return t5_bias(self.table, _positions(q_positions, 0), _positions(k_positions, 0), self.num_buckets,
                       self.max_distance, self.bidirectional)

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        return _scheme_spec("t5", heads, {"num_buckets": self.num_buckets, "max_distance": self.max_distance,
                                          "bidirectional": bool(self.bidirectional)}), self.table


from .registry import RelativeBias, Sandwich, Scheme, _scheme, _scheme_entry, _scheme_spec, schemes  # noqa: E402


class LearnedPositionalEncoding(torch.nn.Module):
    """A learned absolute table [max_len, dim] (GPT-2, BERT), initialised N(0, std²): x + table[pos]."""

    def __init__(self, max_len, dim, std=0.02):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(max_len, dim) * std)

    def forward(self, x, positions=None):
        return learned(self.table, x, positions)


def _pair_positions(q_positions, k_positions):
    return q_positions, (q_positions if k_positions is None else k_positions)


class Kerple(torch.nn.Module):
    """Kerple biases with learnable r1, r2 per head (log form, or power with power=True)."""

    def __init__(self, heads, power=False, r1=1.0, r2=0.5):
        super().__init__()
        self.r1 = torch.nn.Parameter(torch.full((heads,), float(r1)))
        self.r2 = torch.nn.Parameter(torch.full((heads,), float(r2)))
        self.power = power

    def forward(self, q_positions, k_positions=None):
        q_positions, k_positions = _pair_positions(q_positions, k_positions)
        return kerple_bias(self.r1, self.r2, q_positions, k_positions, self.power)

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        return _scheme_spec("kerple", heads, {"power": bool(self.power)}), torch.stack([self.r1, self.r2])


class FIRE(torch.nn.Module):
    """FIRE biases with a learnable MLP (hidden width `hidden`), c and threshold L."""

    def __init__(self, heads, hidden=32, c=1.0, threshold=512.0):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(hidden))
        self.b1 = torch.nn.Parameter(torch.randn(hidden))
        self.w2 = torch.nn.Parameter(torch.randn(heads, hidden) / hidden ** 0.5)
        self.b2 = torch.nn.Parameter(torch.zeros(heads))
        self.c = torch.nn.Parameter(torch.tensor(float(c)))
        self.threshold = torch.nn.Parameter(torch.tensor(float(threshold)))

    def forward(self, q_positions, k_positions=None):
        q_positions, k_positions = _pair_positions(q_positions, k_positions)
        return fire_bias(self.w1, self.b1, self.w2, self.b2, self.c, self.threshold, q_positions, k_positions)

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        return _scheme_spec("fire", heads, {"hidden": int(self.w1.shape[0])}), \
            torch.cat([self.w1, self.b1, self.w2.reshape(-1), self.b2, self.c.reshape(1), self.threshold.reshape(1)])


class TUPE(torch.nn.Module):
    """TUPE's positional correlation bias: its own absolute table and projections."""

    def __init__(self, heads, head_dim, d_model, max_len, cls_reset=False, std=0.02):
        super().__init__()
        self.heads, self.cls_reset = heads, cls_reset
        self.table = torch.nn.Parameter(torch.randn(max_len, d_model) * std)
        self.u_q = torch.nn.Parameter(torch.randn(d_model, heads * head_dim) / d_model ** 0.5)
        self.u_k = torch.nn.Parameter(torch.randn(d_model, heads * head_dim) / d_model ** 0.5)
        self.theta1 = torch.nn.Parameter(torch.zeros(heads))
        self.theta2 = torch.nn.Parameter(torch.zeros(heads))

    def forward(self, q_positions, k_positions=None):
        q_positions, k_positions = _pair_positions(q_positions, k_positions)
        return tupe_bias(self.table, self.u_q, self.u_k, self.theta1, self.theta2, q_positions, k_positions,
                         self.heads, self.cls_reset)

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        return _scheme_spec("tupe", heads, {"d_model": int(self.table.shape[1]), "max_len": int(self.table.shape[0]),
                                            "cls_reset": bool(self.cls_reset)}), \
            torch.cat([self.table.reshape(-1), self.u_q.reshape(-1), self.u_k.reshape(-1), self.theta1, self.theta2])


class FLOATER(torch.nn.Module):
    """FLOATER: x + p(n·Δ) with p from a learned ODE (RK4); extends to any length."""

    def __init__(self, dim, hidden=32, time_per_position=0.1, substeps=1):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(hidden, dim + 1) / (dim + 1) ** 0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(hidden))
        self.w2 = torch.nn.Parameter(torch.randn(dim, hidden) / hidden ** 0.5)
        self.b2 = torch.nn.Parameter(torch.zeros(dim))
        self.p0 = torch.nn.Parameter(torch.randn(dim))
        self.time_per_position, self.substeps = time_per_position, substeps
        with torch.no_grad():
            self.table(1)  # Δ, substeps and the step's stability checked at construction

    def table(self, length):
        return floater_table(self.w1, self.b1, self.w2, self.b2, self.p0, length, self.time_per_position, self.substeps)

    def forward(self, x, positions=None):
        positions = _positions(positions, x.shape[-2])
        return x + self.table(int(positions.max()) + 1)[positions].to(x.dtype)


class ShawRelativePositions(torch.nn.Module):
    """Shaw et al. 2018: learned key and value tables [2k + 1, head_dim] for clipped distances.
    scores(q, …) gives the score term to add to q·k/sqrt(D); values(probs, …) the value term to
    add to probs @ v."""

    def __init__(self, max_distance, head_dim, std=0.02):
        super().__init__()
        self.max_distance = max_distance
        self.key_table = torch.nn.Parameter(torch.randn(2 * max_distance + 1, head_dim) * std)
        self.value_table = torch.nn.Parameter(torch.randn(2 * max_distance + 1, head_dim) * std)

    def scores(self, q, q_positions=None, k_positions=None):
        q_positions = _positions(q_positions, q.shape[-3])
        return shaw_scores(q, self.key_table, q_positions, q_positions if k_positions is None else k_positions,
                           self.max_distance)

    def values(self, probs, q_positions=None, k_positions=None):
        q_positions = _positions(q_positions, probs.shape[-2])
        k_positions = _positions(k_positions, probs.shape[-1])
        return shaw_values(probs, self.value_table, q_positions, k_positions, self.max_distance)

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        return _scheme_spec("shaw", heads, {"max_distance": int(self.max_distance)}), \
            torch.stack([self.key_table, self.value_table])


class TransformerXLRelative(torch.nn.Module):
    """Transformer-XL's relative position terms with learned u, v [H, D] and W_R [H·D, d_model]."""

    def __init__(self, heads, head_dim, d_model, std=0.02, base=10000.0):
        super().__init__()
        self.u = torch.nn.Parameter(torch.randn(heads, head_dim) * std)
        self.v = torch.nn.Parameter(torch.randn(heads, head_dim) * std)
        self.w_r = torch.nn.Parameter(torch.randn(heads * head_dim, d_model) / d_model ** 0.5)
        self.base = base

    def forward(self, q, k, q_positions=None, k_positions=None):
        q_positions = _positions(q_positions, q.shape[-3])
        k_positions = _positions(k_positions, k.shape[-3])
        return xl_scores(q, k, self.u, self.v, self.w_r, q_positions, k_positions, 0.0, self.base)

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        return _scheme_spec("xl", heads, {"d_model": int(self.w_r.shape[1]), "base": float(self.base)}), \
            torch.cat([self.u.reshape(-1), self.v.reshape(-1), self.w_r.reshape(-1)])


# ─── Fused attention ──────────────────────────────────────────────────────────────────────────

class Forgetting:
    """Forgetting Attention (Lin et al., ICLR 2025, "Forgetting Transformer"): a per-token, per-head
    forget gate decays older keys' logits by Σ_{l=j+1..i} log f_l (posenc/forgetting.hpp). A scheme
    for ``posenc.attention`` (causal, or where no query sees a later key: decode), alone or in a
    head group, optionally over a ``base`` scheme of the same heads ("FoX Pro":
    ``Forgetting(log_fgate, base="rope")``).

    ``log_fgate`` ``[B, Sk, heads]`` (``[Tk, heads]`` packed; float32/64, bfloat16, float16), e.g. ``F.logsigmoid`` of the
    gate's logits: every value <= 0. It is an activation: the attention's backward reaches it."""

    def __init__(self, log_fgate, base=None):
        if not isinstance(log_fgate, torch.Tensor):
            raise TypeError(f"Forgetting: log_fgate is {type(log_fgate).__name__}; expected a torch.Tensor")
        if log_fgate.dim() not in (2, 3):
            raise ValueError(f"Forgetting: log_fgate shape {tuple(log_fgate.shape)}; expected [B, Sk, heads] (or "
                             "[Tk, heads] for packed sequences)")
        if not log_fgate.is_floating_point():
            raise TypeError(f"Forgetting: log_fgate dtype {log_fgate.dtype}; expected a floating dtype")
        if isinstance(base, Forgetting):
            raise TypeError("Forgetting: base is another Forgetting; expected a positional scheme or None")
        if isinstance(base, Scheme) and base.inputs:
            raise ValueError(f"Forgetting: base = {base.name}, a scheme of per-token inputs ("
                             f"{', '.join(base.inputs)}); expected a positional scheme or None")
        self.log_fgate = log_fgate
        self.base = base

    @property
    def heads(self):
        return self.log_fgate.shape[-1]


def forgetting_attention(q, k, v, log_fgate, *, cu_seqlens=None, scale=None, layout="bshd", return_lse=False):
    """Causal Forgetting Attention (``Forgetting``): ``attention(q, k, v, Forgetting(log_fgate),
    causal=True)``. Query i of Sq is key token Sk − Sq + i and reads that token's gate. Packed
    sequences (``cu_seqlens``, as ``attention`` takes them): q [Tq, H, D], log_fgate [Tk, H]; each
    sequence's running sum starts afresh."""
    return attention(q, k, v, Forgetting(log_fgate), causal=True, scale=scale, layout=layout, return_lse=return_lse,
                     cu_seqlens=cu_seqlens)


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
    out, rem = _ops.stickbreaking_attention(
        q, k, v, 0.0 if scale is None else float(scale), _flag("stickbreaking_attention", "attend_current",
                                                               attend_current),
        cu_q, cu_k, _flag("stickbreaking_attention", "skip_vanishing_tiles", skip_vanishing_tiles))
    if layout == "bhsd":
        out, rem = out.transpose(1, 2), rem.transpose(1, 2)
    return out, rem


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
    if table.is_floating_point() and table.dtype not in (q.dtype, torch.float32):
        table = table.to(q.dtype)
    out, lse = _ops.cope_attention(q, k, v, table, 0.0 if scale is None else float(scale), cu_q, cu_k)
    if layout == "bhsd":
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if _flag("cope_attention", "return_lse", return_lse) else out


class CoPE(torch.nn.Module):
    """CoPE's learned position table ``[npos_max, head_dim]`` (zeros at first, as the paper's: the
    layer starts as attention without positions), used as ``posenc.attention(q, k, v, cope)``
    (causal) or called as ``cope(q, k, v, scale=…, cu_seqlens=…, layout=…)``. See
    ``cope_attention``."""

    def __init__(self, npos_max, head_dim, dtype=torch.float32):
        super().__init__()
        npos_max = _int("CoPE", "npos_max", npos_max, 1)
        if npos_max > 65536:
            raise ValueError(f"CoPE: npos_max = {npos_max}; expected at most 65536")
        head_dim = _int("CoPE", "head_dim", head_dim, 1)
        self.npos_max, self.head_dim = npos_max, head_dim
        self.table = torch.nn.Parameter(torch.zeros(npos_max, head_dim, dtype=dtype))

    def forward(self, q, k, v, *, scale=None, cu_seqlens=None, layout="bshd", return_lse=False):
        return cope_attention(q, k, v, self.table, scale=scale, cu_seqlens=cu_seqlens, layout=layout,
                              return_lse=return_lse)

    def extra_repr(self):
        return f"npos_max={self.npos_max}, head_dim={self.head_dim}"


def _attention_scheme(scheme, heads, keys_rotated, head_dim):
    """(Scheme, parameter tensor) of one head group: None, a registered name (posenc.schemes(): its
    options' defaults), or a module, which says itself what it is to the op
    (``_attention_scheme(heads, keys_rotated, head_dim)``). The tensor is in the registry's
    parameter_shape, empty for a scheme without learned parameters."""
    if scheme is None:
        return _scheme_spec("none", heads), _EMPTY
    if isinstance(scheme, str):
        if scheme == "rope":
            return RotaryPositionalEncoding(0)._attention_scheme(heads, keys_rotated, head_dim)
        if scheme == "alibi":
            return _scheme_spec("alibi", heads, {"symmetric": False}), alibi_slopes(heads)
        # A name means the scheme's defaults; a learned one needs a module (it owns the tensors),
        # and so does one that reads per-token inputs.
        entry = _scheme_entry(scheme)
        if entry.get("inputs"):
            names = ", ".join(i["name"] for i in entry["inputs"])
            raise ValueError(f"attention: scheme = {scheme!r} reads per-token inputs ({names}); pass "
                             f"posenc.Scheme({scheme!r}, heads, head_dim, {entry['inputs'][0]['name']}=...) instead of "
                             "its name")
        if entry["parameters"]:
            raise ValueError(f"attention: scheme = {scheme!r} has learned parameters ({entry['parameters']}); "
                             f"pass posenc.Scheme({scheme!r}, heads, head_dim) or its module instead of its name")
        return _scheme_spec(scheme, heads), _EMPTY
    if isinstance(scheme, torch.nn.Module) and hasattr(scheme, "_attention_scheme"):
        return scheme._attention_scheme(heads, keys_rotated, head_dim)
    raise TypeError(f"attention: scheme = {scheme!r}; expected None, a registered name (posenc.schemes()), a "
                    "list of (heads, scheme) pairs, or a RotaryPositionalEncoding, SinusoidalPositionalEncoding "
                    "(Shortformer: added to q and k), ALiBi, T5RelativeBias, Kerple, FIRE, ShawRelativePositions, "
                    "TransformerXLRelative, TUPE, Scheme (any registered scheme) or RelativeBias module")


class PositionTemperature:
    """A position-dependent attention temperature (posenc/temperature.hpp): each query is multiplied
    by s(p) of its position p inside ``posenc.attention``.

    ``PositionTemperature(kind="llama4", floor_scale=8192, attn_scale=0.1)``: Llama 4's NoPE layers,
    s(p) = 1 + attn_scale·ln(⌊(p + 1)/floor_scale⌋ + 1).
    ``PositionTemperature(kind="mistral", beta=0.1, original_max_position_embeddings=L0)``:
    Ministral 3's llama_4_scaling_beta, s(p) = 1 + beta·ln(1 + ⌊p / L0⌋)."""

    _KEYS = {"llama4": ("floor_scale", "attn_scale"), "mistral": ("beta", "original_max_position_embeddings")}
    _DEFAULTS = {"floor_scale": 8192.0, "attn_scale": 0.1}

    def __init__(self, kind="llama4", **values):
        if kind not in self._KEYS:
            raise ValueError(f"PositionTemperature: kind = {kind!r}; expected 'llama4' or 'mistral'")
        for key in values:
            if key not in self._KEYS[kind]:
                raise TypeError(f"PositionTemperature: {key} given; expected only {', '.join(self._KEYS[kind])} "
                                f"for kind={kind!r}")
        self.kind, self.values = kind, {}
        for key in self._KEYS[kind]:
            if key not in values and key not in self._DEFAULTS:
                raise TypeError(f"PositionTemperature: {key} missing for kind={kind!r}")
            value = values.get(key, self._DEFAULTS.get(key))
            integer = key == "original_max_position_embeddings"
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
                raise TypeError(f"PositionTemperature: {key} is {type(value).__name__}; expected "
                                f"{'an int' if integer else 'a number'}")
            self.values[key] = value
        _finite("PositionTemperature", self.values)
        self._object()  # validated by the library (ValueError naming the key)

    def _object(self):
        """The op's typed argument (built on demand: the module itself stays a plain, picklable value)."""
        return _object(self._spec())

    def _spec(self):
        return "Temperature", (self.kind, {k: float(v) for k, v in self.values.items()}), None

    def factor(self, positions):
        """s(p) for an int64 tensor of positions (float64)."""
        positions = torch.as_tensor(positions, dtype=torch.long)
        temperature = self._object()
        return torch.tensor([temperature.factor(int(p)) for p in positions.reshape(-1)],
                            dtype=torch.float64).reshape(positions.shape)

    def __repr__(self):
        return f"PositionTemperature(kind={self.kind!r}, " + ", ".join(f"{k}={v!r}" for k, v in self.values.items()) + ")"


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
    and head; causal, or where no query sees a later key) — whose learned parameters (and the
    gate) receive gradients. ``causal`` aligns the mask
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
        if isinstance(scheme, CoPE):
            raise ValueError("attention: CoPE with kv_format; expected k and v tensors (CoPE runs its own kernel)")
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
    if isinstance(scheme, CoPE):
        _cope_alone(causal, window, chunk_size, temperature, softcap, q_positions, k_positions, keys_rotated, sinks)
        out = scheme(q, k, v, scale=scale, cu_seqlens=cu_seqlens, layout=layout, return_lse=return_lse)
        if not return_lse:
            return out
        return out[0], out[1] if layout == "bhsd" else out[1].transpose(-1, -2)
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


def _cope_alone(causal, window, chunk_size, temperature, softcap, q_positions, k_positions, keys_rotated, sinks):
    """CoPE runs its own causal kernel: the options it does not combine with are refused by name."""
    if causal is not True:
        raise ValueError(f"attention: causal = {causal!r} with CoPE; expected causal=True (its positions count "
                         "gates from the query leftwards)")
    given = [name for name, value, unset in (
        ("window", window, (-1, -1)), ("chunk_size", chunk_size, None), ("temperature", temperature, None),
        ("softcap", softcap, 0.0), ("q_positions", q_positions, None), ("k_positions", k_positions, None),
        ("keys_rotated", keys_rotated, False), ("sinks", sinks, None)) if not _unset(value, unset)]
    if given:
        raise ValueError(f"attention: {given[0]} with CoPE; expected it left unset (CoPE's positions come from "
                         "its gates, and its kernel takes no other term)")


def _unset(value, unset):
    if unset is None:
        return value is None
    if isinstance(value, torch.Tensor):
        return False
    return value == unset


def _cu_seqlens(cu_seqlens, where="attention"):
    """cu_seqlens as the op's (cu_q, cu_k) lists of ints ([] and []: not packed). One sequence (a
    1-D integer tensor, or a list or tuple of ints) serves queries and keys; a pair ``(cu_q, cu_k)``
    is a tuple of two sequences. Given, each holds at least [0, T]: an empty one is not "unset"."""
    if cu_seqlens is None:
        return [], []

    def is_sequence(x):
        return isinstance(x, (list, tuple)) or (isinstance(x, torch.Tensor) and x.dim() == 1)

    def entry(x):  # an int, or a 0-dim integer tensor (as tuple(tensor) gives them)
        if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_floating_point() and not x.is_complex():
            return x.item()
        return x

    if isinstance(cu_seqlens, tuple) and cu_seqlens and all(is_sequence(x) for x in cu_seqlens):
        if len(cu_seqlens) != 2:
            raise TypeError(f"{where}: cu_seqlens is a tuple of {len(cu_seqlens)} sequences; expected one sequence "
                            "of ints or a pair (cu_q, cu_k)")
        pair = cu_seqlens
    else:
        pair = (cu_seqlens, cu_seqlens)
    lists = []
    for name, cu in zip(("cu_seqlens_q", "cu_seqlens_k") if pair[0] is not pair[1] else ("cu_seqlens",) * 2, pair):
        if isinstance(cu, torch.Tensor):
            if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
                raise TypeError(f"{where}: {name} is a {cu.dtype} tensor of shape {tuple(cu.shape)}; expected a 1-D "
                                "integer tensor")
            cu = cu.tolist()
        if not isinstance(cu, (list, tuple)):
            raise TypeError(f"{where}: {name} is {type(cu).__name__}; expected a 1-D integer tensor, a list or a "
                            "tuple of ints")
        if len(cu) < 2:
            raise ValueError(f"{where}: len({name}) = {len(cu)}; expected at least 2 ([0, ..., T], the "
                             "cumulative sequence lengths), or cu_seqlens=None for unpacked [B, S, H, D] tensors")
        lists.append([_int(where, f"{name}[{i}]", entry(x)) for i, x in enumerate(cu)])
    return lists[0], lists[1]


@torch.compiler.allow_in_graph
def _attention_op(q, k, v, schemes, params, gates, sinks, causal, window_left, window_right, chunk_size, temperature,
                  *rest):
    """The attention op on ``_attention_args``' values, its typed arguments made here from their
    specs. torch.compile puts this call into its graph as it is, with the specs as constants; its
    autograd then traces it, and the objects reach the op's traced path as constants of the graph
    (the fake kernels: python/posenc/_fake.py)."""
    return _ops.attention(q, k, v, [_object(s) for s in schemes], params, gates, sinks, causal, window_left,
                          window_right, chunk_size, None if temperature is None else _object(temperature), *rest)


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


from . import nn  # noqa: E402  (nn builds on the names above)
from .nn import KVCache  # noqa: E402
from . import distributed  # noqa: E402
