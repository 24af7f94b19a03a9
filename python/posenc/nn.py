"""Layers to drop into a model: ``SelfAttention`` (projections around posenc's fused attention,
with any scheme) and ``KVCache`` (the keys and values of past tokens, for generation).

A cached step gives what recomputing the whole sequence gives: the cache keeps each token's
position, and a cache of rotated keys re-rotates them when RoPE's frequencies change with the
length (dynamic NTK, LongRoPE's switch from short to long factors) or when the positions move (a
context shift). Caches hold no gradient: they serve inference."""
import torch

from ._attention import attention
from ._checks import _int, _ops
from ._functional import _KV_FORMATS, _rope_params, dequantize_kv, huge_page_zeros, quantize_kv
from ._modules import RotaryPositionalEncoding  # also registers the schemes' own modules (_attention_module)
from .registry import _ATTENTION_MODULES, Scheme, schemes

__all__ = ["SelfAttention", "KVCache"]


def _rope_op_params(rope):
    """The ops' parameters of a RoPE module (torch.classes.posenc.Rope)."""
    return _rope_params(rope.head_dim, rope.rotary_dim, rope.base, rope.layout, rope.scaling,
                        rope.max_position_embeddings, None, rope.xpos, rope.rotary_offset)


# A cache's steps change Python state (its length and positions, buffers that grow, the frequency
# state its keys were rotated under), which torch.compile cannot trace: they run eagerly, and a
# model compiled with fullgraph=True that decodes with a cache is refused with this reason.
_eager_only = torch.compiler.disable(
    reason="posenc.KVCache's steps run eagerly (they change the cache's Python state); compile the "
           "model without fullgraph=True to decode with a cache, or call it without one")


def _frequency_state(rope, seq_len):
    """What RoPE's frequencies depend on at a sequence length (rotary.hpp): dynamic NTK on
    max(seq_len, M), LongRoPE on whether seq_len passes M0; every other type on nothing."""
    kind = rope.scaling.get("rope_type", rope.scaling.get("type", "default"))
    if kind == "dynamic":
        return max(seq_len, rope.max_position_embeddings)
    if kind in ("longrope", "su"):
        m0 = rope.scaling.get("original_max_position_embeddings") or rope.max_position_embeddings
        return seq_len > m0
    return None


