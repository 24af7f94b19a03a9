// Reference attention: the unfused composition, one (sequence, head) at a time — transformed q
// and k by the library's fp64 references, the full score matrix with biases from bias_value,
// soft-cap, mask, softmax, P·V — in fp64, or in plain f32 (`naive_f32`: the same composition as
// a straightforward f32 implementation computes it, the yardstick of the accuracy criterion).
// The group's terms (Shaw's, Transformer-XL's, a forget gate, sinks) enter per visible pair
// through their TermDefinition alone (term.hpp); in plain f32 each is summed and scaled on its
// own and added after the bias, as an eager composition adds its score tensors. Backward in
// fp64: dP, dS, the bias parameters' gradients through the schemes' reference backwards on the
// materialised dS, the terms' per pair, and dq, dk transposed back through the transform.
//
// Independent of the engine: sequences, positions, head groups and masks are derived here from
// the public AttentionSpec by attention.hpp's rules, so a mistake in the engine's plan cannot
// hide in its own oracle.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "internal.hpp"
#include "posenc/error.hpp"
#include "posenc/reference.hpp"
#include "ref/transforms_ref.hpp"

namespace posenc::ref {
namespace {

constexpr const char* kWhere = "posenc::Attention";

// A sequence: batch row b (0 when packed), queries q0 … q0 + lq − 1 and keys k0 … k0 + lk − 1 of
// the views' token axis, lk after key_lengths.
struct Sequence {
  std::int64_t b = 0, q0 = 0, lq = 0, k0 = 0, lk = 0;
};

// What a call means, read from the spec alone (attention.hpp: Layout, Masks, Positions).
struct Problem {
  const AttentionSpec* spec = nullptr;
  bool packed = false;
  std::int64_t batch = 0, q_len = 0, k_len = 0, heads = 0, kv_heads = 0, group_size = 0, dim = 0;
  std::int64_t dim_v = 0;  // the values' head size (out, d_out, dv)
  detail::HeadsGrid qg, kg, vg;
  detail::HeadsGrid out_grid() const {
    detail::HeadsGrid g = qg;
    g.dim = dim_v;
    return g;
  }
  AttentionMask mask;
  double scale_f64 = 0;
  std::vector<Sequence> sequences;
  std::vector<HeadGroup> groups;  // the spec's, or one group without a scheme
  std::vector<std::int64_t> head_group, group_first_head;
  std::int64_t position_max = 0;  // over the sequences' queries and keys (RoPE's default seq_len − 1)

