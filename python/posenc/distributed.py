"""Context parallelism on torch.distributed: attention over a sequence split across ranks.

``ring_attention`` runs posenc's fused attention on each rank's queries while the key/value blocks
travel around the ring of ranks, and merges the partial results through their log-sum-exp; its
backward sends the keys' gradients around the same ring back to their owners. Any backend
torch.distributed has (gloo on CPU) carries the blocks. ``zigzag_shard`` lays a sequence out for
causal attention so that every rank does the same work (docs/nn.md, context parallelism)."""
import time

import torch
import torch.distributed as dist

from ._checks import _int, _object, _ops
from ._modules import Forgetting
from ._attention import _attention_args
from .registry import Scheme

__all__ = ["ring_attention", "zigzag_indices", "zigzag_shard", "RingStats"]


def zigzag_indices(length, rank, world):
    """The token indices rank holds in the zigzag layout of a sequence of ``length`` tokens cut into
    2·world equal chunks: chunks ``rank`` and ``2·world − 1 − rank``. Under a causal mask a rank
    then sees as many keys as any other."""
    length, world = _int("zigzag_indices", "length", length, 1), _int("zigzag_indices", "world", world, 1)
    rank = _int("zigzag_indices", "rank", rank, 0)
    if rank >= world:
        raise ValueError(f"zigzag_indices: rank = {rank}; expected < world = {world}")
    if length % (2 * world):
        raise ValueError(f"zigzag_indices: length = {length}; expected a multiple of 2·world = {2 * world}")
    c = length // (2 * world)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * world - 1 - rank) * c,
                                                                            (2 * world - rank) * c)])


def zigzag_shard(x, rank, world, dim=1):
    """The part of ``x`` (the whole sequence along ``dim``) that rank holds in the zigzag layout."""
    return x.index_select(dim, zigzag_indices(x.shape[dim], rank, world))


class RingStats:
    """What the last ``ring_attention`` forward and backward did on this rank: bytes sent, the
    seconds spent in the kernels and the seconds waiting for the ring."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.steps, self.bytes_sent, self.compute_seconds, self.wait_seconds = 0, 0, 0.0, 0.0

    def __repr__(self):
        return (f"RingStats(steps={self.steps}, bytes_sent={self.bytes_sent}, compute_seconds={self.compute_seconds:.4f}, "
                f"wait_seconds={self.wait_seconds:.4f})")


stats = RingStats()
_KEYS, _GRADIENTS = 1, 2  # message tags


def _runs(positions, ids):
    """Maximal runs of consecutive positions within one sequence: [(start index, length, first
    position, sequence id)]."""
    p, d = positions.tolist(), ids.tolist()
    runs, start = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1 or d[i] != d[i - 1]:
            runs.append((start, i - start, p[start], d[start]))
            start = i
    return runs


def _mode(q_run, k_run, causal):
    """How a run of queries meets a run of keys: "full", "causal" (the same positions) or None
    (another sequence, or keys after the queries)."""
    _, q_len, q_first, q_id = q_run
    _, k_len, k_first, k_id = k_run
    if q_id != k_id:
        return None
    if not causal:
        return "full"
    if k_first + k_len - 1 < q_first:
        return "full"
    if k_first > q_first + q_len - 1:
        return None
    if k_first == q_first and k_len == q_len:
        return "causal"
    raise ValueError(f"ring_attention: the keys at positions {k_first}..{k_first + k_len - 1} partly overlap the "
                     f"queries at {q_first}..{q_first + q_len - 1}; expected runs that are equal or disjoint "
                     "(zigzag_shard, or equal contiguous slices)")


def _pairs(q_runs, k_positions, k_ids, causal):
    """The (query slice, key slice, mode) of each pair of runs a block computes."""
    for q_run in q_runs:
        for k_run in _runs(k_positions, k_ids):
            mode = _mode(q_run, k_run, causal)
            if mode is not None:
                yield slice(q_run[0], q_run[0] + q_run[1]), slice(k_run[0], k_run[0] + k_run[1]), mode


class _Ring:
    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        peer = (lambda r: r) if group is None else (lambda r: dist.distributed_c10d._get_global_rank(group, r))
        self.next, self.prev = peer((self.rank + 1) % self.world), peer((self.rank - 1) % self.world)

    def start(self, tensors, tag):
        """Sends tensors to the next rank and receives the previous rank's (same shapes); the tag
        keeps the key blocks and their gradients apart."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in received]
        stats.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(requests):
        start = time.perf_counter()
        for r in requests:
            r.wait()
        stats.wait_seconds += time.perf_counter() - start


