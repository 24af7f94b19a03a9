"""Fake kernels of posenc's ops: the shapes, dtypes and strides of their outputs, computed without
data. torch.compile and torch.library.opcheck run them while they trace; each mirrors what its C++
kernel (torch/*.cpp) allocates. The typed arguments (torch.classes.posenc.Scheme, Temperature,
Rope) reach them as the objects themselves."""
import torch


def _contiguous_like(t):
    return t.new_empty(t.shape)


@torch.library.register_fake("posenc::attention")
def _attention(q, k, v, schemes, params, gates, sinks, causal, window_left, window_right, chunk_size, temperature,
               softcap, scale, q_positions, k_positions, cu_seqlens_q=(), cu_seqlens_k=(), skip_vanishing_tiles=True):
    # out like q with v's head size (MLA); lse float32 [B, H, Sq], or [H, Tq] for packed sequences.
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse_shape = (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.register_fake("posenc::attention_planned")
def _attention_planned(q, k, v, objects, params, gates, sinks, causal, window_left, window_right, chunk_size, softcap,
                       scale, q_positions, k_positions, cu_seqlens_q, cu_seqlens_k, skip_vanishing_tiles):
    out, lse = _attention(q, k, v, None, params, gates, sinks, causal, window_left, window_right, chunk_size, None,
                          softcap, scale, q_positions, k_positions, cu_seqlens_q, cu_seqlens_k, skip_vanishing_tiles)
    return out, lse, q.new_empty(1, dtype=torch.int64)  # the plan: an id, int64 [1]


@torch.library.register_fake("posenc::attention_grad")
def _attention_grad(plan, q, k, v, params, gates, sinks, out, lse, d_out, params_grad, gates_grad, sinks_grad):
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


@torch.library.register_fake("posenc::alibi_bias")
def _alibi_bias(slopes, q_positions, k_positions, symmetric):
    return _bias(slopes, slopes.shape[0], q_positions, k_positions)


@torch.library.register_fake("posenc::alibi_bias_backward")
def _alibi_bias_backward(grad, slopes, q_positions, k_positions, symmetric):
    return _contiguous_like(slopes)


@torch.library.register_fake("posenc::t5_bias")
def _t5_bias(table, q_positions, k_positions, num_buckets, max_distance, bidirectional):
    return _bias(table, table.shape[1], q_positions, k_positions)


@torch.library.register_fake("posenc::t5_bias_backward")
def _t5_bias_backward(grad, table, q_positions, k_positions, num_buckets, max_distance, bidirectional):
    return _contiguous_like(table)


@torch.library.register_fake("posenc::kerple_bias")
def _kerple_bias(r1, r2, q_positions, k_positions, power):
    return _bias(r1, r1.shape[0], q_positions, k_positions)


@torch.library.register_fake("posenc::kerple_bias_backward")
def _kerple_bias_backward(grad, r1, r2, q_positions, k_positions, power):
    return _contiguous_like(r1), _contiguous_like(r2)


@torch.library.register_fake("posenc::fire_bias")
def _fire_bias(w1, b1, w2, b2, c, threshold, q_positions, k_positions):
    return _bias(w2, w2.shape[0], q_positions, k_positions)


@torch.library.register_fake("posenc::fire_bias_backward")
def _fire_bias_backward(grad, w1, b1, w2, b2, c, threshold, q_positions, k_positions):
    return tuple(_contiguous_like(t) for t in (w1, b1, w2, b2, c, threshold))


@torch.library.register_fake("posenc::learned")
def _learned(table, x, positions):
    return _contiguous_like(x)


@torch.library.register_fake("posenc::learned_backward")
def _learned_backward(grad, table, positions):
    return _contiguous_like(table)
