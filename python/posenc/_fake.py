"""Fake kernels of posenc's ops: the shapes, dtypes and strides of their outputs, computed without
data. torch.compile and torch.library.opcheck run them while they trace; each mirrors what its C++
kernel (torch/*.cpp) allocates. The typed arguments (torch.classes.posenc.Scheme, Temperature,
Rope) reach them as the objects themselves."""
import torch


def _contiguous_like(t):
    return t.new_empty(t.shape)


def _row_dim(format, row_bytes):
    """The values a quantized row of row_bytes holds (posenc::cache_row_dim)."""
    return {"q8_0": row_bytes // 34 * 32, "q4_0": row_bytes // 18 * 32}.get(format, row_bytes - 4)


@torch.library.register_fake("posenc::attention")
def _attention(q, k, v, schemes, params, gates, sinks, causal, window_left, window_right, chunk_size, temperature,
               softcap, scale, q_positions, k_positions, cu_seqlens_q=(), cu_seqlens_k=(), skip_vanishing_tiles=True,
               kv_format=None):
    # out like q with v's head size (MLA; a quantized cache's rows hold it); lse float32 [B, H, Sq],
    # or [H, Tq] for packed sequences.
    value_dim = v.shape[-1] if kv_format is None else _row_dim(kv_format, v.shape[-1])
    out = q.new_empty((*q.shape[:-1], value_dim))
    lse_shape = (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.register_fake("posenc::attention_planned")
def _attention_planned(q, k, v, objects, params, gates, sinks, causal, window_left, window_right, chunk_size, softcap,
                       scale, q_positions, k_positions, cu_seqlens_q, cu_seqlens_k, skip_vanishing_tiles):
    out, lse = _attention(q, k, v, None, params, gates, sinks, causal, window_left, window_right, chunk_size, None,
                          softcap, scale, q_positions, k_positions, cu_seqlens_q, cu_seqlens_k, skip_vanishing_tiles)
    return out, lse, q.new_empty(1, dtype=torch.int64)  # the plan: an id, int64 [1]


@torch.library.register_fake("posenc::quantize_kv")
def _quantize_kv(x, format):
    d = x.shape[-1]
    row_bytes = {"q8_0": d // 32 * 34, "q4_0": d // 32 * 18}.get(format, d + 4)
    return x.new_empty((*x.shape[:-1], row_bytes), dtype=torch.uint8)


@torch.library.register_fake("posenc::dequantize_kv")
def _dequantize_kv(bytes_, format):
    return bytes_.new_empty((*bytes_.shape[:-1], _row_dim(format, bytes_.shape[-1])), dtype=torch.float32)


@torch.library.register_fake("posenc::attention_grad")
def _attention_grad(plan, q, k, v, params, gates, sinks, out, lse, d_out, d_lse, params_grad, gates_grad,
                    sinks_grad):
    # dq, dk, dv as zeros_like makes them; a wanted gradient contiguous in its input's shape and
    # dtype, an empty one where none is wanted.
    d_params = [_contiguous_like(p) if w else p.new_empty(0) for p, w in zip(params, params_grad)]
    d_gates = [_contiguous_like(g) if w else g.new_empty(0) for g, w in zip(gates, gates_grad)]
    d_sinks = _contiguous_like(sinks) if sinks_grad and sinks is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), d_params, d_gates, d_sinks


@torch.library.register_fake("posenc::sinusoidal_table")
def _sinusoidal_table(positions, dim, base, interleaved, dtype):
    return positions.new_empty((positions.shape[0], dim), dtype=dtype)


def _bias(like, heads, q_positions, k_positions):
    """A materialised bias [B, H, Sq, Sk] in like's dtype (B: 1 for positions [S])."""
    batch = q_positions.shape[0] if q_positions.dim() == 2 else 1
    return like.new_empty((batch, heads, q_positions.shape[-1], k_positions.shape[-1]))


@torch.library.register_fake("posenc::learned")
def _learned(table, x, positions):
    return _contiguous_like(x)


@torch.library.register_fake("posenc::learned_backward")
def _learned_backward(grad, table, positions):
    return _contiguous_like(table)


@torch.library.register_fake("posenc::floater_table")
def _floater_table(w1, b1, w2, b2, p0, length, time_per_position, substeps):
    return p0.new_empty((length, p0.numel()))


@torch.library.register_fake("posenc::floater_table_backward")
def _floater_table_backward(grad, w1, b1, w2, b2, p0, time_per_position, substeps):
    return tuple(_contiguous_like(t) for t in (w1, b1, w2, b2, p0))


def _scores(q, k_len):
    """Scores [B, H, Sq, Sk] for q [B, Sq, H, D] (or [Sq, H, D]: B = 1), in q's dtype."""
    batch = q.shape[0] if q.dim() == 4 else 1
    return q.new_empty((batch, q.shape[-2], q.shape[-3], k_len))


@torch.library.register_fake("posenc::shaw_scores")
def _shaw_scores(q, key_table, q_positions, k_positions, max_distance):
    return _scores(q, k_positions.shape[-1])


@torch.library.register_fake("posenc::shaw_scores_backward")
def _shaw_scores_backward(grad, q, key_table, q_positions, k_positions, max_distance):
    return torch.empty_like(q), _contiguous_like(key_table)  # dq as zeros_like makes it


@torch.library.register_fake("posenc::shaw_values")
def _shaw_values(probs, value_table, q_positions, k_positions, max_distance):
    return probs.new_empty((probs.shape[0], probs.shape[2], probs.shape[1], value_table.shape[-1]))


@torch.library.register_fake("posenc::shaw_values_backward")
def _shaw_values_backward(grad, probs, value_table, q_positions, k_positions, max_distance):
    return torch.empty_like(probs), _contiguous_like(value_table)


@torch.library.register_fake("posenc::xl_scores")
def _xl_scores(q, k, u, v, w_r, q_positions, k_positions, scale, base):
    return _scores(q, k.shape[-3])


@torch.library.register_fake("posenc::xl_scores_backward")
def _xl_scores_backward(grad, q, k, u, v, w_r, q_positions, k_positions, scale, base):
    return (torch.empty_like(q), torch.empty_like(k), *(_contiguous_like(t) for t in (u, v, w_r)))


def _rotated(q, k):
    """rope's (q_out, k_out): contiguous in q's and k's shapes and dtypes; k_out an empty tensor of
    q's dtype where k is left out (a 1-D empty tensor)."""
    absent = k.dim() == 1 and k.numel() == 0
    return _contiguous_like(q), q.new_empty(0) if absent else _contiguous_like(k)


for _name in ("rope", "rope_pickled"):
    torch.library.register_fake(f"posenc::{_name}")(
        lambda q, k, positions, params, seq_len, direction: _rotated(q, k))
    torch.library.register_fake(f"posenc::{_name.replace('rope', 'rope_multi')}")(
        lambda q, k, positions, params, seq_len, sections, interleaved, axis_of_pair, restart, direction:
        _rotated(q, k))


@torch.library.register_fake("posenc::rope_")
def _rope_inplace(q, k, positions, params, seq_len, direction):
    return q, k


@torch.library.register_fake("posenc::rope_pickled_")
def _rope_pickled_inplace(q, k, positions, params, seq_len, direction):
    return None


@torch.library.register_fake("posenc::rope_rerotate_")
def _rope_rerotate(k, from_positions, from_params, from_seq_len, to_positions, to_params, to_seq_len):
    return k


@torch.library.register_fake("posenc::qk_transform")
def _qk_transform(scheme, x, positions, keys, seq_len):
    return torch.empty_like(x)


@torch.library.register_fake("posenc::score_bias")
def _score_bias(scheme, params, q_positions, k_positions, dtype, head_dim=1):
    return _bias(q_positions.new_empty(0, dtype=dtype), scheme.heads(), q_positions, k_positions)


@torch.library.register_fake("posenc::score_bias_pickled")
def _score_bias_pickled(scheme, params, q_positions, k_positions, dtype, heads, head_dim=1):
    return _bias(q_positions.new_empty(0, dtype=dtype), heads, q_positions, k_positions)


@torch.library.register_fake("posenc::score_bias_backward")
def _score_bias_backward(grad, scheme, params, q_positions, k_positions, head_dim=1):
    return _contiguous_like(params)


@torch.library.register_fake("posenc::attention_backward")
def _attention_backward(q, k, v, schemes, params, causal, window_left, window_right, chunk_size, temperature, softcap,
                        scale, q_positions, k_positions, out, lse, d_out, cu_seqlens_q=(), cu_seqlens_k=(),
                        skip_vanishing_tiles=True):
    # dq, dk, dv as zeros_like makes them; each group's parameters' gradient in its params' shape.
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), [_contiguous_like(p) for p in params]


@torch.library.register_fake("posenc::huge_page_zeros")
def _huge_page_zeros(shape, dtype):
    for i, s in enumerate(shape):
        if s < 0:
            raise ValueError(f"huge_page_zeros: shape[{i}] = {s}; expected >= 0")
    return torch.empty(shape, dtype=dtype, device="cpu")
