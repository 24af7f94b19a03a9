"""posenc inside Hugging Face transformers: ``attn_implementation="posenc"``.

``posenc.hf.register()`` adds posenc's fused attention to transformers' ``AttentionInterface`` and
a mask function of the same name to its ``AttentionMaskInterface``, so that a model made with
``from_pretrained(…, attn_implementation="posenc")`` (or ``from_config``) runs every attention
layer that goes through that interface in posenc's kernel (a model whose attention bypasses it,
such as BLOOM's, is refused): GQA, the model's scale, causal or bidirectional layers, sliding windows,
Llama 4's chunks, soft-capping, attention sinks (gpt-oss's ``s_aux``), padded batches and packed
sequences (position_ids that restart) as the kernel's sequences with no ``[S, S]`` mask, prefill and
cached decode (``generate()``, dynamic or static caches), and backward. The model rotates its
queries and keys itself; posenc receives them rotated.

What the kernel cannot honour is refused by name: dropout while training, a 4-D mask the model
built itself, ``output_attentions``, a position bias, a layer argument it does not map, a mask
pattern it cannot carry. ``register(fallback="sdpa")`` hands those calls to
transformers' ``sdpa`` instead (its mask and attention), and only then; never a layer with sinks.

``posenc.hf.patch(model)`` moves the model's positional scheme into the kernel too, with the
model's own parameters: T5's bucket table, BLOOM's ALiBi slopes, or a RoPE model's rotation from
its config (exact fp64 angles)."""
import sys
import types
import weakref

import torch

import posenc

NAME = "posenc"
_fallback = None
_patched = weakref.WeakValueDictionary()  # id(config) -> config of a patched model's layers


# The mask patterns the attention reads from its layer (is_causal, sliding_window): transformers'
# own mask functions for them, by qualified name, and intersections of them (and_masks, which a
# sliding window is). Llama 4's chunks and packed sequences (position_ids that restart, which
# transformers folds into the mask function) are carried by the keys' positions and sequences
# (_key_layout). Any other part (a prefix or image overlay) would be lost with no [S, S] mask: it is
# refused, or given to sdpa's mask and attention with register(fallback="sdpa").
_CHUNKS = "chunked_overlay.<locals>.inner_mask"
_REMAP = "remap_positions_for_packed_sequence.<locals>.inner_mask"
_SAME_SEQUENCE = "packed_sequence_mask_function.<locals>.inner_mask"
_LAYER_PATTERNS = {"causal_mask_function", "bidirectional_mask_function",
                   "sliding_window_overlay.<locals>.inner_mask",
                   "sliding_window_bidirectional_overlay.<locals>.inner_mask", _CHUNKS, _REMAP, _SAME_SEQUENCE}


def _cells(function):
    return dict(zip(function.__code__.co_freevars, (c.cell_contents for c in function.__closure__ or ())))


def _functions(mask_function):
    """mask_function's parts (and_masks flattened, and the pattern inside packed sequences' remap)."""
    name = getattr(mask_function, "__qualname__", None)
    if name == _REMAP and "mask_function" in _cells(mask_function):
        return [mask_function] + _functions(_cells(mask_function)["mask_function"])
    if name != "and_masks.<locals>.and_mask":
        return [mask_function]
    parts = _cells(mask_function).get("mask_functions")
    return [mask_function] if parts is None else [f for part in parts for f in _functions(part)]


def _parts(mask_function):
    """The qualified names of mask_function's parts (and_masks flattened)."""
    return [getattr(f, "__qualname__", repr(f)) for f in _functions(mask_function)]


def _model_bypasses_the_interface(config):
    """True where the model of config runs its own attention, its modeling module never looking
    into transformers' AttentionInterface (BLOOM, MPT, Falcon): it would read posenc's None as no
    mask at all."""
    import sys

    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING
        model_class = MODEL_MAPPING[type(config)]
    except (ImportError, KeyError):
        return False
    return not hasattr(sys.modules[model_class.__module__], "ALL_ATTENTION_FUNCTIONS")


