"""posenc inside Hugging Face transformers: ``attn_implementation="posenc"``.

``posenc.hf.register()`` adds posenc's fused attention to transformers' ``AttentionInterface`` and
a mask function of the same name to its ``AttentionMaskInterface``, so that a model made with
``from_pretrained(…, attn_implementation="posenc")`` (or ``from_config``) runs every attention
layer that goes through that interface in posenc's kernel (a model whose attention bypasses it,
such as BLOOM's, is refused): GQA, the model's scale, causal or bidirectional layers, sliding windows,
soft-capping, attention sinks (gpt-oss's ``s_aux``), padded batches (packed into sequences, no
``[S, S]`` mask), prefill and cached decode (``generate()``), and backward. The model rotates its
queries and keys itself; posenc receives them rotated.

What the kernel cannot honour is refused by name: dropout while training, a 4-D mask the model
built itself, ``output_attentions``, a position bias, a layer argument it does not map, a mask
pattern it cannot carry, a static cache. ``register(fallback="sdpa")`` hands those calls to
transformers' ``sdpa`` instead (its mask and attention), and only then; never a layer with sinks."""
import torch

import posenc

NAME = "posenc"
_fallback = None


# The mask patterns the attention reads from its layer (is_causal, sliding_window): transformers'
# own mask functions for them, by qualified name, and intersections of them (and_masks, which a
# sliding window is). Any other part (packed position_ids, a prefix or image overlay, Llama 4's
# chunks) would be lost with no [S, S] mask: it is refused, or given to sdpa's mask and attention
# with register(fallback="sdpa").
_LAYER_PATTERNS = {"causal_mask_function", "bidirectional_mask_function",
                   "sliding_window_overlay.<locals>.inner_mask",
                   "sliding_window_bidirectional_overlay.<locals>.inner_mask"}


def _parts(mask_function):
    """The qualified names of mask_function's parts (and_masks flattened)."""
    name = getattr(mask_function, "__qualname__", repr(mask_function))
    if name != "and_masks.<locals>.and_mask":
        return [name]
    cells = dict(zip(mask_function.__code__.co_freevars, mask_function.__closure__ or ()))
    if "mask_functions" not in cells:
        return [name]
    return [n for part in cells["mask_functions"].cell_contents for n in _parts(part)]


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
    back is None, or the 2-D boolean mask of the keys ``[B, kv_length]`` (True: a token), sliced from
    the right as a sliding layer's cache is."""
    config = kwargs.get("config")
    if config is not None and _model_bypasses_the_interface(config):
        raise ValueError(f"posenc attention: model_type = {config.model_type!r}, whose attention does not go through "
                         "transformers' AttentionInterface; expected a model that supports attention backends")
    parts = [] if mask_function is None else _parts(mask_function)
    pattern = next((n for n in parts if n not in _LAYER_PATTERNS), None)
    # A causal layer's keys end where its queries do: a StaticCache's slots past the written ones
    # hold no key. (A bidirectional one's may be another sequence's: an encoder's, for cross-attention.)
    written = int(q_offset) + q_length - int(kv_offset)
    if pattern is None and "causal_mask_function" in parts and written != kv_length:
        pattern = (f"kv_length = {kv_length} cache slots for keys written up to slot {written} (a static cache); "
                   "expected the keys to end with the queries (a dynamic cache)")
    elif pattern is not None:
        pattern = (f"mask_function = {pattern}; expected transformers' causal, sliding-window or bidirectional "
                   "pattern (packed position_ids, overlays and chunked layers are not supported)")
    if pattern is not None:
        if _fallback is not None:
            from transformers.masking_utils import sdpa_mask
            # Always a 4-D mask (never sdpa's None for "causal"): the attention then hands the call on.
            return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                             **{**kwargs, "allow_is_causal_skip": False})
        raise ValueError(f"posenc attention: {pattern}; register(fallback='sdpa') hands such calls to sdpa")
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        return attention_mask  # a 4-D mask the model made: the attention refuses it by name
    keys = attention_mask[:, -kv_length:].bool()
    if keys.shape[1] == kv_length and bool(keys.all()):
        return None
    return keys