  // Default positions: key j at j, query i at max(0, Lk − Lq) + i of its sequence (the queries end
  // where the keys do; offsets below 0 would give negative positions and are taken as 0).
  std::int64_t q_position(const Sequence& seq, std::int64_t i) const {
    if (spec->q_positions) return spec->q_positions->at(seq.b, seq.q0 + i);
    return std::max<std::int64_t>(0, seq.lk - seq.lq) + i;
  }
  std::int64_t k_position(const Sequence& seq, std::int64_t j) const {
    if (spec->k_positions) return spec->k_positions->at(seq.b, seq.k0 + j);
    return j;
  }
};

Problem problem_of(const Attention& attention) {
  Problem p;
  const AttentionSpec& spec = attention.spec();
  p.spec = &spec;
  p.packed = !spec.cu_seqlens_q.empty();
  p.qg = detail::heads_grid(kWhere, "q", spec.q);
  p.kg = detail::heads_grid(kWhere, "k", spec.k);
  p.vg = detail::heads_grid(kWhere, "v", spec.v);
  p.batch = p.qg.batch;
  p.q_len = p.qg.seq;
  p.k_len = p.kg.seq;
  p.heads = p.qg.heads;
  p.kv_heads = p.kg.heads;
  p.group_size = p.heads / p.kv_heads;
  p.dim = p.qg.dim;
  p.dim_v = p.vg.dim;
  p.mask = spec.mask;
  p.scale_f64 = spec.scale > 0 ? spec.scale : 1.0 / std::sqrt(static_cast<double>(p.dim));
  if (p.packed) {
    for (std::size_t s = 0; s + 1 < spec.cu_seqlens_q.size(); ++s) {
      p.sequences.push_back({0, spec.cu_seqlens_q[s], spec.cu_seqlens_q[s + 1] - spec.cu_seqlens_q[s],
                             spec.cu_seqlens_k[s], spec.cu_seqlens_k[s + 1] - spec.cu_seqlens_k[s]});
    }
  } else {
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const std::int64_t lk =
          spec.mask.key_lengths.empty() ? p.k_len : spec.mask.key_lengths[static_cast<std::size_t>(b)];
      p.sequences.push_back({b, 0, p.q_len, 0, lk});
    }
  }
  p.groups = spec.groups.empty() ? std::vector<HeadGroup>{HeadGroup{p.heads, {}, {}}} : spec.groups;
  for (std::size_t g = 0; g < p.groups.size(); ++g) {
    p.group_first_head.push_back(static_cast<std::int64_t>(p.head_group.size()));
    p.head_group.insert(p.head_group.end(), static_cast<std::size_t>(p.groups[g].heads), static_cast<std::int64_t>(g));
  }
  for (const Sequence& seq : p.sequences) {
    for (std::int64_t i = 0; i < seq.lq; ++i) p.position_max = std::max(p.position_max, p.q_position(seq, i));
    for (std::int64_t j = 0; j < seq.lk; ++j) p.position_max = std::max(p.position_max, p.k_position(seq, j));
  }
  return p;
}

// lse: [B, H, Sq] (or [H, Tq]) f32.
void check_lse(const Problem& p, ConstTensorView lse, bool writable) {
  detail::check_dtype(kWhere, "lse", lse.dtype(), DType::kF32);
  const bool ok = p.packed
                      ? lse.rank() == 2 && lse.size(0) == p.heads && lse.size(1) == p.q_len
                      : lse.rank() == 3 && lse.size(0) == p.batch && lse.size(1) == p.heads && lse.size(2) == p.q_len;
  if (!ok) {
    throw Error(kWhere, "lse", lse.describe(),
                p.packed ? "[H, Tq] = [" + std::to_string(p.heads) + ", " + std::to_string(p.q_len) + "]"
                         : "[B, H, Sq] = [" + std::to_string(p.batch) + ", " + std::to_string(p.heads) + ", " +
                               std::to_string(p.q_len) + "]");
  }
  if (writable) detail::check_writable(kWhere, "lse", lse);
}

std::int64_t lse_offset(const Problem& p, ConstTensorView lse, const Sequence& seq, std::int64_t h, std::int64_t i) {
  return p.packed ? h * lse.stride(0) + (seq.q0 + i) * lse.stride(1)
                  : seq.b * lse.stride(0) + h * lse.stride(1) + (seq.q0 + i) * lse.stride(2);
}

// Every gradient vector sized as zero_gradients() sizes it.
void check_gradients(const Attention& attention, const AttentionGradients& grads) {
  const AttentionGradients like = attention.zero_gradients();
  const auto same = [](const std::vector<double>& a, const std::vector<double>& b) { return a.size() == b.size(); };
  bool ok = grads.groups.size() == like.groups.size();
  for (std::size_t g = 0; ok && g < like.groups.size(); ++g) {
    const GroupGradients &a = grads.groups[g], &b = like.groups[g];
    ok = same(a.bias, b.bias);
    ok = ok && a.terms.size() == b.terms.size();
    for (std::size_t t = 0; ok && t < b.terms.size(); ++t) ok = same(a.terms[t], b.terms[t]);
  }
  if (!ok) {
    throw Error(kWhere, "grads", std::to_string(grads.groups.size()) + " groups of other sizes",
                "the sizes of Attention::zero_gradients()");
  }
}

struct Rows {
  std::int64_t n = 0, d = 0;
  std::vector<double> v;
  double* row(std::int64_t i) { return v.data() + i * d; }
  const double* row(std::int64_t i) const { return v.data() + i * d; }
};

Rows load_rows(const Problem& /* p */, ConstTensorView view, const detail::HeadsGrid& g, std::int64_t b,
               std::int64_t s0, std::int64_t n, std::int64_t h) {
  Rows r{n, g.dim, std::vector<double>(static_cast<std::size_t>(n * g.dim))};
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t off = g.offset(b, s0 + i) + h * g.head_stride;
    for (std::int64_t t = 0; t < g.dim; ++t)
      r.row(i)[t] = detail::load(view.data(), view.dtype(), off + t * g.dim_stride);
  }
  return r;
}

void store_rows(const Problem& /* p */, const Rows& r, TensorView view, const detail::HeadsGrid& g, std::int64_t b,
                std::int64_t s0, std::int64_t h, bool accumulate) {
  for (std::int64_t i = 0; i < r.n; ++i) {
    const std::int64_t off = g.offset(b, s0 + i) + h * g.head_stride;
    for (std::int64_t t = 0; t < r.d; ++t) {
      const std::int64_t at = off + t * g.dim_stride;
      const double prior = accumulate ? detail::load(view.data(), view.dtype(), at) : 0.0;
      detail::store(view.data(), view.dtype(), at, prior + r.row(i)[t]);
    }
  }
}