def _key_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
              **kwargs):
    """The mask interface's entry for posenc: no ``[S, S]`` mask. The causal and sliding-window
    patterns are the layer's (the attention reads them from its module and arguments); what comes
    back is None, or the 2-D boolean mask of the keys ``[B, Sk]`` (True: a token), sliced from the
    right as a sliding layer's cache is, or the keys' layout of a chunked layer or of packed
    sequences (``_key_layout``).
    A static cache's slots past the written keys are no keys: the mask then covers the written
    ones only, and the attention reads no further."""
    config = kwargs.get("config")
    if config is not None and _patched.get(id(config)) is not config and _model_bypasses_the_interface(config):
        raise ValueError(f"posenc attention: model_type = {config.model_type!r}, whose attention does not go through "
                         "transformers' AttentionInterface; expected a model that supports attention backends")
    parts = [] if mask_function is None else _parts(mask_function)
    pattern = next((n for n in parts if n not in _LAYER_PATTERNS), None)
    # A causal layer's keys end where its queries do; a static cache's (preallocated) slots past
    # the written ones hold none, and it has dropped no key before them (kv_offset 0). (A
    # bidirectional layer's keys may be another sequence's: an encoder's, for cross-attention.)
    written = int(q_offset) + q_length - int(kv_offset)
    static = pattern is None and "causal_mask_function" in parts and written != kv_length
    if static and (written > kv_length or int(kv_offset) != 0):
        pattern = (f"kv_length = {kv_length} cache slots from slot {kv_offset} for keys written up to slot "
                   f"{int(q_offset) + q_length}; expected the keys to end with the queries, or a static cache's "
                   "written keys from slot 0")
    elif pattern is not None:
        pattern = (f"mask_function = {pattern}; expected transformers' causal, sliding-window, chunked or "
                   "bidirectional pattern, or packed sequences of them (overlays are not supported)")
    elif (_REMAP in parts) != (_SAME_SEQUENCE in parts) or (_REMAP in parts and "causal_mask_function" not in parts):
        pattern = (f"mask_function of parts {', '.join(parts)}; expected packed sequences with both their "
                   "position remap and their sequence mask, over a causal pattern (transformers' packing)")
    if pattern is not None:
        if _fallback is not None:
            from transformers.masking_utils import sdpa_mask
            # Always a 4-D mask (never sdpa's None for "causal"): the attention then hands the call on.
            return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                             **{**kwargs, "allow_is_causal_skip": False})
        raise ValueError(f"posenc attention: {pattern}; register(fallback='sdpa') hands such calls to sdpa")
    if attention_mask is not None and attention_mask.dim() != 2:
        return attention_mask  # a 4-D mask the model made: the attention refuses it by name
    if static:
        kv_length = written
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, written, dtype=torch.bool, device=kwargs.get("device"))
        attention_mask = attention_mask[:, :written]
    if _CHUNKS in parts or _REMAP in parts:
        return _key_layout(mask_function, batch_size, kv_length, kv_offset, attention_mask)
    if attention_mask is None:
        return None
    keys = attention_mask[:, -kv_length:].bool()
    if keys.shape[1] == kv_length and bool(keys.all()) and not static:
        return None
    return keys


def _key_layout(mask_function, batch_size, kv_length, kv_offset, attention_mask):
    """The keys' layout ``[B, 2, kv_length]`` (int64) of a chunked layer or of packed sequences:
    each key's position (-1 at padding) and its sequence within the row. transformers' chunks are
    ⌊(position − left padding) / C⌋ with cache slots for positions (a chunked layer's cache drops
    keys older than its chunk, so the first slot is kv_offset), or position_ids when sequences are
    packed (a sequence starts where they do not go up by one); the kernel's chunk rule is the same
    division of the positions it is given."""
    functions = {f.__qualname__: f for f in _functions(mask_function) if hasattr(f, "__qualname__")}
    slots = torch.arange(int(kv_offset), int(kv_offset) + kv_length)
    positions = slots.expand(batch_size, kv_length)
    sequences = torch.zeros(batch_size, kv_length, dtype=torch.long)
    if _REMAP in functions:
        # No cache: queries and keys are the same kv_length tokens (transformers packs only then).
        positions = _cells(functions[_REMAP])["position_ids"].expand(batch_size, -1)
        sequences = _cells(functions[_SAME_SEQUENCE])["packed_sequence_mask"].expand(batch_size, -1)
        if positions.shape[1] != kv_length or sequences.shape[1] != kv_length:
            raise ValueError(f"posenc attention: packed sequences over {positions.shape[1]} positions for kv_length = "
                             f"{kv_length} keys; expected one position per key (no cache)")
    if _CHUNKS in functions:
        left = _cells(functions[_CHUNKS])["left_padding"]
        positions = positions.to(left.device) - left.reshape(-1, 1).to(torch.long)
    positions = positions.to(torch.long).clone()
    if attention_mask is not None:
        positions[~attention_mask[:, -kv_length:].bool()] = -1
    return torch.stack([positions, sequences.to(positions.device, torch.long)], dim=1)