def _merge(out, lse, o, l):
    """Adds a partial result (o, l) to the running (out, lse), both in fp64 (−inf: no key yet)."""
    l = l.to(torch.float64)
    new = torch.logaddexp(lse, l)
    keep = torch.where(torch.isinf(new) & (new < 0), torch.zeros_like(new), torch.exp(lse - new))
    add = torch.where(torch.isinf(new) & (new < 0), torch.zeros_like(new), torch.exp(l - new))
    out.mul_(keep.transpose(1, 2).unsqueeze(-1)).add_(o.to(torch.float64) * add.transpose(1, 2).unsqueeze(-1))
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, positions, ids, ring, args, *params):
        schemes, causal, chunk, temperature, softcap, scale = args
        b, s, h, _ = q.shape
        out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float64)
        lse = torch.full((b, h, s), float("-inf"), dtype=torch.float64)
        q_runs = _runs(positions, ids)
        block = [k.contiguous(), v.contiguous(), positions, ids]
        for step in range(ring.world):
            pending = ring.start(block, _KEYS) if step < ring.world - 1 else None
            start = time.perf_counter()
            kb, vb, kpos, kids = block
            for qs, ks, mode in _pairs(q_runs, kpos, kids, causal):
                o, l = _ops.attention(q[:, qs], kb[:, ks], vb[:, ks], schemes, list(params), [], None,
                                      mode == "causal", -1, -1, chunk, temperature, softcap, scale,
                                      positions[qs].contiguous(), kpos[ks].contiguous(), [], [], True)
                _merge(out[:, qs], lse[:, :, qs], o, l)
            stats.compute_seconds += time.perf_counter() - start
            stats.steps += 1
            if pending is not None:
                block, requests = pending
                ring.finish(requests)
        if sinks is not None:
            # Each head's sink joins the denominator once, with no value.
            total = torch.logaddexp(lse, sinks.to(torch.float64).view(1, h, 1).expand_as(lse))
            out.mul_(torch.exp(lse - total).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1))
            lse = total
        out, lse = out.to(q.dtype), lse.to(torch.float32)
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k, v, sinks if sinks is not None else torch.empty(0), positions, ids, out, lse, *params)
        ctx.ring, ctx.args = ring, args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k, v, sinks, positions, ids, out, lse, *params = ctx.saved_tensors
        ring = ctx.ring
        schemes, causal, chunk, temperature, softcap, scale = ctx.args
        d_out = d_out.contiguous()
        dq = torch.zeros_like(q)
        d_params = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        q_runs = _runs(positions, ids)
        # The key blocks go round as in forward, and each block's gradients follow it one step
        # behind: a rank adds its part to what the previous rank sent, and after world hops a
        # block's gradients are home. Both transfers overlap the kernels.
        block, incoming = [k.contiguous(), v.contiguous(), positions, ids], None
        for step in range(ring.world):
            pending = ring.start(block, _KEYS) if step < ring.world - 1 else None
            start = time.perf_counter()
            kb, vb, kpos, kids = block
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            for qs, ks, mode in _pairs(q_runs, kpos, kids, causal):
                gq, gk, gv, gp = _ops.attention_backward(
                    q[:, qs], kb[:, ks], vb[:, ks], schemes, list(params), mode == "causal", -1, -1, chunk,
                    temperature, softcap, scale, positions[qs].contiguous(), kpos[ks].contiguous(), out[:, qs],
                    lse[:, :, qs], d_out[:, qs], [], [], True)
                dq[:, qs] += gq
                dk[:, ks] += gk
                dv[:, ks] += gv
                for total, part in zip(d_params, gp):
                    total += part
            stats.compute_seconds += time.perf_counter() - start
            stats.steps += 1
            if incoming is not None:
                (earlier_dk, earlier_dv), requests = incoming
                ring.finish(requests)
                dk += earlier_dk
                dv += earlier_dv
            incoming = ring.start([dk, dv], _GRADIENTS)
            if pending is not None:
                block, requests = pending
                ring.finish(requests)
        (dk, dv), requests = incoming
        ring.finish(requests)
        d_sinks = None
        if ctx.has_sinks:
            # ∂L/∂s_h = −Σ_i p_sink,i·δ_i, δ_i = dO_i·out_i, over every rank's rows.
            delta = (d_out.to(torch.float64) * out.to(torch.float64)).sum(-1).transpose(1, 2)  # [B, H, S]
            p_sink = torch.exp(sinks.to(torch.float64).view(1, -1, 1) - lse.to(torch.float64))
            d_sinks = -(p_sink * delta).sum((0, 2))
            dist.all_reduce(d_sinks, group=ring.group)
            d_sinks = d_sinks.to(sinks.dtype)
        d_params_out = []
        for p, d in zip(params, d_params):
            if p.numel():
                dist.all_reduce(d, group=ring.group)
            d_params_out.append(d.to(p.dtype) if p.numel() else None)
        return (dq, dk, dv, d_sinks, None, None, None, None, *d_params_out)


