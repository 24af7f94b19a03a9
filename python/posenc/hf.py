"""posenc inside Hugging Face transformers: ``attn_implementation="posenc"``.

``posenc.hf.register()`` adds posenc's fused attention to transformers' ``AttentionInterface`` and
a mask function of the same name to its ``AttentionMaskInterface``, so that a model made with
``from_pretrained(…, attn_implementation="posenc")`` (or ``from_config``) runs every attention
layer in posenc's kernel: GQA, the model's scale, causal or bidirectional layers, sliding windows,
soft-capping, attention sinks (gpt-oss's ``s_aux``), padded batches (packed into sequences, no
``[S, S]`` mask), prefill and cached decode (``generate()``), and backward. The model rotates its
queries and keys itself; posenc receives them rotated.

What the kernel cannot honour is refused by name: dropout while training, a 4-D mask the model
built itself, ``output_attentions``, a position bias. ``register(fallback="sdpa")`` hands those
calls to transformers' ``sdpa`` instead, and only then."""
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


def _foreign_pattern(mask_function):
    """The qualified name of a part of mask_function that is not a layer pattern, or None."""
    name = getattr(mask_function, "__qualname__", repr(mask_function))
    if name == "and_masks.<locals>.and_mask":
        cells = dict(zip(mask_function.__code__.co_freevars, mask_function.__closure__ or ()))
        parts = cells["mask_functions"].cell_contents if "mask_functions" in cells else None
        if parts is None:
            return name
        return next((n for n in map(_foreign_pattern, parts) if n is not None), None)
    return None if name in _LAYER_PATTERNS else name


def _key_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
              **kwargs):
    """The mask interface's entry for posenc: no ``[S, S]`` mask. The causal and sliding-window
    patterns are the layer's (the attention reads them from its module and arguments); what comes
    back is None, or the 2-D boolean mask of the keys ``[B, kv_length]`` (True: a token), sliced from
    the right as a sliding layer's cache is."""
    pattern = None if mask_function is None else _foreign_pattern(mask_function)
    if pattern is not None:
        if _fallback is not None:
            from transformers.masking_utils import sdpa_mask
            return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                             **kwargs)
        raise ValueError(f"posenc attention: the mask pattern {pattern}; expected transformers' causal, "
                         "sliding-window or bidirectional one (packed position_ids, overlays and chunked layers are "
                         "not supported); register(fallback='sdpa') hands such calls to sdpa")
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        return attention_mask  # a 4-D mask the model made: the attention refuses it by name
    keys = attention_mask[:, -kv_length:].bool()
    if keys.shape[1] == kv_length and bool(keys.all()):
        return None
    return keys


def _refuse(what, module, query, key, value, attention_mask, **kwargs):
    if _fallback is not None:
        return _fallback(module, query, key, value, attention_mask, **kwargs)
    raise ValueError(f"posenc attention: {what}; register(fallback='sdpa') hands such calls to sdpa")


def _pack(x, keep):
    """[B, H, S, D] rows where keep [B, S] is True, as packed [T, H, D] (batch-major)."""
    return x.transpose(1, 2)[keep]


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, s_aux=None, position_bias=None, **kwargs):
    """transformers' attention-function signature: query ``[B, H, Sq, D]``, key and value
    ``[B, G, Sk, D]`` (rotated, cached); returns ``(out [B, Sq, H, D], None)``."""
    args = dict(dropout=dropout, scaling=scaling, is_causal=is_causal, sliding_window=sliding_window,
                softcap=softcap, s_aux=s_aux, position_bias=position_bias, **kwargs)
    if dropout and module.training:
        return _refuse(f"dropout = {dropout} while training; expected 0 (the kernel has no dropout)", module, query,
                       key, value, attention_mask, **args)
    if kwargs.get("output_attentions"):
        return _refuse("output_attentions = True; expected False (no [S, S] probabilities are formed)", module,
                       query, key, value, attention_mask, **args)
    if position_bias is not None:
        return _refuse("a position_bias tensor; expected none (posenc.hf.patch runs a model's bias in the kernel)",
                       module, query, key, value, attention_mask, **args)
    if attention_mask is not None and attention_mask.dim() != 2:
        return _refuse(f"an attention mask of shape {tuple(attention_mask.shape)}; expected None or the [B, Sk] key "
                       "mask of posenc's mask function (attn_implementation='posenc' on the model, not on the layer)",
                       module, query, key, value, attention_mask, **args)
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
        return _refuse(f"a key mask of shape {tuple(attention_mask.shape)}; expected [{batch}, {kv_len}]", module,
                       query, key, value, attention_mask, **args)
    # Padding: each row's tokens packed into one sequence. Its queries are the last q_len entries of
    # its keys (bottom-right, as transformers aligns them); a query slot whose key is padding
    # stays zero.
    q_keep = attention_mask[:, kv_len - q_len:] if q_len <= kv_len else None
    if q_keep is None:
        return _refuse(f"q_len = {q_len} > kv_len = {kv_len}", module, query, key, value, attention_mask, **args)
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