def _refuse(what, module, query, key, value, attention_mask, **kwargs):
    if _fallback is not None and kwargs.get("s_aux") is None:
        return _fallback(module, query, key, value, attention_mask, **kwargs)
    hint = ("sdpa has no attention sinks" if _fallback is not None else
            "register(fallback='sdpa') hands such calls to sdpa")
    raise ValueError(f"posenc attention: {what}; {hint}")


# Arguments a layer may pass that need nothing from the kernel (None or False), beside the named ones.
_IGNORED = {"position_ids", "cache_position", "use_cache", "output_attentions", "layer_idx", "token_type_ids"}


def _layer_window(module):
    """The sliding window that the model's config gives the layer (config.layer_types), or None."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if types is None or layer is None or layer >= len(types) or types[layer] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None)


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
    if position_bias is not None:
        return _refuse("a position_bias tensor (T5's buckets); expected none", module, query, key, value,
                       attention_mask, **args)
    if attention_mask is not None and attention_mask.dim() != 2:
        return _refuse(f"a 4-D mask of shape {tuple(attention_mask.shape)}; expected None or the [B, Sk] key "
                       "mask of posenc's mask function (attn_implementation='posenc' on the model, not on the layer)",
                       module, query, key, value, attention_mask, **args)
    # A sliding layer (config.layer_types) must pass its window: its mask has it, the kernel reads this.
    expected = _layer_window(module)
    if expected is not None and sliding_window != expected:
        return _refuse(f"sliding_window = {sliding_window} on layer {module.layer_idx}, a sliding-window layer of "
                       f"config.sliding_window = {expected}; expected the layer to pass it", module, query, key,
                       value, attention_mask, **args)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if sliding_window and not causal:
        return _refuse(f"sliding_window = {sliding_window} on a bidirectional layer; expected it on causal ones",
                       module, query, key, value, attention_mask, **args)
    # transformers' sliding window W lets query i see keys j with i - W < j <= i: W - 1 before it.
    window = (int(sliding_window) - 1, 0) if sliding_window else (-1, -1)
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    options = dict(causal=bool(causal), window=window, softcap=float(softcap or 0.0), scale=scaling,
                   sinks=s_aux)
    if attention_mask is None:
        out = posenc.attention(query, key, value, layout="bhsd", **options)
        return out.transpose(1, 2), None
    if attention_mask.shape != (batch, kv_len):
        return _refuse(f"a key mask of shape {tuple(attention_mask.shape)}; expected [{batch}, {kv_len}] (one entry "
                       "per key: a mask from posenc's mask function)", module, query, key, value, attention_mask,
                       **args)
    # Padding: each row's tokens packed into one sequence. A causal layer's queries are the last
    # q_len entries of its keys (bottom-right, as transformers aligns them), and a query slot whose
    # key is padding stays zero; a bidirectional layer's (an encoder's, cross-attention's) are all
    # kept, whatever the keys' length.
    if causal and q_len > kv_len:
        return _refuse(f"q_len = {q_len} queries over kv_len = {kv_len} keys on a causal layer; expected "
                       "q_len <= kv_len", module, query, key, value, attention_mask, **args)
    q_keep = attention_mask[:, kv_len - q_len:] if causal else torch.ones(batch, q_len, dtype=torch.bool)
    lengths_q, lengths_k = q_keep.sum(1), attention_mask.sum(1)
    if sliding_window:
        # Packed, a row's tokens are one run: a gap inside it would shorten the distances that
        # transformers' window measures in cache slots.
        slots = torch.arange(kv_len)
        first = attention_mask.int().argmax(1, keepdim=True)
        if not torch.equal(attention_mask, (slots >= first) & (slots < first + lengths_k[:, None])):
            return _refuse(f"sliding_window = {sliding_window} with padding inside a row; expected padding at its "
                           "start or end", module, query, key, value, attention_mask, **args)
    zero = torch.zeros(1, dtype=torch.long)
    cu_q = torch.cat([zero, lengths_q.cumsum(0)])
    cu_k = torch.cat([zero, lengths_k.cumsum(0)])
    packed = posenc.attention(_pack(query, q_keep), _pack(key, attention_mask), _pack(value, attention_mask),
                              cu_seqlens=(cu_q, cu_k), **options)
    out = query.new_zeros(batch, q_len, query.shape[1], value.shape[-1])
    out[q_keep] = packed
    return out, None


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