def ring_attention(q, k, v, scheme=None, *, positions, sequence_ids=None, group=None, causal=True, chunk_size=None,
                   temperature=None, softcap=0.0, scale=None, sinks=None, return_lse=False):
    """Attention over a sequence split across the ranks of ``group`` (default: every rank), as
    ``posenc.attention`` over the whole sequence would give it.

    Each rank passes its own tokens: q ``[B, S, H, D]``, k and v ``[B, S, G, D]`` and their global
    ``positions`` (int64 ``[S]``), S the same on every rank. The positions form runs of consecutive
    integers (a contiguous slice, or ``zigzag_shard``'s two chunks, which balance a causal mask);
    under ``causal`` two runs are either equal or disjoint. Packed sequences: ``sequence_ids``
    (int64 ``[S]``) names each token's sequence, whose positions restart at 0; a token attends only
    within its sequence, which may span ranks. ``scheme``: any scheme whose terms
    depend on positions only (RoPE, ALiBi, T5, Kerple, FIRE, Sandwich, Shaw, XL, TUPE, head
    groups); ``sinks`` ``[H]`` join the denominator once. Differentiable in q, k, v, the scheme's
    parameters and the sinks; the parameters' and sinks' gradients are summed over the ranks in
    backward (every rank holds the whole sequence's). ``posenc.distributed.stats`` records the
    bytes sent and the time split of the last calls."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialised (dist.init_process_group)")
    # Every check ends in one decision shared by the ranks, so that a refusal on one rank never
    # leaves the others waiting in the ring.
    error, args = None, None
    try:
        for name, t in (("positions", positions), ("sequence_ids", sequence_ids)):
            if t is None and name == "sequence_ids":
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != torch.long or t.dim() != 1 or q.dim() != 4 \
                    or t.shape[0] != q.shape[1]:
                raise ValueError(f"ring_attention: {name} must be an int64 tensor [S] with q's S = "
                                 f"{q.shape[1] if q.dim() == 4 else '?'} tokens")
        groups = scheme if isinstance(scheme, (list, tuple)) else [(None, scheme)]
        for g in groups:
            s = g[1] if isinstance(g, (list, tuple)) and len(g) == 2 else None
            if isinstance(s, Forgetting) or (isinstance(s, Scheme) and s.inputs):
                name = "Forgetting" if isinstance(s, Forgetting) else f"{s.name} (a scheme of per-token inputs)"
                raise ValueError(f"ring_attention: scheme = {name}; expected a scheme whose terms depend on positions "
                                 "only (a forget gate's running sum spans the ranks)")
        args = _attention_args(q, k, v, scheme, causal, (-1, -1), chunk_size, temperature, softcap, scale, positions,
                               positions, False, True, sinks)
    except (ValueError, TypeError) as e:
        error = e
    size = q.shape[1] if error is None else -1
    verdict = torch.tensor([1 if error else 0, size, -size])
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if verdict[0]:
        raise ValueError("ring_attention: another rank's input was refused (its error names it)")
    if verdict[1] != size or -verdict[2] != size:
        raise ValueError(f"ring_attention: this rank holds S = {size} tokens and another a different number; "
                         "expected the same S on every rank")
    (_, _, _, schemes, params, _, sink_tensor, causal, _, _, chunk, temp, softcap, scale, _, _, _, _, _) = args
    schemes, temp = [_object(s) for s in schemes], None if temp is None else _object(temp)
    ids = torch.zeros_like(positions) if sequence_ids is None else sequence_ids.contiguous()
    # Every rank's runs, to check each pair the ring will meet (the same on every rank).
    mine = torch.stack([positions, ids])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    for q_rank in everyone:
        for k_rank in everyone:
            for q_run in _runs(q_rank[0], q_rank[1]):
                for k_run in _runs(k_rank[0], k_rank[1]):
                    _mode(q_run, k_run, causal)
    ring = _Ring(group)
    stats.reset()
    out, lse = _RingAttention.apply(q, k, v, sink_tensor, positions.contiguous(), ids, ring,
                                    (schemes, causal, chunk, temp, softcap, scale), *params)
    return (out, lse) if return_lse else out