def _refuse(what, module, query, key, value, attention_mask, **kwargs):
    # A patched layer's queries and keys are not rotated, and its bias is no tensor: sdpa would
    # attend without positions.
    patched = isinstance(kwargs.get("position_bias"), _FusedBias) or getattr(module, "_posenc_scheme", None)
    if _fallback is not None and kwargs.get("s_aux") is None and not patched:
        return _fallback(module, query, key, value, attention_mask, **kwargs)
    hint = ("register(fallback='sdpa') hands such calls to sdpa" if _fallback is None else
            "sdpa has no attention sinks" if kwargs.get("s_aux") is not None else
            "sdpa cannot run a patched layer, whose positions posenc applies")
    raise ValueError(f"posenc attention: {what}; {hint}")


class _FusedBias:
    """What a patched T5 layer's compute_bias returns in place of its [1, H, Sq, Sk] bias: the
    scheme (its table the model's own parameter), which the model hands from layer to layer."""

    def __init__(self, scheme):
        self.scheme = scheme


# Arguments a layer may pass that need nothing from the kernel (None or False), beside the named ones.
_IGNORED = {"position_ids", "cache_position", "use_cache", "output_attentions", "layer_idx", "token_type_ids"}


def _layer_value(module, layer_type, field):
    """config.<field> when config.layer_types gives the module's layer layer_type, else None: a
    sliding layer's window, a chunked layer's chunk size (Llama 4)."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if types is None or layer is None or layer >= len(types) or types[layer] != layer_type:
        return None
    return getattr(config, field, None)


def _pack(x, keep):
    """[B, H, S, D] rows where keep [B, S] is True, as packed [T, H, D] (batch-major)."""
    return x.transpose(1, 2)[keep]


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, s_aux=None, position_bias=None, **kwargs):
    """transformers' attention-function signature: query ``[B, H, Sq, D]``, key and value
    ``[B, G, Sk, D]`` (rotated, cached); returns ``(out [B, Sq, H, D], None)``."""
    args = dict(dropout=dropout, scaling=scaling, is_causal=is_causal, sliding_window=sliding_window,
                softcap=softcap, s_aux=s_aux, position_bias=position_bias, **kwargs)
    unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED and v is not None and v is not False)
    if unknown:
        return _refuse(f"the layer's argument {unknown[0]} = {kwargs[unknown[0]]!r:.60}; expected only those posenc "
                       "maps (scaling, is_causal, sliding_window, softcap, s_aux)", module, query, key, value,
                       attention_mask, **args)
    if dropout and module.training:
        return _refuse(f"dropout = {dropout} while training; expected 0 (the kernel has no dropout)", module, query,
                       key, value, attention_mask, **args)
    if kwargs.get("output_attentions"):
        return _refuse("output_attentions = True; expected False (no [S, S] probabilities are formed)", module,
                       query, key, value, attention_mask, **args)
    fused = position_bias if isinstance(position_bias, _FusedBias) else None
    # A zero tensor is transformers' stand-in on layers without a relative bias (T5's cross-attention).
    if position_bias is not None and fused is None and (not torch.is_tensor(position_bias) or position_bias.any()):
        return _refuse("a position_bias tensor (T5's buckets, materialised); expected none, or the model patched "
                       "(posenc.hf.patch) so that its bias runs inside the kernel", module, query, key, value,
                       attention_mask, **args)
    # A chunked layer's mask is its keys' layout (positions and sequences), from posenc's mask function.
    chunk = _layer_value(module, "chunked_attention", "attention_chunk_size")
    layout = attention_mask is not None and attention_mask.dim() == 3 and attention_mask.dtype == torch.long
    if chunk is not None and not layout:
        return _refuse(f"layer {module.layer_idx}, a chunked layer of config.attention_chunk_size = {chunk}, without "
                       "its keys' positions; expected the int64 [B, 2, Sk] layout of posenc's mask function", module,
                       query, key, value, attention_mask, **args)
    if attention_mask is not None and attention_mask.dim() != 2 and not layout:
        return _refuse(f"a 4-D mask of shape {tuple(attention_mask.shape)}; expected None or the [B, Sk] key "
                       "mask of posenc's mask function (attn_implementation='posenc' on the model, not on the layer)",
                       module, query, key, value, attention_mask, **args)
    # A sliding layer (config.layer_types) must pass its window: its mask has it, the kernel reads this.
    expected = _layer_value(module, "sliding_attention", "sliding_window")
    if expected is not None and sliding_window != expected:
        return _refuse(f"sliding_window = {sliding_window} on layer {module.layer_idx}, a sliding-window layer of "
                       f"config.sliding_window = {expected}; expected the layer to pass it", module, query, key,
                       value, attention_mask, **args)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if layout and not causal:
        return _refuse("a chunked or packed layout of keys on a bidirectional layer; expected it on causal ones",
                       module, query, key, value, attention_mask, **args)
    # The keys the mask covers: a static cache's written slots (the rest hold no key).
    keys = None if attention_mask is None else attention_mask[:, 0] >= 0 if layout else attention_mask
    if keys is not None and causal and 0 < keys.shape[1] < key.shape[2]:
        key, value = key[:, :, :keys.shape[1]], value[:, :, :keys.shape[1]]
    if sliding_window and not causal:
        return _refuse(f"sliding_window = {sliding_window} on a bidirectional layer; expected it on causal ones",
                       module, query, key, value, attention_mask, **args)
    # transformers' sliding window W lets query i see keys j with i - W < j <= i: W - 1 before it.
    window = (int(sliding_window) - 1, 0) if sliding_window else (-1, -1)
    options = dict(causal=bool(causal), window=window, softcap=float(softcap or 0.0), scale=scaling,
                   sinks=s_aux, chunk_size=chunk)
    scheme = fused.scheme if fused is not None else getattr(module, "_posenc_scheme", None)
    if scheme is not None:
        options["scheme"] = scheme
        if isinstance(scheme, posenc.RotaryPositionalEncoding):
            bad = _length_rule_differs(scheme, query, key, keys, kwargs.get("cache_position"))
            if not bad and layout and bool((attention_mask[:, 1] != 0).any()) and \
                    scheme.scaling.get("rope_type") in ("longrope", "dynamic"):
                bad = (f"a {scheme.scaling['rope_type']} RoPE over packed sequences; expected one sequence per row "
                       "(transformers chooses its frequencies by the row's length)")
            if bad:
                return _refuse(bad, module, query, key, value, attention_mask, **args)
    if keys is not None and keys.shape != (query.shape[0], key.shape[2]):
        return _refuse(f"a key mask of shape {tuple(keys.shape)}; expected [{query.shape[0]}, "
                       f"{key.shape[2]}] (one entry per key: a mask from posenc's mask function)", module, query, key,
                       value, attention_mask, **args)
    # A positional term measures distances in packed positions: a gap inside a row would shorten
    # them where the model counts cache slots (BLOOM alone counts tokens, as packing does).
    measures_slots = bool(sliding_window) or (scheme is not None and not getattr(module, "_posenc_counts_tokens",
                                                                                 False))
    try:
        return _attend(query, key, value, attention_mask, options, self_attention=scheme is not None,
                       contiguous=measures_slots), None
    except _Refused as e:
        return _refuse(str(e), module, query, key, value, attention_mask, **args)


class _Refused(Exception):
    pass


def _attend(query, key, value, key_mask, options, self_attention=False, contiguous=False):
    """posenc.attention on transformers' [B, H, S, D] query and [B, G, S, D] keys and values, with
    key_mask None or [B, Sk] (True: a token); returns [B, Sq, H, D].

    Padding: each row's tokens packed into one sequence. A causal layer's queries (and a
    self-attention layer's, whose queries are its last keys) are the last Sq entries of its keys
    (bottom-right, as transformers aligns them), and a query slot whose key is padding stays zero;
    any other bidirectional layer's (an encoder's without positions, cross-attention's) are all
    kept, whatever the keys' length. ``contiguous``: a row's tokens must be one run. An int64
    ``[B, 2, Sk]`` key_mask is the keys' layout (``_key_layout``): the kernel gets their positions,
    and a row holds as many sequences as it names."""
    options = dict(options)
    scheme = options.pop("scheme", None)
    layout = None
    if key_mask is not None and key_mask.dtype == torch.long:
        layout, key_mask = key_mask, key_mask[:, 0] >= 0
    if key_mask is None:
        out = posenc.attention(query, key, value, scheme, layout="bhsd", **options)
        return out.transpose(1, 2)
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    causal = options["causal"]
    if (causal or self_attention) and q_len > kv_len:
        raise _Refused(f"q_len = {q_len} queries over kv_len = {kv_len} keys on a "
                       f"{'causal' if causal else 'self-attention'} layer; expected q_len <= kv_len")
    if causal or self_attention:
        q_keep = key_mask[:, kv_len - q_len:]
    else:
        q_keep = torch.ones(batch, q_len, dtype=torch.bool, device=key_mask.device)
    lengths_q, lengths_k = q_keep.sum(1), key_mask.sum(1)
    if contiguous:
        slots = torch.arange(kv_len, device=key_mask.device)
        first = key_mask.int().argmax(1, keepdim=True)
        if not torch.equal(key_mask, (slots >= first) & (slots < first + lengths_k[:, None])):
            what = (f"sliding_window = {options['window'][0] + 1}" if options["window"][0] >= 0 else
                    "a positional term the model measures in cache slots")
            raise _Refused(f"{what} with padding inside a row; expected padding at its start or end")
    if layout is not None:
        # Sequences in row-major order: a query's sequence is its own key's (q_keep is key_mask there).
        ids = layout[:, 1] + torch.arange(batch, device=layout.device)[:, None] * (kv_len + 1)
        groups, lengths_k = torch.unique_consecutive(ids[key_mask], return_counts=True)
        lengths_q = torch.bincount(torch.searchsorted(groups, ids[:, kv_len - q_len:][q_keep]),
                                   minlength=groups.numel())
        options["q_positions"] = layout[:, 0, kv_len - q_len:][q_keep]
        options["k_positions"] = layout[:, 0][key_mask]
    zero = torch.zeros(1, dtype=torch.long, device=key_mask.device)
    cu_q = torch.cat([zero, lengths_q.cumsum(0)])
    cu_k = torch.cat([zero, lengths_k.cumsum(0)])
    packed = posenc.attention(_pack(query, q_keep), _pack(key, key_mask), _pack(value, key_mask), scheme,
                              cu_seqlens=(cu_q, cu_k), **options)
    out = query.new_zeros(batch, q_len, query.shape[1], value.shape[-1])
    out[q_keep] = packed
    return out


def register(fallback=None):
    """Adds ``"posenc"`` to transformers' attention and mask interfaces (idempotent). ``fallback``:
    None (refuse what the kernel cannot honour) or ``"sdpa"``."""
    global _fallback
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if fallback not in (None, "sdpa"):
        raise ValueError(f"posenc.hf.register: fallback = {fallback!r}; expected None or 'sdpa'")
    _fallback = None if fallback is None else ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, _key_mask)


def _length_rule_differs(rope, query, key, key_mask, cache_position):
    """A reason to refuse, or None: LongRoPE and dynamic NTK choose their frequencies by the
    sequence's length, transformers by the model's (the last cache position + 1, padding
    included), the kernel by each packed sequence's keys. Where the two could choose differently
    (padding, or a sliding cache that dropped keys, across the threshold), the call is refused."""
    kind = rope.scaling.get("rope_type")
    if kind not in ("longrope", "dynamic"):
        return None
    model_length = int(cache_position[-1]) + 1 if cache_position is not None and len(cache_position) else key.shape[2]
    lengths = key_mask.sum(1).tolist() if key_mask is not None else [key.shape[2]]
    if kind == "longrope":
        threshold = rope.scaling["original_max_position_embeddings"]
        differs = any((n > threshold) != (model_length > threshold) for n in lengths)
    else:
        threshold = rope.max_position_embeddings
        differs = any(max(n, threshold) != max(model_length, threshold) for n in lengths)
    if not differs:
        return None
    return (f"a {kind} RoPE over sequences of {min(lengths)}..{max(lengths)} keys where the model's length is "
            f"{model_length}: the two choose different frequencies across {threshold}; expected every "
            "sequence on the model's side of it")


# Model types whose rotation posenc.hf.patch moves into the kernel: the conformance suite checks
# from_hf_config against each one's rotary embedding and the patched logits against eager.
_ROPE_MODEL_TYPES = ("gemma3_text", "gemma4_text", "gpt_neox", "gpt_oss", "llama", "llama4_text", "mistral", "phi3",
                     "qwen2", "qwen3", "smollm3")


class _T5Bias:
    """compute_bias of a patched T5 stack's first layer: the scheme instead of the tensor."""

    def __init__(self, scheme):
        self.scheme = scheme

    def __call__(self, query_length, key_length, device=None, past_seen_tokens=0):
        return _FusedBias(self.scheme)


def _patch_t5(model):
    for stack in (getattr(model, "encoder", None), getattr(model, "decoder", None)):
        if stack is None:
            continue
        first = stack.block[0].layer[0].SelfAttention
        scheme = posenc.T5RelativeBias(first.n_heads, first.relative_attention_num_buckets,
                                       first.relative_attention_max_distance, bidirectional=not first.is_decoder)
        scheme.table = first.relative_attention_bias.weight  # the model's parameter: it trains
        first.compute_bias = _T5Bias(scheme)


def _bloom_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                   output_attentions=False, **kwargs):
    """BloomAttention's forward with ALiBi inside posenc's kernel (the model's alibi tensor unused)."""
    batch, length, _ = hidden_states.shape
    qkv = self.query_key_value(hidden_states).view(batch, length, self.num_heads, 3, self.head_dim)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    out, _ = attention_forward(self, q, k, v, attention_mask, dropout=self.attention_dropout.p,
                               scaling=self.inv_norm_factor, is_causal=True, output_attentions=output_attentions)
    out = self.dense(out.reshape(batch, length, -1))
    return sys.modules[type(self).__module__].dropout_add(out, residual, self.hidden_dropout, self.training), None