// The transform of a group applied to rows at `positions` (forward, or its transpose), fp64, by
// the transform's own reference (ref/transforms_ref.hpp).
void transform(const Problem& p, std::int64_t group, bool is_q, const std::vector<std::int64_t>& positions, Rows& r,
               bool transpose) {
  if (r.n == 0) return;
  const Positions pos = Positions::ids(positions);
  const TransformedRows rows{is_q, transpose, pos, p.position_max + 1, r.n, r.d, r.v};
  std::visit([&](const auto& t) { apply_transform(t, rows); }, p.groups[static_cast<std::size_t>(group)].transform);
}

}  // namespace

void qk_transform_rows(const QKTransform& transform, bool is_q, std::span<const std::int64_t> positions,
                       std::int64_t seq_len, std::int64_t d, std::span<double> rows) {
  const auto n = static_cast<std::int64_t>(positions.size());
  if (d < 1 || static_cast<std::int64_t>(rows.size()) != n * d) {
    throw Error("qk_transform_rows", "rows", std::to_string(rows.size()) + " values",
                std::to_string(n) + " positions × d = " + std::to_string(d) + " (d >= 1)");
  }
  if (seq_len < 1) throw Error("qk_transform_rows", "seq_len", std::to_string(seq_len), ">= 1");
  if (n == 0) return;
  std::vector<double> v(rows.begin(), rows.end());
  const Positions pos = Positions::ids(positions);
  const TransformedRows r{is_q, false, pos, seq_len, n, d, v};
  std::visit([&](const auto& t) { apply_transform(t, r); }, transform);
  std::copy(v.begin(), v.end(), rows.begin());
}

