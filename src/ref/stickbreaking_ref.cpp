// Reference stick-breaking attention: each row walked from its last visible key leftwards in
// fp64, the weights A_ij = σ(z_ij)·Π(1 − σ(z_im)) taken in log space as the definition
// (stickbreaking.hpp) writes them (below FLT_MIN: 0, as there), rem = 1 − Σ_j A_ij; backward by the chain rule on the
// same walk, with Σ_{m<j} g_im summed from the left (the fused kernel subtracts from the total). Sequences are read
// from the spec here, not from the fused plan.
#include <algorithm>
#include <cmath>
#include <vector>

#include "internal.hpp"
#include "posenc/reference.hpp"
#include "ref/row_sequences.hpp"
#include "stickbreaking_checks.hpp"

namespace posenc::ref {
namespace {

double softplus(double x) { return std::max(x, 0.0) + std::log1p(std::exp(-std::abs(x))); }

// One row's walk: the keys it sees (e of them), their logits and weights, and rem.
struct Row {
  std::vector<double> z, a;
  double rem = 1;
};

void walk(const StickBreakingSpec& spec, const detail::SbShape& shape, const Sequence& seq, std::int64_t h,
          std::int64_t i, Row& row) {
  const std::int64_t kvh = h / shape.group;
  const std::int64_t e = seq.lk - seq.lq + i + (spec.attend_current ? 1 : 0);
  row.z.assign(static_cast<std::size_t>(e), 0.0);
  row.a.assign(static_cast<std::size_t>(e), 0.0);
  double carry = 0, sum = 0;
  for (std::int64_t j = e - 1; j >= 0; --j) {
    double dot = 0;
    for (std::int64_t d = 0; d < shape.dim; ++d) {
      dot += at(spec.q.data(), shape.dtype, shape.qg, seq.b, seq.q0 + i, h, d) *
             at(spec.k.data(), shape.dtype, shape.kg, seq.b, seq.k0 + j, kvh, d);
    }
    const double z = shape.scale * dot;
    const double a = detail::sb_exp(carry - softplus(-z));
    carry -= softplus(z);
    row.z[static_cast<std::size_t>(j)] = z;
    row.a[static_cast<std::size_t>(j)] = a;
    sum += a;
  }
  row.rem = 1.0 - sum;
}

}  // namespace

void stickbreaking_forward(const StickBreakingAttention& attention, TensorView out, TensorView rem) {
  const StickBreakingSpec& spec = attention.spec();
  const detail::SbShape shape = detail::check_stickbreaking(spec);
  const detail::HeadsGrid og =
      detail::check_sb_forward_outputs(spec, shape, ConstTensorView(out), ConstTensorView(rem));
  const bool want_rem = rem.rank() > 0 && rem.data() != nullptr;
  const detail::RemGrid rg = want_rem ? detail::check_rem(shape, "rem", ConstTensorView(rem), true) : detail::RemGrid{};
  Row row;
  for (const Sequence& seq : sequences_of(shape, spec.cu_seqlens_q, spec.cu_seqlens_k)) {
    for (std::int64_t h = 0; h < shape.heads; ++h) {
      const std::int64_t kvh = h / shape.group;
      for (std::int64_t i = 0; i < seq.lq; ++i) {
        walk(spec, shape, seq, h, i, row);
        for (std::int64_t c = 0; c < shape.dim_v; ++c) {
          double o = 0;
          for (std::size_t j = 0; j < row.a.size(); ++j)
            o += row.a[j] *
                 at(spec.v.data(), shape.dtype, shape.vg, seq.b, seq.k0 + static_cast<std::int64_t>(j), kvh, c);
          detail::store(out.data(), out.dtype(), og.offset(seq.b, seq.q0 + i) + h * og.head_stride + c * og.dim_stride,
                        o);
        }
        if (want_rem) static_cast<float*>(rem.data())[rg.offset(seq.b, seq.q0 + i, h)] = static_cast<float>(row.rem);
      }
    }
  }
}

void stickbreaking_backward(const StickBreakingAttention& attention, ConstTensorView out, ConstTensorView rem,
                            ConstTensorView d_out, ConstTensorView d_rem, TensorView dq, TensorView dk, TensorView dv) {
  const StickBreakingSpec& spec = attention.spec();
  const detail::SbShape shape = detail::check_stickbreaking(spec);
  const detail::SbBackwardGrids g = detail::check_sb_backward(spec, shape, out, rem, d_out, d_rem, dq, dk, dv);
  const bool has_d_rem = d_rem.rank() > 0 && d_rem.data() != nullptr;
  const std::int64_t d = shape.dim, dvc = shape.dim_v;
  std::vector<double> gq(static_cast<std::size_t>(d)), prefix;
  Row row;
  for (const Sequence& seq : sequences_of(shape, spec.cu_seqlens_q, spec.cu_seqlens_k)) {
    // fp64 sums of dK and dV of this sequence, [lk][G][D] and [lk][G][Dv].
    std::vector<double> gk(static_cast<std::size_t>(seq.lk * shape.kv_heads * d), 0.0);
    std::vector<double> gv(static_cast<std::size_t>(seq.lk * shape.kv_heads * dvc), 0.0);
    for (std::int64_t h = 0; h < shape.heads; ++h) {
      const std::int64_t kvh = h / shape.group;
      for (std::int64_t i = 0; i < seq.lq; ++i) {
        walk(spec, shape, seq, h, i, row);
        const double dr =
            has_d_rem ? static_cast<const float*>(d_rem.data())[g.d_rem.offset(seq.b, seq.q0 + i, h)] : 0.0;
        std::fill(gq.begin(), gq.end(), 0.0);
        double left = 0;  // Σ_{m<j} g_im
        for (std::size_t ju = 0; ju < row.a.size(); ++ju) {
          const auto j = static_cast<std::int64_t>(ju);
          double da = -dr;
          for (std::int64_t c = 0; c < dvc; ++c) {
            const double go = at(d_out.data(), shape.dtype, g.dog, seq.b, seq.q0 + i, h, c);
            da += go * at(spec.v.data(), shape.dtype, shape.vg, seq.b, seq.k0 + j, kvh, c);
            gv[static_cast<std::size_t>((j * shape.kv_heads + kvh) * dvc + c)] += row.a[ju] * go;
          }
          const double gj = row.a[ju] * da;
          const double z = row.z[ju];
          const double dz = gj * detail::sb_sigmoid(-z) - detail::sb_sigmoid(z) * left;
          left += gj;
          for (std::int64_t t = 0; t < d; ++t) {
            gq[static_cast<std::size_t>(t)] +=
                shape.scale * dz * at(spec.k.data(), shape.dtype, shape.kg, seq.b, seq.k0 + j, kvh, t);
            gk[static_cast<std::size_t>((j * shape.kv_heads + kvh) * d + t)] +=
                shape.scale * dz * at(spec.q.data(), shape.dtype, shape.qg, seq.b, seq.q0 + i, h, t);
          }
        }
        if (dq.rank() > 0) add_row(dq, shape.dtype, g.dqg, seq.b, seq.q0 + i, h, gq);
      }
    }
    add_keys(dk, shape.dtype, g.dkg, seq, shape.kv_heads, gk, d);
    add_keys(dv, shape.dtype, g.dvg, seq, shape.kv_heads, gv, dvc);
  }
}

}  // namespace posenc::ref