def _alibi_scheme(slopes):
    scheme = posenc.ALiBi(slopes.numel())
    scheme.slopes = slopes.detach().to(torch.float32).clone()
    return scheme


def _patch_bloom(model):
    module = sys.modules[type(model).__module__]
    for layer in model.modules():
        if type(layer).__name__ == "BloomAttention":
            # BLOOM's own slopes. Its bias slope·(tokens before the key) differs from posenc's
            # -slope·(i - j) by a constant per query, which the softmax removes; it counts tokens
            # (padding skipped), as packed positions do.
            layer.__dict__["_posenc_scheme"] = _alibi_scheme(module._get_alibi_slopes(layer.num_heads, "cpu"))
            layer.__dict__["_posenc_counts_tokens"] = True
            layer.forward = types.MethodType(_bloom_forward, layer)


class _LearnedPositions:
    """What a patched GPT-2's ``wpe(position_ids)`` returns: the model's next step,
    ``inputs_embeds + position_embeds.to(device)``, lands in ``__radd__``, where posenc's ``learned``
    kernel adds the table's rows (x + table[p], one rounding, as eager's add) and its backward
    accumulates the table's gradient."""

    def __init__(self, table, positions):
        self.table = table
        self.positions = positions

    def to(self, *args, **kwargs):
        return self

    def __radd__(self, x):
        if not isinstance(x, torch.Tensor):
            return NotImplemented
        if x.device.type != "cpu" or self.table.device.type != "cpu":
            raise ValueError(f"posenc.hf.patch: GPT-2's learned positions run on posenc's CPU kernel; the "
                             f"embeddings are on {x.device.type} and the table on {self.table.device.type} "
                             "(patch a model on the CPU)")
        positions = self.positions
        if positions.dim() == 2 and positions.shape[0] == 1:
            positions = positions[0]  # shared by the batch
        return posenc.learned(self.table, x, positions)