namespace {

// Rows times the spec's temperature of their query positions (temperature.hpp), in fp64.
void temper(const Problem& p, const std::vector<std::int64_t>& positions, Rows& r) {
  if (!p.spec->temperature) return;
  for (std::int64_t i = 0; i < r.n; ++i) {
    const double f = p.spec->temperature->factor(positions[static_cast<std::size_t>(i)]);
    for (std::int64_t t = 0; t < r.d; ++t) r.v[static_cast<std::size_t>(i * r.d + t)] *= f;
  }
}

const std::optional<BiasScheme>& bias_of(const Problem& p, std::int64_t group) {
  return p.groups[static_cast<std::size_t>(group)].bias;
}

// Visible keys [lo, hi) of query i (attention.hpp's mask rule).
std::pair<std::int64_t, std::int64_t> visible(const Problem& p, const Sequence& seq, std::int64_t i) {
  const std::int64_t offset = seq.lk - seq.lq;
  std::int64_t lo = 0, hi = seq.lk;
  if (p.mask.window_left >= 0) lo = std::max<std::int64_t>(0, i + offset - p.mask.window_left);
  const std::int64_t right = p.mask.causal ? 0 : p.mask.window_right;
  if (right >= 0) hi = std::min<std::int64_t>(seq.lk, i + offset + right + 1);
  return {lo, std::max(lo, hi)};
}

// Whether query position qp and key position kp share a chunk of mask.chunk_size positions
// (always, without chunks), by floor division.
bool same_chunk(const Problem& p, std::int64_t qp, std::int64_t kp) {
  if (!p.mask.chunk_size) return true;
  const std::int64_t c = *p.mask.chunk_size;
  const auto chunk = [c](std::int64_t x) { return x / c - (x % c < 0 ? 1 : 0); };
  return chunk(qp) == chunk(kp);
}

// The pair (query i, key j) of a sequence as a term sees it (term.hpp: queries stand for the key
// tokens they align with).
TokenPair token_pair(const Problem& p, const Sequence& seq, std::int64_t i, std::int64_t j) {
  TokenPair pair;
  pair.batch = seq.b;
  pair.sequence_start = seq.k0;
  pair.query_token = seq.k0 + seq.lk - seq.lq + i;
  pair.key_token = seq.k0 + j;
  pair.query_position = p.q_position(seq, i);
  pair.key_position = p.k_position(seq, j);
  return pair;
}

struct HeadProblem {
  std::vector<std::int64_t> qpos, kpos;
  Rows q, k, v;
};

HeadProblem load_head(const Problem& p, const Sequence& seq, std::int64_t h) {
  HeadProblem hp;
  const std::int64_t kvh = h / p.group_size, group = p.head_group[static_cast<std::size_t>(h)];
  for (std::int64_t i = 0; i < seq.lq; ++i) hp.qpos.push_back(p.q_position(seq, i));
  for (std::int64_t j = 0; j < seq.lk; ++j) hp.kpos.push_back(p.k_position(seq, j));
  hp.q = load_rows(p, p.spec->q, p.qg, seq.b, seq.q0, seq.lq, h);
  hp.k = load_rows(p, p.spec->k, p.kg, seq.b, seq.k0, seq.lk, kvh);
  hp.v = load_rows(p, p.spec->v, p.vg, seq.b, seq.k0, seq.lk, kvh);
  transform(p, group, true, hp.qpos, hp.q, false);
  temper(p, hp.qpos, hp.q);
  transform(p, group, false, hp.kpos, hp.k, false);
  return hp;
}

// The rows a term reads for the pair (query i, key j) of a head (term.hpp).
PairRows pair_rows(const Problem& p, const HeadProblem& hp, std::int64_t i, std::int64_t j, bool naive_f32,
                   TermScratch& scratch) {
  const auto d = static_cast<std::size_t>(p.dim);
  return {std::span<const double>(hp.q.row(i), d), std::span<const double>(hp.k.row(j), d), p.scale_f64, naive_f32,
          &scratch};
}

// Logits z (before the mask) and probabilities of one head, in T.
// scratch: one per term of the head's group, kept for the (sequence, head) (term.hpp).
template <class T>
void scores(const Problem& p, const Sequence& seq, std::int64_t h, const HeadProblem& hp, std::vector<T>& z,
            std::vector<T>& prob, std::vector<T>& lse, std::vector<TermScratch>& scratch) {
  const std::int64_t group = p.head_group[static_cast<std::size_t>(h)];
  const std::int64_t local = h - p.group_first_head[static_cast<std::size_t>(group)];
  const auto& bias = bias_of(p, group);
  const auto& terms = p.groups[static_cast<std::size_t>(group)].terms;
  const T scale = static_cast<T>(p.scale_f64), cap = static_cast<T>(p.mask.softcap);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  z.assign(static_cast<std::size_t>(seq.lq * seq.lk), T(0));
  // −0 marks a pair the row does not see (the mask); a visible probability is >= +0. Sums skip
  // the marked pairs, so an inf or NaN reaches only the rows that see it (docs/attention.md).
  prob.assign(z.size(), -T(0));
  lse.assign(static_cast<std::size_t>(seq.lq), neg_inf);
  for (std::int64_t i = 0; i < seq.lq; ++i) {
    const auto [lo, hi] = visible(p, seq, i);
    const auto sees = [&, lo = lo, hi = hi](std::int64_t j) {
      return j >= lo && j < hi &&
             same_chunk(p, hp.qpos[static_cast<std::size_t>(i)], hp.kpos[static_cast<std::size_t>(j)]);
    };
    T* zi = z.data() + i * seq.lk;
    for (std::int64_t j = 0; j < seq.lk; ++j) {
      T dot = 0;
      for (std::int64_t t = 0; t < p.dim; ++t) dot += static_cast<T>(hp.q.row(i)[t]) * static_cast<T>(hp.k.row(j)[t]);
      T x = scale * dot;
      if (bias) {
        x += static_cast<T>(
            bias_value(*bias, local, hp.qpos[static_cast<std::size_t>(i)], hp.kpos[static_cast<std::size_t>(j)]));
      }
      // Terms only where the mask lets the pair through: their value need not exist elsewhere
      // (a query's own token before the key's under a forget gate).
      if (sees(j)) {
        const TokenPair pair = token_pair(p, seq, i, j);
        for (std::size_t t = 0; t < terms.size(); ++t) {
          const PairRows rows = pair_rows(p, hp, i, j, std::is_same_v<T, float>, scratch[t]);
          x += static_cast<T>(terms[t]->row_value(local, pair, rows));
        }
      }
      zi[j] = cap > 0 ? cap * std::tanh(x / cap) : x;
    }
    // Sinks join the denominator as logits without a value (term.hpp).
    std::vector<T> sinks;
    for (const auto& term : terms) {
      if (const auto sink = term->sink(local)) sinks.push_back(static_cast<T>(*sink));
    }
    T m = neg_inf;
    bool nan = false;  // std::max drops a NaN; the row's softmax must not
    for (std::int64_t j = lo; j < hi; ++j) {
      if (!sees(j)) continue;
      m = std::max(m, zi[j]);
      nan = nan || std::isnan(zi[j]);
    }
    for (const T sink : sinks) m = std::max(m, sink);
    if (nan) m = std::numeric_limits<T>::quiet_NaN();
    if (m == neg_inf) continue;
    T l = 0;
    for (std::int64_t j = lo; j < hi; ++j) l += sees(j) ? std::exp(zi[j] - m) : T(0);
    for (const T sink : sinks) l += std::exp(sink - m);
    for (std::int64_t j = lo; j < hi; ++j) {
      // abs: a NaN keeps no sign bit, so that it is never taken for the −0 of an unseen pair.
      if (sees(j)) prob[static_cast<std::size_t>(i * seq.lk + j)] = std::abs(std::exp(zi[j] - m) / l);
    }
    lse[static_cast<std::size_t>(i)] = m + std::log(l);
  }
}

// A value rounded to bf16 through f32 (round to nearest even each time).
double bf16_rounded(double x) { return static_cast<double>(from_bf16(to_bf16(static_cast<float>(x)))); }

// The rows a bf16 implementation rounds: the scaled query (the fused engine scales q before its
// products), so q becomes bf16(scale·q)/scale, and the transformed key.
void round_products(const Problem& p, HeadProblem& hp) {
  for (double& x : hp.q.v) x = bf16_rounded(p.scale_f64 * x) / p.scale_f64;
  for (double& x : hp.k.v) x = bf16_rounded(x);
}

// bf16_products (T = float): the logits from the transformed queries and keys rounded to bf16,
// and the probabilities rounded to bf16 before P·V (reference.hpp).
template <class T>
void forward_impl(const Problem& p, TensorView out, TensorView lse, bool bf16_products = false) {
  const detail::HeadsGrid og = detail::check_output_tokens(kWhere, "out", ConstTensorView(out), p.out_grid());
  const bool want_lse = lse.rank() > 0;
  if (want_lse) check_lse(p, lse, true);
  for (const Sequence& seq : p.sequences) {
    for (std::int64_t h = 0; h < p.heads; ++h) {
      HeadProblem hp = load_head(p, seq, h);
      if (bf16_products) round_products(p, hp);
      const std::int64_t group = p.head_group[static_cast<std::size_t>(h)];
      const std::int64_t local = h - p.group_first_head[static_cast<std::size_t>(group)];
      const auto& terms = p.groups[static_cast<std::size_t>(group)].terms;
      std::vector<T> z, prob, l;
      std::vector<TermScratch> scratch(terms.size());
      scores<T>(p, seq, h, hp, z, prob, l, scratch);
      if (bf16_products) {
        for (T& x : prob) x = std::signbit(x) ? x : static_cast<T>(bf16_rounded(x));
      }
      Rows o{seq.lq, p.dim_v, std::vector<double>(static_cast<std::size_t>(seq.lq * p.dim_v))};
      std::vector<T> acc(static_cast<std::size_t>(p.dim_v)), value(acc.size());
      std::vector<double> w(acc.size());
      for (std::int64_t i = 0; i < seq.lq; ++i) {
        std::fill(acc.begin(), acc.end(), T(0));
        for (std::int64_t j = 0; j < seq.lk; ++j) {
          const T pij = prob[static_cast<std::size_t>(i * seq.lk + j)];
          if (std::signbit(pij)) continue;  // not seen
          for (std::int64_t t = 0; t < p.dim_v; ++t)
            value[static_cast<std::size_t>(t)] = static_cast<T>(hp.v.row(j)[t]);
          for (const auto& term : terms) {
            if (!term->adds_to_output()) continue;
            term->output_value(local, token_pair(p, seq, i, j), w);
            for (std::size_t t = 0; t < w.size(); ++t) value[t] += static_cast<T>(w[t]);
          }
          for (std::size_t t = 0; t < acc.size(); ++t) acc[t] += pij * value[t];
        }
        for (std::int64_t t = 0; t < p.dim_v; ++t) o.row(i)[t] = static_cast<double>(acc[static_cast<std::size_t>(t)]);
        if (want_lse)
          static_cast<float*>(lse.data())[lse_offset(p, lse, seq, h, i)] =
              static_cast<float>(l[static_cast<std::size_t>(i)]);
      }
      store_rows(p, o, out, og, seq.b, seq.q0, h, false);
    }
  }
}

}  // namespace