class KVCache:
    """The keys and values of one attention layer's past tokens, ``[B, length, G, D]``, with the
    tokens' positions (``[length]``, shared by the batch rows).

    ``rope``: a ``RotaryPositionalEncoding`` whose keys the cache stores rotated (``rotated=True``:
    each key is rotated once, when appended; decode rotates only the query) or as they came
    (``rotated=False``: the kernel rotates every key at every step, always under the current
    frequencies). ``capacity`` tokens are allocated at once and doubled when full;
    ``huge_pages=True`` puts the buffers on 2 MiB pages (``posenc.huge_page_zeros``).

    ``dtype``: a torch dtype, or a quantized format — ``"q8_0"``, ``"q4_0"`` (ggml's blocks; head
    sizes multiples of 32) or ``"fp8_e4m3"`` (a scale per row): rows are quantized as they are
    appended (``posenc.quantize_kv``; a rotated cache rotates them first, as ggml stores keys) and
    dequantised inside the attention kernel; ``keys`` and ``values`` are then the uint8 rows.
    ``rope_after_dequant=True`` (the same as ``rotated=False``) stores keys before RoPE and rotates
    them after dequantisation, inside the kernel (KVQuant's finding: pre-RoPE keys lose less)."""

    def __init__(self, batch, kv_heads, head_dim, *, capacity=256, value_dim=None, dtype=torch.float32, rope=None,
                 rotated=True, huge_pages=False, rope_after_dequant=None):
        self.batch = _int("KVCache", "batch", batch, 1)
        self.kv_heads = _int("KVCache", "kv_heads", kv_heads, 1)
        self.head_dim = _int("KVCache", "head_dim", head_dim, 1)
        self.value_dim = self.head_dim if value_dim is None else _int("KVCache", "value_dim", value_dim, 1)
        capacity = _int("KVCache", "capacity", capacity, 1)
        self.format = dtype if isinstance(dtype, str) else None
        if self.format is not None:
            if self.format not in _KV_FORMATS:
                raise ValueError(f"KVCache: dtype = {dtype!r}; expected a torch dtype or one of {', '.join(_KV_FORMATS)}")
            for name, width in (("head_dim", self.head_dim), ("value_dim", self.value_dim)):
                if self.format != "fp8_e4m3" and width % 32:
                    raise ValueError(f"KVCache: {name} = {width} with dtype = {dtype!r}; expected a multiple of 32 "
                                     "(blocks of 32 values)")
        elif not isinstance(dtype, torch.dtype) or dtype not in (torch.float32, torch.float64, torch.bfloat16,
                                                                   torch.float16):
            raise TypeError(f"KVCache: dtype = {dtype!r}; expected torch.float32, float64, bfloat16 or float16, or "
                            f"one of {', '.join(_KV_FORMATS)}")
        if rope_after_dequant is not None:
            if not isinstance(rope_after_dequant, bool):
                raise TypeError("KVCache: rope_after_dequant must be a bool or None")
            rotated = not rope_after_dequant
        if rope is not None and not isinstance(rope, RotaryPositionalEncoding):
            raise TypeError(f"KVCache: rope is {type(rope).__name__}; expected a RotaryPositionalEncoding or None")
        if rope is not None and rope.head_dim != self.head_dim:
            raise ValueError(f"KVCache: rope.head_dim = {rope.head_dim}; expected the cache's head_dim = "
                             f"{self.head_dim}")
        if not isinstance(rotated, bool) or not isinstance(huge_pages, bool):
            raise TypeError("KVCache: rotated and huge_pages must be bools")
        if rotated and rope is not None and rope.rotary_offset:
            raise ValueError(f"KVCache: rope.rotary_offset = {rope.rotary_offset} (MLA's trailing rotated dims); "
                             "expected 0 for a cache of rotated keys, or rotated=False")
        self.dtype, self.rope, self.huge_pages = dtype, rope, huge_pages
        self.rotated = rotated and rope is not None
        self.length = 0
        self._state = None  # the frequency state the stored keys were rotated under
        self._seq_len = 0  # and the sequence length that gave it
        self._k = self._v = None
        self._positions = torch.empty(0, dtype=torch.long)
        self._allocate(capacity)

    def _zeros(self, *shape):
        dtype = torch.uint8 if self.format else self.dtype
        return huge_page_zeros(*shape, dtype=dtype) if self.huge_pages else torch.zeros(*shape, dtype=dtype)

    def _width(self, dim):
        """A row's elements in the buffers: dim values, or a quantized row's bytes."""
        if self.format is None:
            return dim
        return {"q8_0": dim // 32 * 34, "q4_0": dim // 32 * 18}.get(self.format, dim + 4)

    def _allocate(self, capacity):
        k = self._zeros(self.batch, capacity, self.kv_heads, self._width(self.head_dim))
        v = self._zeros(self.batch, capacity, self.kv_heads, self._width(self.value_dim))
        positions = torch.zeros(capacity, dtype=torch.long)
        if self.length:
            k[:, :self.length] = self._k[:, :self.length]
            v[:, :self.length] = self._v[:, :self.length]
            positions[:self.length] = self._positions[:self.length]
        self._k, self._v, self._positions = k, v, positions

    @property
    def capacity(self):
        return self._k.shape[1]

    @property
    def keys(self):
        """The stored keys ``[B, length, G, D]`` (a view; rotated when ``rotated``; a quantized cache's
        uint8 rows)."""
        return self._k[:, :self.length]

    @property
    def values(self):
        return self._v[:, :self.length]

    @property
    def positions(self):
        """The stored tokens' positions ``[length]`` (a view)."""
        return self._positions[:self.length]

    def _rerotate(self, from_rope, from_seq_len, from_positions, to_rope, to_seq_len, to_positions, rows):
        if rows == 0:
            return
        keys = self._k[:, :rows] if self.format is None else dequantize_kv(self._k[:, :rows], self.format)
        _ops.rope_rerotate_(keys, from_positions.contiguous(), _rope_op_params(from_rope), from_seq_len,
                            to_positions.contiguous(), _rope_op_params(to_rope), to_seq_len)
        if self.format is not None:
            # Rotated, then quantized again: each re-rotation of a quantized cache rounds once more.
            self._k[:, :rows] = quantize_kv(keys, self.format)

    @_eager_only
    @torch.no_grad()
    def append(self, k, v, positions=None):
        """Stores the keys ``k [B, S, G, D]`` and values ``v [B, S, G, Dv]`` of S new tokens (as they
        come from the projections: a rotated cache rotates them here) at ``positions`` (int64
        ``[S]``; default: after the last stored position)."""
        for name, x, width in (("k", k, self.head_dim), ("v", v, self.value_dim)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"KVCache.append: {name} is {type(x).__name__}; expected a torch.Tensor")
            if x.dim() != 4 or x.shape[0] != self.batch or x.shape[2] != self.kv_heads or x.shape[3] != width:
                raise ValueError(f"KVCache.append: {name} shape {tuple(x.shape)}; expected [{self.batch}, S, "
                                 f"{self.kv_heads}, {width}]")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"KVCache.append: k has {k.shape[1]} tokens and v {v.shape[1]}; expected the same")
        s = k.shape[1]
        if positions is None:
            first = int(self._positions[self.length - 1]) + 1 if self.length else 0
            positions = torch.arange(first, first + s, dtype=torch.long)
        elif not isinstance(positions, torch.Tensor) or positions.dtype != torch.long or positions.shape != (s,):
            raise ValueError(f"KVCache.append: positions must be an int64 tensor [{s}]")
        if self.length + s > self.capacity:
            self._allocate(max(2 * self.capacity, self.length + s))
        new = slice(self.length, self.length + s)
        if self.format is not None:
            # Keys go in through float32 (rotated there, below), values straight to their rows.
            k = k.to(torch.float32, copy=True).contiguous()  # rotated below: never the caller's tensor
            self._v[:, new] = quantize_kv(v, self.format)
        else:
            self._k[:, new] = k
            self._v[:, new] = v
        self._positions[new] = positions
        if self.format is not None and not self.rotated:
            self._k[:, new] = quantize_kv(k, self.format)
        if self.rotated:
            # The kernel rotates the query under seq_len = the largest position + 1 (of the query
            # and the keys): the stored keys follow it when the frequencies depend on it.
            seq_len = int(self._positions[:self.length + s].max()) + 1
            state = _frequency_state(self.rope, seq_len)
            if self.length and state != self._state:
                self._rerotate(self.rope, self._seq_len, self.positions, self.rope, seq_len, self.positions,
                               self.length)
            keys = self._k[:, new] if self.format is None else k
            _ops.rope_(keys, keys.new_empty(0), positions, _rope_op_params(self.rope), seq_len, 0)  # 0: forward
            if self.format is not None:
                self._k[:, new] = quantize_kv(keys, self.format)
            self._state, self._seq_len = state, seq_len
        self.length += s

    @_eager_only
    @torch.no_grad()
    def shift(self, n):
        """Drops the first ``n`` tokens and moves the others' positions back by n (llama.cpp's
        context shift): the next token then takes the position after the last kept one. A rotated
        cache re-rotates the kept keys to their new positions."""
        n = _int("KVCache.shift", "n", n, 0)
        if n > self.length:
            raise ValueError(f"KVCache.shift: n = {n}; expected at most the cache's length {self.length}")
        keep = self.length - n
        old = self._positions[n:self.length].clone()
        self._k[:, :keep] = self._k[:, n:self.length].clone()
        self._v[:, :keep] = self._v[:, n:self.length].clone()
        self._positions[:keep] = old - n
        self.length = keep
        if self.rotated and keep:
            seq_len = int(self.positions.max()) + 1
            self._rerotate(self.rope, self._seq_len, old, self.rope, seq_len, self.positions, keep)
            self._state, self._seq_len = _frequency_state(self.rope, seq_len), seq_len

    @_eager_only
    @torch.no_grad()
    def set_rope(self, rope):
        """Switches to another RoPE (a new scaling, e.g. LongRoPE's long factors chosen by hand):
        a rotated cache re-rotates its keys from the old one to it."""
        if not isinstance(rope, RotaryPositionalEncoding):
            raise TypeError(f"KVCache.set_rope: rope is {type(rope).__name__}; expected a RotaryPositionalEncoding")
        if rope.head_dim != self.head_dim:
            raise ValueError(f"KVCache.set_rope: rope.head_dim = {rope.head_dim}; expected the cache's head_dim = "
                             f"{self.head_dim}")
        if self.rotated and self.length:
            # The stored keys move from the old rotation to the new one in place: same pairs, same dims.
            for name in ("rotary_dim", "layout", "rotary_offset"):
                new, old = getattr(rope, name), getattr(self.rope, name)
                if new != old:
                    raise ValueError(f"KVCache.set_rope: rope.{name} = {new!r}; expected the cache's rope.{name} = "
                                     f"{old!r} (a cache of rotated keys re-rotates them in place; an empty cache "
                                     "or one with rotated=False takes any RoPE)")
        if self.rotated and self.length:
            seq_len = int(self.positions.max()) + 1
            self._rerotate(self.rope, self._seq_len, self.positions, rope, seq_len, self.positions, self.length)
            self._state, self._seq_len = _frequency_state(rope, seq_len), seq_len
        self.rope = rope

    @_eager_only
    def attend(self, q, q_positions, scheme=None, **options):
        """``posenc.attention`` of the queries ``q [B, Sq, H, D]`` at ``q_positions`` (int64
        ``[Sq]``) over the stored tokens, causal by default, in the cache's dtype. A rotated cache takes its own RoPE as
        the scheme (None or that module); ``options`` go to ``posenc.attention``."""
        if self.rotated:
            if scheme is not None and scheme is not self.rope:
                raise ValueError("KVCache.attend: a cache of rotated keys runs its own rope; expected scheme = None "
                                 "or that RotaryPositionalEncoding")
            scheme = self.rope
        elif self.rope is not None and scheme is None:
            scheme = self.rope
        options.setdefault("causal", True)
        if self.format is not None:
            # Queries in their own dtype against the quantized rows (forward only).
            with torch.no_grad():
                return attention(q, self.keys, self.values, scheme, q_positions=q_positions,
                                 k_positions=self.positions, keys_rotated=self.rotated, kv_format=self.format,
                                 **options)
        # One dtype per call: queries meet a 16-bit cache in its dtype (the kernel's math is f32).
        out = attention(q.to(self.dtype), self.keys, self.values, scheme, q_positions=q_positions,
                        k_positions=self.positions, keys_rotated=self.rotated, **options)
        return out.to(q.dtype)