def _learned_lookup(self, position_ids):
    """A patched GPT-2 ``wpe``: the lookup deferred to the add (``_LearnedPositions``)."""
    return _LearnedPositions(self.weight, position_ids)


def _patch_gpt2(model):
    wpe = model.transformer.wpe if hasattr(model, "transformer") else model.wpe
    wpe.forward = types.MethodType(_learned_lookup, wpe)


def _identity_rotation(self, *args, **kwargs):
    """A patched rotary embedding: cos = 1, sin = 0, so that the model's rotation is the identity
    and its cache keeps keys unrotated; posenc rotates q and k inside the kernel."""
    out = type(self).forward(self, *args, **kwargs)
    if torch.is_tensor(out) and out.is_complex():
        return torch.ones_like(out)  # Llama 4's freqs_cis: pairs times 1 + 0i
    cos, sin = out
    return torch.ones_like(cos), torch.zeros_like(sin)


def _patch_rope(model):
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    fields = config.to_dict()
    rotates = getattr(config, "no_rope_layers", None)  # SmolLM3: 1 where a layer rotates
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(_identity_rotation, module)
        elif type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
            layer = module.layer_idx
            rope = None if rotates is not None and not rotates[layer] else \
                posenc.RotaryPositionalEncoding.from_hf_config(fields, layer)
            module.__dict__["_posenc_scheme"] = rope