namespace {

// The reference against a quantized cache: the reference over k and v holding the dequantised
// values (exact in fp64: they are f32 values).
void forward_from_cache(const Attention& attention, TensorView out, TensorView lse, bool naive_f32) {
  const AttentionSpec& spec = attention.spec();
  const QuantizedCache& c = *spec.cache;
  const auto dequantised = [&](const QuantizedRows& r, std::vector<double>& values) {
    std::vector<float> row(static_cast<std::size_t>(r.dim));
    values.resize(static_cast<std::size_t>(r.batch * r.seq * r.heads * r.dim));
    double* at = values.data();
    for (std::int64_t b = 0; b < r.batch; ++b) {
      for (std::int64_t s = 0; s < r.seq; ++s) {
        for (std::int64_t h = 0; h < r.heads; ++h) {
          dequantize_rows(c.format,
                          static_cast<const char*>(r.data) + b * r.batch_stride + s * r.seq_stride + h * r.head_stride,
                          0, 1, r.dim, row.data());
          at = std::copy(row.begin(), row.end(), at);
        }
      }
    }
    return ConstTensorView::of(values.data(), {r.batch, r.seq, r.heads, r.dim});
  };
  std::vector<double> k, v;
  AttentionSpec plain = spec;
  plain.cache.reset();
  plain.k = dequantised(c.k, k);
  plain.v = dequantised(c.v, v);
  std::vector<double> q;
  if (spec.q.dtype() != DType::kF64) {
    // The reference reads each view in its own dtype, but a plan takes q, k and v in one: the
    // queries go to fp64 too (exactly), and the reference writes out in its own dtype.
    std::vector<std::int64_t> shape(static_cast<std::size_t>(spec.q.rank())), index(shape.size(), 0);
    for (int a = 0; a < spec.q.rank(); ++a) shape[static_cast<std::size_t>(a)] = spec.q.size(a);
    q.resize(static_cast<std::size_t>(spec.q.numel()));
    for (double& x : q) {
      std::int64_t offset = 0;
      for (std::size_t a = 0; a < shape.size(); ++a) offset += index[a] * spec.q.stride(static_cast<int>(a));
      x = detail::load(spec.q.data(), spec.q.dtype(), offset);
      for (std::size_t a = shape.size(); a-- > 0;) {
        if (++index[a] < shape[a]) break;
        index[a] = 0;
      }
    }
    plain.q = ConstTensorView::contiguous(q.data(), DType::kF64, shape);
  }
  attention_forward(Attention(std::move(plain)), out, lse, naive_f32);
}

}  // namespace

