// Reference CoPE: each row walked from its query's own token leftwards in fp64 — gates, their sums,
// clamped positions and interpolated position logits as the definition (cope.hpp) writes them —
// then a materialised softmax; backward by the chain rule on the same walk, with Σ_{m<=j} dp
// summed from the left. Sequences are read from the spec here, not from the fused plan.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cope_checks.hpp"
#include "internal.hpp"
#include "posenc/reference.hpp"
#include "ref/row_sequences.hpp"

namespace posenc::ref {
namespace {

// The interpolation of a position p: floor index, ceiling index (the floor's at an integer), and
// the ceiling's weight. A NaN position takes index 0 with a NaN weight (cope.hpp).
struct Interp {
  std::int64_t fl, ce;
  double w;
};
Interp interp(double p) {
  const double fl = std::isnan(p) ? 0.0 : std::floor(p);
  const double w = p - fl;
  const auto f = static_cast<std::int64_t>(fl);
  return {f, w > 0 ? f + 1 : f, w};
}

// One row's walk: its keys 0..t (e = t + 1 of them) with logits z, gates g, gate sums (unclamped),
// logits s and probabilities; qe[n] = ⟨q, e[n]⟩; out and lse.
struct Row {
  std::vector<double> q, qe, z, g, sum, s, prob, out;
  double lse = 0;
};

void walk(const CopeSpec& spec, const detail::CopeShape& shape, const Sequence& seq, std::int64_t h, std::int64_t i,
          Row& row) {
  const std::int64_t kvh = h / shape.group;
  const std::int64_t e = seq.lk - seq.lq + i + 1;
  const auto ue = static_cast<std::size_t>(e);
  row.q.assign(static_cast<std::size_t>(shape.dim), 0.0);
  for (std::int64_t d = 0; d < shape.dim; ++d)
    row.q[static_cast<std::size_t>(d)] = at(spec.q.data(), shape.dtype, shape.qg, seq.b, seq.q0 + i, h, d);
  row.qe.assign(static_cast<std::size_t>(shape.npos), 0.0);
  for (std::int64_t n = 0; n < shape.npos; ++n) {
    double dot = 0;
    for (std::int64_t d = 0; d < shape.dim; ++d)
      dot += row.q[static_cast<std::size_t>(d)] *
             detail::load(spec.table.data(), shape.table.dtype, shape.table.offset(n, d));
    row.qe[static_cast<std::size_t>(n)] = dot;
  }
  for (auto* v : {&row.z, &row.g, &row.sum, &row.s, &row.prob}) v->assign(ue, 0.0);
  const auto cap = static_cast<double>(shape.npos - 1);
  double carry = 0, m = -std::numeric_limits<double>::infinity();
  for (std::int64_t j = e - 1; j >= 0; --j) {
    const auto uj = static_cast<std::size_t>(j);
    double dot = 0;
    for (std::int64_t d = 0; d < shape.dim; ++d)
      dot += row.q[static_cast<std::size_t>(d)] * at(spec.k.data(), shape.dtype, shape.kg, seq.b, seq.k0 + j, kvh, d);
    const double z = shape.scale * dot;
    const double g = detail::cope_sigmoid(z);
    carry += g;
    const double p = carry >= cap ? cap : carry;
    const Interp t = interp(p);
    const double s =
        z + (1 - t.w) * row.qe[static_cast<std::size_t>(t.fl)] + t.w * row.qe[static_cast<std::size_t>(t.ce)];
    row.z[uj] = z;
    row.g[uj] = g;
    row.sum[uj] = carry;
    row.s[uj] = s;
    m = std::isnan(s) || std::isnan(m) ? std::numeric_limits<double>::quiet_NaN() : std::max(m, s);
  }
  // Every logit −inf: a row of 0 and lse −inf, as the fused softmax leaves a row without keys.
  double l = 0;
  for (std::size_t j = 0; j < ue && m != -std::numeric_limits<double>::infinity(); ++j) l += std::exp(row.s[j] - m);
  row.lse = l == 0 ? -std::numeric_limits<double>::infinity() : m + std::log(l);
  for (std::size_t j = 0; j < ue; ++j) row.prob[j] = l == 0 ? 0.0 : detail::cope_exp(row.s[j] - row.lse);
  row.out.assign(static_cast<std::size_t>(shape.dim_v), 0.0);
  for (std::int64_t c = 0; c < shape.dim_v; ++c) {
    double o = 0;
    for (std::size_t j = 0; j < ue; ++j)
      o += row.prob[j] * at(spec.v.data(), shape.dtype, shape.vg, seq.b, seq.k0 + static_cast<std::int64_t>(j), kvh, c);
    row.out[static_cast<std::size_t>(c)] = o;
  }
}

void add(TensorView dst, DType dtype, std::int64_t offset, double value) {
  detail::store(dst.data(), dtype, offset, detail::load(dst.data(), dtype, offset) + value);
}

}  // namespace

void cope_forward(const CopeAttention& attention, TensorView out, TensorView lse) {
  const CopeSpec& spec = attention.spec();
  const detail::CopeShape shape = detail::check_cope(spec);
  const detail::HeadsGrid og =
      detail::check_cope_forward_outputs(spec, shape, ConstTensorView(out), ConstTensorView(lse));
  const bool want_lse = detail::given(ConstTensorView(lse));
  const detail::RowStatGrid lg = want_lse
                                     ? detail::check_row_stat(detail::kCope, shape, "lse", ConstTensorView(lse), true)
                                     : detail::RowStatGrid{};
  Row row;
  for (const Sequence& seq : sequences_of(shape, spec.cu_seqlens_q, spec.cu_seqlens_k)) {
    for (std::int64_t h = 0; h < shape.heads; ++h) {
      for (std::int64_t i = 0; i < seq.lq; ++i) {
        walk(spec, shape, seq, h, i, row);
        for (std::int64_t c = 0; c < shape.dim_v; ++c) {
          detail::store(out.data(), out.dtype(), og.offset(seq.b, seq.q0 + i) + h * og.head_stride + c * og.dim_stride,
                        row.out[static_cast<std::size_t>(c)]);
        }
        if (want_lse) static_cast<float*>(lse.data())[lg.offset(seq.b, seq.q0 + i, h)] = static_cast<float>(row.lse);
      }
    }
  }
}

void cope_backward(const CopeAttention& attention, ConstTensorView out, ConstTensorView lse, ConstTensorView d_out,
                   TensorView dq, TensorView dk, TensorView dv, TensorView d_table) {
  const CopeSpec& spec = attention.spec();
  const detail::CopeShape shape = detail::check_cope(spec);
  const detail::CopeBackwardGrids g = detail::check_cope_backward(spec, shape, out, lse, d_out, dq, dk, dv, d_table);
  const std::int64_t d = shape.dim, dvc = shape.dim_v, npos = shape.npos;
  const auto cap = static_cast<double>(npos - 1);
  std::vector<double> gq(static_cast<std::size_t>(d)), dqe, dp, de(static_cast<std::size_t>(npos * d), 0.0);
  Row row;
  for (const Sequence& seq : sequences_of(shape, spec.cu_seqlens_q, spec.cu_seqlens_k)) {
    // fp64 sums of dK and dV of this sequence, [lk][G][D] and [lk][G][Dv].
    std::vector<double> gk(static_cast<std::size_t>(seq.lk * shape.kv_heads * d), 0.0);
    std::vector<double> gv(static_cast<std::size_t>(seq.lk * shape.kv_heads * dvc), 0.0);
    for (std::int64_t h = 0; h < shape.heads; ++h) {
      const std::int64_t kvh = h / shape.group;
      for (std::int64_t i = 0; i < seq.lq; ++i) {
        walk(spec, shape, seq, h, i, row);
        const std::size_t e = row.s.size();
        std::vector<double> go(static_cast<std::size_t>(dvc));
        double delta = 0;
        for (std::int64_t c = 0; c < dvc; ++c) {
          go[static_cast<std::size_t>(c)] = at(d_out.data(), shape.dtype, g.dog, seq.b, seq.q0 + i, h, c);
          delta += go[static_cast<std::size_t>(c)] * row.out[static_cast<std::size_t>(c)];
        }
        dqe.assign(static_cast<std::size_t>(npos), 0.0);
        dp.assign(e, 0.0);
        std::vector<double> ds(e, 0.0);
        for (std::size_t ju = 0; ju < e; ++ju) {
          const auto j = static_cast<std::int64_t>(ju);
          double dprob = 0;
          for (std::int64_t c = 0; c < dvc; ++c) {
            dprob +=
                go[static_cast<std::size_t>(c)] * at(spec.v.data(), shape.dtype, shape.vg, seq.b, seq.k0 + j, kvh, c);
            gv[static_cast<std::size_t>((j * shape.kv_heads + kvh) * dvc + c)] +=
                row.prob[ju] * go[static_cast<std::size_t>(c)];
          }
          ds[ju] = row.prob[ju] * (dprob - delta);
          const double sum = row.sum[ju];
          const Interp t = interp(sum >= cap ? cap : sum);
          dqe[static_cast<std::size_t>(t.fl)] += ds[ju] * (1 - t.w);
          dqe[static_cast<std::size_t>(t.ce)] += ds[ju] * t.w;
          dp[ju] = sum >= cap
                       ? 0.0
                       : ds[ju] * (row.qe[static_cast<std::size_t>(t.ce)] - row.qe[static_cast<std::size_t>(t.fl)]);
        }
        std::fill(gq.begin(), gq.end(), 0.0);
        double run = 0;  // Σ_{m<=j} dp_im
        for (std::size_t ju = 0; ju < e; ++ju) {
          const auto j = static_cast<std::int64_t>(ju);
          run += dp[ju];
          const double dz = ds[ju] + row.g[ju] * (1 - row.g[ju]) * run;
          for (std::int64_t t = 0; t < d; ++t) {
            gq[static_cast<std::size_t>(t)] +=
                shape.scale * dz * at(spec.k.data(), shape.dtype, shape.kg, seq.b, seq.k0 + j, kvh, t);
            gk[static_cast<std::size_t>((j * shape.kv_heads + kvh) * d + t)] +=
                shape.scale * dz * row.q[static_cast<std::size_t>(t)];
          }
        }
        for (std::int64_t n = 0; n < npos; ++n) {
          const double w = dqe[static_cast<std::size_t>(n)];
          for (std::int64_t t = 0; t < d; ++t) {
            gq[static_cast<std::size_t>(t)] +=
                w * detail::load(spec.table.data(), shape.table.dtype, shape.table.offset(n, t));
            de[static_cast<std::size_t>(n * d + t)] += w * row.q[static_cast<std::size_t>(t)];
          }
        }
        if (dq.rank() > 0) add_row(dq, shape.dtype, g.dqg, seq.b, seq.q0 + i, h, gq);
      }
    }
    add_keys(dk, shape.dtype, g.dkg, seq, shape.kv_heads, gk, d);
    add_keys(dv, shape.dtype, g.dvg, seq, shape.kv_heads, gv, dvc);
  }
  if (d_table.rank() > 0) {
    for (std::int64_t n = 0; n < npos; ++n) {
      for (std::int64_t t = 0; t < d; ++t)
        add(d_table, g.d_table.dtype, g.d_table.offset(n, t), de[static_cast<std::size_t>(n * d + t)]);
    }
  }
}

}  // namespace posenc::ref