def patch(model):
    """Runs the model's positional scheme inside posenc's kernel, with the model's own parameters,
    and its attention through posenc (``attn_implementation="posenc"``); returns the model.

    - T5: the relative buckets, its table the model's parameter (trained with it); no [H, S, S] bias.
    - BLOOM: ALiBi with the model's slopes, instead of the materialised bias.
    - GPT-2: its learned positions added by posenc's ``learned`` kernel from the model's table
      (``wpe.weight``, trained with it); CPU only.
    - RoPE models (model_type in ``_ROPE_MODEL_TYPES``): the rotation taken out of the model (its
      rotary embedding gives the identity) and done in the kernel from the model's config
      (``RotaryPositionalEncoding.from_hf_config``, exact fp64 angles); the cache holds unrotated keys.

    Other models are refused by name. Patch before caching: a cache filled before holds keys
    rotated by the model."""
    from transformers import PretrainedConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if model.__dict__.get("_posenc_patched"):
        return model
    kind = getattr(model.config, "model_type", None)
    if kind == "t5":
        _patch_t5(model)
    elif kind == "bloom":
        _patch_bloom(model)
    elif kind == "gpt2":
        _patch_gpt2(model)
    elif kind in _ROPE_MODEL_TYPES:
        _patch_rope(model)
    else:
        # MPT builds its 4-D mask whatever the attention (create_causal_mask(...).to(bool)), so
        # its patch would keep the [S, S] mask: not offered.
        raise ValueError(f"posenc.hf.patch: model_type = {kind!r}; expected t5, bloom, gpt2 or a RoPE model of "
                         f"{', '.join(_ROPE_MODEL_TYPES)}")
    if NAME not in ALL_ATTENTION_FUNCTIONS:
        register()
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig) and _patched.get(id(config)) is not config:
            config._attn_implementation = NAME
            _patched[id(config)] = config
    model.__dict__["_posenc_patched"] = True
    return model