namespace {
// A call that a RowNormaliser runs: its fp64 definition (it has no naive f32 form).
const RowNormaliser* row_normaliser(const Attention& attention, bool naive_f32) {
  const std::vector<HeadGroup>& groups = attention.spec().groups;
  if (groups.size() != 1 || groups[0].normaliser == nullptr) return nullptr;
  if (naive_f32) {
    throw Error(kWhere, "naive_f32", "true",
                "false for " + std::string(groups[0].normaliser->name()) + " (its reference is fp64 only)");
  }
  return groups[0].normaliser.get();
}
}  // namespace

void attention_forward_bf16_products(const Attention& attention, TensorView out, TensorView lse) {
  if (row_normaliser(attention, false) != nullptr) {
    throw Error(kWhere, "groups[0].normaliser", std::string(attention.spec().groups[0].normaliser->name()),
                "the softmax (bf16 products are the softmax engine's)");
  }
  if (attention.spec().cache) {
    throw Error(kWhere, "cache", std::string(cache_format_name(attention.spec().cache->format)),
                "k and v tensors (bf16 products need bf16 inputs)");
  }
  forward_impl<float>(problem_of(attention), out, lse, true);
}

void attention_forward(const Attention& attention, TensorView out, TensorView lse, bool naive_f32) {
  if (const RowNormaliser* n = row_normaliser(attention, naive_f32)) {
    n->forward(attention.spec(), out, lse, true);
    return;
  }
  if (attention.spec().cache) {
    forward_from_cache(attention, out, lse, naive_f32);
    return;
  }
  const Problem p = problem_of(attention);
  // Writes any dtype (f64 outputs keep the reference unrounded).
  if (naive_f32) {
    forward_impl<float>(p, out, lse);
  } else {
    forward_impl<double>(p, out, lse);
  }
}