# A registered name whose scheme has a module of its own gets that module (each class registers
# itself: registry._attention_module). Any other registered scheme with learned parameters gets the
# registry's generic module (posenc.Scheme); one without is passed by name.
def _scheme_module(scheme, heads, head_dim):
    if scheme is None or scheme == "none":
        return None
    if isinstance(scheme, str):
        if scheme in _ATTENTION_MODULES:
            return _ATTENTION_MODULES[scheme](heads, head_dim)
        entry = next((e for e in schemes() if scheme == e["name"] or scheme in e["aliases"]), None)
        if entry is None:
            raise ValueError(f"SelfAttention: scheme = {scheme!r}; expected None, a module, (heads, scheme) pairs "
                             "or one of " + ", ".join(e["name"] for e in schemes()))
        if entry["inputs"]:
            raise ValueError(f"SelfAttention: scheme = {scheme!r} reads per-token inputs "
                             f"({', '.join(i['name'] for i in entry['inputs'])}), which SelfAttention does not compute; "
                             "expected a positional scheme (call posenc.attention with a posenc.Scheme per batch)")
        return Scheme(scheme, heads, head_dim) if entry["parameters"] else scheme
    if isinstance(scheme, Scheme) and scheme.inputs:
        raise ValueError(f"SelfAttention: scheme = {scheme.name} with per-token inputs (fixed at one batch's); expected a "
                         "positional scheme (call posenc.attention with a posenc.Scheme per batch)")
    if isinstance(scheme, torch.nn.Module):
        return scheme
    raise TypeError(f"SelfAttention: scheme is {type(scheme).__name__}; expected None, a registered name, a scheme "
                    "module or a list of (heads, scheme) pairs")


