"""posenc's modules: each positional scheme with its parameters, and what attention makes of it
(``_attention_scheme``)."""
import json
import os

import torch

from ._checks import _EMPTY, _finite, _flag, _int, _non_finite_key, _object, _ops, _pair_positions, _positions
from ._functional import (_rope_args, alibi_bias, alibi_slopes, cope_attention, fire_bias, floater_table, kerple_bias,
                          learned, rope, rope_multi, shaw_scores, shaw_values, sinusoidal_table, t5_bias, tupe_bias,
                          xl_scores)
from .registry import Scheme, _attention_module, _scheme_spec


# transformers' model types whose apply_rotary_pos_emb rotates interleaved pairs (their cos and sin
# repeat_interleave'd, or rotate_half over x[..., ::2] and x[..., 1::2]; Llama 4's apply_rotary_emb
# multiplies the pairs as complex numbers), read from transformers 5.24's modeling files; every
# other config rotates half-split, as Llama's rotate_half does.
_INTERLEAVED_ROPE_MODEL_TYPES = frozenset({
    "glm", "glm4", "ernie4_5", "ernie4_5_moe", "helium", "cohere", "cohere2", "cohere2_moe", "moonshine",
    "moonshine_streaming", "hy_v4_vl", "llama4", "llama4_text"})


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


@_attention_module("rope", lambda cls, heads, head_dim: cls(head_dim))
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


@_attention_module("alibi", lambda cls, heads, head_dim: cls(heads))
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


@_attention_module("t5", lambda cls, heads, head_dim: cls(heads))
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


class LearnedPositionalEncoding(torch.nn.Module):
    """A learned absolute table [max_len, dim] (GPT-2, BERT), initialised N(0, std²): x + table[pos]."""

    def __init__(self, max_len, dim, std=0.02):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(max_len, dim) * std)

    def forward(self, x, positions=None):
        return learned(self.table, x, positions)


@_attention_module("kerple", lambda cls, heads, head_dim: cls(heads))
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


@_attention_module("fire", lambda cls, heads, head_dim: cls(heads))
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


@_attention_module("tupe", lambda cls, heads, head_dim: cls(heads, head_dim, 64, 512))
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


@_attention_module("shaw", lambda cls, heads, head_dim: cls(16, head_dim))
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


@_attention_module("xl", lambda cls, heads, head_dim: cls(heads, head_dim, 64))
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

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        # The registered "cope" (posenc.schemes()), its table the parameter tensor.
        if self.head_dim != head_dim:
            raise ValueError(f"attention: CoPE has head_dim = {self.head_dim}; expected q's {head_dim}")
        return _scheme_spec("cope", heads, {"positions": self.npos_max}), self.table

    def extra_repr(self):
        return f"npos_max={self.npos_max}, head_dim={self.head_dim}"


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