namespace {

// bf16_products: the transformed queries and keys rounded to bf16, and the probabilities and
// dS rounded to bf16 before the products that take them (dV, dK, dQ); fp64 otherwise. The
// parameters' and terms' gradients take dS as it is.
void backward_impl(const Attention& attention, ConstTensorView out, ConstTensorView lse, ConstTensorView d_out,
                   TensorView dq, TensorView dk, TensorView dv, AttentionGradients* grads, bool bf16_products) {
  if (attention.spec().cache) {
    throw Error(kWhere, "cache", std::string(cache_format_name(attention.spec().cache->format)),
                "k and v tensors for backward (a quantized cache has no gradient)");
  }
  const Problem p = problem_of(attention);
  const char* where = kWhere;
  detail::check_output_tokens(where, "out", out, p.out_grid());
  const detail::HeadsGrid dog = detail::check_output_tokens(where, "d_out", d_out, p.out_grid());
  check_lse(p, lse, false);
  const bool want_dq = dq.rank() > 0, want_dk = dk.rank() > 0, want_dv = dv.rank() > 0;
  detail::HeadsGrid dqg, dkg, dvg;
  if (want_dq) dqg = detail::check_output_tokens(where, "dq", ConstTensorView(dq), p.qg);
  if (want_dk) dkg = detail::check_output_tokens(where, "dk", ConstTensorView(dk), p.kg);
  if (want_dv) dvg = detail::check_output_tokens(where, "dv", ConstTensorView(dv), p.vg);
  if (grads != nullptr) check_gradients(attention, *grads);
  const double scale = p.scale_f64, cap = p.mask.softcap;
  // Each group's term gradients (empty without grads: the terms' dq and dk are still wanted).
  std::vector<std::vector<std::span<double>>> grad_spans(p.groups.size());
  for (std::size_t g = 0; g < p.groups.size(); ++g) {
    for (std::size_t t = 0; t < p.groups[g].terms.size(); ++t)
      grad_spans[g].emplace_back(grads != nullptr ? std::span<double>(grads->groups[g].terms[t]) : std::span<double>{});
  }
  for (const Sequence& seq : p.sequences) {
    const std::int64_t lq = seq.lq, lk = seq.lk;
    // dS per group, materialised for the schemes' reference backwards: [heads, lq, lk].
    std::vector<std::vector<double>> ds_groups(p.groups.size());
    for (std::size_t g = 0; g < p.groups.size(); ++g) {
      ds_groups[g].assign(static_cast<std::size_t>(p.groups[g].heads * lq * lk), 0.0);
    }
    for (std::int64_t kvh = 0; kvh < p.kv_heads; ++kvh) {
      Rows dk_t{lk, p.dim, std::vector<double>(static_cast<std::size_t>(lk * p.dim))};
      Rows dv_acc{lk, p.dim_v, std::vector<double>(static_cast<std::size_t>(lk * p.dim_v))};
      std::vector<std::int64_t> kpos;
      for (std::int64_t g = 0; g < p.group_size; ++g) {
        const std::int64_t h = kvh * p.group_size + g;
        const std::int64_t group = p.head_group[static_cast<std::size_t>(h)];
        HeadProblem hp = load_head(p, seq, h);
        if (bf16_products) round_products(p, hp);
        kpos = hp.kpos;
        std::vector<double> z, prob, l;
        std::vector<TermScratch> scratch(p.groups[static_cast<std::size_t>(group)].terms.size());
        scores<double>(p, seq, h, hp, z, prob, l, scratch);
        const Rows dout = load_rows(p, d_out, dog, seq.b, seq.q0, lq, h);
        Rows dq_t{lq, p.dim, std::vector<double>(static_cast<std::size_t>(lq * p.dim))};
        const std::int64_t local = h - p.group_first_head[static_cast<std::size_t>(group)];
        const auto& terms = p.groups[static_cast<std::size_t>(group)].terms;
        const auto& term_grads = grad_spans[static_cast<std::size_t>(group)];
        std::vector<double> w(static_cast<std::size_t>(p.dim_v));
        for (std::int64_t i = 0; i < lq; ++i) {
          std::vector<double> dp(static_cast<std::size_t>(lk));
          double delta = 0;
          for (std::int64_t j = 0; j < lk; ++j) {
            if (std::signbit(prob[static_cast<std::size_t>(i * lk + j)])) continue;  // not seen
            double acc = 0;
            for (std::int64_t t = 0; t < p.dim_v; ++t) acc += dout.row(i)[t] * hp.v.row(j)[t];
            for (std::size_t t = 0; t < terms.size(); ++t) {  // a term's w joins the value: dp += ⟨dO, w⟩
              if (!terms[t]->adds_to_output()) continue;
              const TokenPair pair = token_pair(p, seq, i, j);
              terms[t]->output_value(local, pair, w);
              for (std::int64_t e = 0; e < p.dim_v; ++e) acc += dout.row(i)[e] * w[static_cast<std::size_t>(e)];
              if (grads != nullptr) {
                terms[t]->accumulate_output_gradient(
                    local, pair, prob[static_cast<std::size_t>(i * lk + j)],
                    std::span<const double>(dout.row(i), static_cast<std::size_t>(p.dim_v)), term_grads[t]);
              }
            }
            dp[static_cast<std::size_t>(j)] = acc;
            delta += prob[static_cast<std::size_t>(i * lk + j)] * acc;
          }
          if (grads != nullptr) {  // a sink: ∂L/∂s = p_sink·(0 − δ), its value being 0
            for (std::size_t t = 0; t < terms.size(); ++t) {
              const auto sink = terms[t]->sink(local);
              if (!sink || std::isinf(l[static_cast<std::size_t>(i)])) continue;
              terms[t]->accumulate_sink_gradient(local, -std::exp(*sink - l[static_cast<std::size_t>(i)]) * delta,
                                                 term_grads[t]);
            }
          }
          for (std::int64_t j = 0; j < lk; ++j) {
            const double pij = prob[static_cast<std::size_t>(i * lk + j)];
            if (std::signbit(pij)) continue;  // not seen (a visible 0 still multiplies, as 0 · NaN must)
            double dx = pij * (dp[static_cast<std::size_t>(j)] - delta);
            if (cap > 0) {
              const double u = z[static_cast<std::size_t>(i * lk + j)] / cap;
              dx *= 1 - u * u;
            }
            ds_groups[static_cast<std::size_t>(group)][static_cast<std::size_t>((local * lq + i) * lk + j)] = dx;
            const double dx_used = bf16_products ? bf16_rounded(dx) : dx,
                         p_used = bf16_products ? bf16_rounded(pij) : pij;
            for (std::int64_t t = 0; t < p.dim; ++t) {
              dq_t.row(i)[t] += scale * dx_used * hp.k.row(j)[t];
              dk_t.row(j)[t] += scale * dx_used * hp.q.row(i)[t];
            }
            for (std::int64_t t = 0; t < p.dim_v; ++t) dv_acc.row(j)[t] += p_used * dout.row(i)[t];
            if (!terms.empty()) {
              const TokenPair pair = token_pair(p, seq, i, j);
              const auto d = static_cast<std::size_t>(p.dim);
              for (std::size_t t = 0; t < terms.size(); ++t) {
                const PairRows rows = pair_rows(p, hp, i, j, false, scratch[t]);
                terms[t]->accumulate_row_gradient(local, pair, rows, dx, term_grads[t],
                                                  std::span<double>(dq_t.row(i), d), std::span<double>(dk_t.row(j), d));
              }
            }
          }
        }
        if (grads != nullptr) {
          for (std::size_t t = 0; t < terms.size(); ++t)
            terms[t]->finish_row_gradients(local, scratch[t], term_grads[t]);
        }
        if (want_dq) {
          temper(p, hp.qpos, dq_t);
          transform(p, group, true, hp.qpos, dq_t, true);
          store_rows(p, dq_t, dq, dqg, seq.b, seq.q0, h, true);
        }
      }
      const std::int64_t group0 = p.head_group[static_cast<std::size_t>(kvh * p.group_size)];
      if (want_dk) {
        transform(p, group0, false, kpos, dk_t, true);
        store_rows(p, dk_t, dk, dkg, seq.b, seq.k0, kvh, true);
      }
      if (want_dv) store_rows(p, dv_acc, dv, dvg, seq.b, seq.k0, kvh, true);
    }
    if (grads == nullptr) continue;
    std::vector<std::int64_t> qpos, kpos;
    for (std::int64_t i = 0; i < lq; ++i) qpos.push_back(p.q_position(seq, i));
    for (std::int64_t j = 0; j < lk; ++j) kpos.push_back(p.k_position(seq, j));
    const Positions qp = Positions::ids(qpos), kp = Positions::ids(kpos);
    for (std::size_t g = 0; g < p.groups.size(); ++g) {
      const auto& bias = p.groups[g].bias;
      if (!bias || lq * lk == 0) continue;
      const ConstTensorView ds = TensorView::of(ds_groups[g].data(), {p.groups[g].heads, lq, lk});
      GroupGradients& gg = grads->groups[g];
      // The sequence's gradient on its own, then added: sequences sum in order.
      std::vector<double> flat(gg.bias.size(), 0.0);
      ref::bias_backward(*bias, qp, kp, ds, flat);
      for (std::size_t t = 0; t < flat.size(); ++t) gg.bias[t] += flat[t];
    }
  }
}

}  // namespace