class SelfAttention(torch.nn.Module):
    """Multi-head self-attention with a positional scheme, on posenc's fused kernel.

    ``x [B, S, dim]`` → q, k, v projections (``heads`` query heads, ``kv_heads`` key/value heads:
    GQA when fewer), ``posenc.attention`` with ``scheme`` (None, a registered name — a learned one
    gets its module with the paper's initialisation —, a scheme module, or ``(heads, scheme)`` head
    groups), then the output projection. ``window``: the keys a query sees, w on each side (an int;
    the left only when causal) or ``(left, right)``; ``bias``: biases in the projections. ``forward(x, positions=None,
    cache=None)``: positions int64 ``[S]`` (default 0..S-1, or after the cache's last); with a
    ``KVCache`` (``make_cache``) the new tokens join it and attend to everything it holds.
    ``backend``: ``posenc.attention``'s (None: the fused kernel on the CPU, FlexAttention on other
    devices; the cache holds CPU tensors)."""

    def __init__(self, dim, heads, kv_heads=None, scheme=None, causal=True, window=None, bias=False, head_dim=None,
                 softcap=0.0, chunk_size=None, backend=None):
        super().__init__()
        self.dim = _int("SelfAttention", "dim", dim, 1)
        self.heads = _int("SelfAttention", "heads", heads, 1)
        self.kv_heads = self.heads if kv_heads is None else _int("SelfAttention", "kv_heads", kv_heads, 1)
        if self.heads % self.kv_heads:
            raise ValueError(f"SelfAttention: kv_heads = {self.kv_heads}; expected a divisor of heads = {self.heads}")
        if head_dim is None and self.dim % self.heads:
            raise ValueError(f"SelfAttention: dim = {self.dim} is not a multiple of heads = {self.heads}; pass head_dim")
        self.head_dim = self.dim // self.heads if head_dim is None else _int("SelfAttention", "head_dim", head_dim, 1)
        if not isinstance(causal, bool) or not isinstance(bias, bool):
            raise TypeError("SelfAttention: causal and bias must be bools")
        if window is None:
            window = (-1, -1)
        elif isinstance(window, int) and not isinstance(window, bool):
            window = _int("SelfAttention", "window", window, 0)
            window = (window, 0 if causal else window)
        elif not (isinstance(window, tuple) and len(window) == 2):
            raise TypeError(f"SelfAttention: window = {window!r}; expected None, an int or (left, right)")
        self.causal, self.window, self.softcap, self.chunk_size = causal, tuple(window), softcap, chunk_size
        if backend not in (None, "fused", "flex"):
            raise ValueError(f"SelfAttention: backend = {backend!r}; expected None, 'fused' or 'flex'")
        self.backend = backend
        hd = self.head_dim
        self.q_proj = torch.nn.Linear(self.dim, self.heads * hd, bias=bias)
        self.k_proj = torch.nn.Linear(self.dim, self.kv_heads * hd, bias=bias)
        self.v_proj = torch.nn.Linear(self.dim, self.kv_heads * hd, bias=bias)
        self.o_proj = torch.nn.Linear(self.heads * hd, self.dim, bias=bias)
        if isinstance(scheme, (list, tuple)):
            self.scheme = [(h, _scheme_module(s, h, hd)) for h, s in scheme]
            # The groups' modules, registered so that their parameters train and move with the layer.
            self.scheme_modules = torch.nn.ModuleList(s for _, s in self.scheme if isinstance(s, torch.nn.Module))
        else:
            self.scheme = _scheme_module(scheme, self.heads, hd)  # a module registers as a submodule

    def make_cache(self, batch, capacity=256, dtype=torch.float32, rotated=True, huge_pages=False):
        """A ``KVCache`` for this layer: of rotated keys when the scheme is one RoPE module and
        ``rotated``, else of keys as projected."""
        rope = self.scheme if isinstance(self.scheme, RotaryPositionalEncoding) else None
        return KVCache(batch, self.kv_heads, self.head_dim, capacity=capacity, dtype=dtype, rope=rope,
                       rotated=rotated, huge_pages=huge_pages)

    def forward(self, x, positions=None, cache=None):
        if x.dim() != 3 or x.shape[2] != self.dim:
            raise ValueError(f"SelfAttention: x shape {tuple(x.shape)}; expected [B, S, {self.dim}]")
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim)
        options = {"causal": self.causal, "window": self.window, "softcap": self.softcap,
                   "chunk_size": self.chunk_size, "backend": self.backend}
        if cache is None:
            positions = torch.arange(s, dtype=torch.long) if positions is None else positions
            out = attention(q, k, v, self.scheme, q_positions=positions, k_positions=positions, **options)
        else:
            if not isinstance(cache, KVCache):
                raise TypeError(f"SelfAttention: cache is {type(cache).__name__}; expected a posenc.KVCache")
            cache.append(k, v, positions)
            out = cache.attend(q, cache.positions[cache.length - s:], None if cache.rotated else self.scheme,
                               **options)
        return self.o_proj(out.reshape(b, s, self.heads * self.head_dim))