void attention_backward(const Attention& attention, ConstTensorView out, ConstTensorView lse, ConstTensorView d_out,
                        TensorView dq, TensorView dk, TensorView dv, AttentionGradients* grads, ConstTensorView d_lse) {
  if (const RowNormaliser* n = row_normaliser(attention, false)) {
    n->backward(attention.spec(), out, lse, d_lse, d_out, dq, dk, dv, grads != nullptr ? &grads->groups.at(0) : nullptr,
                true);
    return;
  }
  if (d_lse.rank() > 0) throw Error(kWhere, "d_lse", d_lse.describe(), "empty (the softmax's lse takes no gradient)");
  backward_impl(attention, out, lse, d_out, dq, dk, dv, grads, false);
}

void attention_backward_bf16_products(const Attention& attention, ConstTensorView out, ConstTensorView lse,
                                      ConstTensorView d_out, TensorView dq, TensorView dk, TensorView dv) {
  if (row_normaliser(attention, false) != nullptr) {
    throw Error(kWhere, "groups[0].normaliser", std::string(attention.spec().groups[0].normaliser->name()),
                "the softmax (bf16 products are the softmax engine's)");
  }
  backward_impl(attention, out, lse, d_out, dq, dk, dv, nullptr, true);
}

}  // namespace posenc::ref
