// Forgetting Attention (forgetting.hpp): the gate's fp64 definition and its fused score term.
#include "posenc/forgetting.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attention/engine.hpp"
#include "attention/score_term.hpp"
#include "schemes/fused_terms.hpp"
#include "internal.hpp"
#include "posenc/error.hpp"
#include "posenc/registry.hpp"

namespace posenc {
namespace {

constexpr const char* kWhere = "ForgetGate";

// Element offset of (batch, token, head) in the view ([B, S, H] or packed [T, H]).
std::int64_t gate_offset(ConstTensorView v, std::int64_t batch, std::int64_t token, std::int64_t head) {
  if (v.rank() == 2) return token * v.stride(0) + head * v.stride(1);
  return batch * v.stride(0) + token * v.stride(1) + head * v.stride(2);
}

// The gate at (batch, token) of every head, widened to fp64 (the dtype resolved once per row).
void gate_row(ConstTensorView v, std::int64_t batch, std::int64_t token, double* out) {
  const std::int64_t heads = v.size(v.rank() - 1), hs = v.stride(v.rank() - 1);
  const std::int64_t base = gate_offset(v, batch, token, 0);
  switch (v.dtype()) {
    case DType::kF32: {
      const float* p = static_cast<const float*>(v.data()) + base;
      for (std::int64_t h = 0; h < heads; ++h) out[h] = p[h * hs];
      return;
    }
    case DType::kF64: {
      const double* p = static_cast<const double*>(v.data()) + base;
      for (std::int64_t h = 0; h < heads; ++h) out[h] = p[h * hs];
      return;
    }
    default:
      for (std::int64_t h = 0; h < heads; ++h) out[h] = detail::load(v.data(), v.dtype(), base + h * hs);
  }
}

}  // namespace

ForgetGate::ForgetGate(ConstTensorView log_fgate) : log_fgate_(log_fgate) {
  if (log_fgate.rank() != 2 && log_fgate.rank() != 3) {
    throw Error(kWhere, "log_fgate", log_fgate.describe(), "[B, Sk, heads] or packed [Tk, heads]");
  }
  if (log_fgate.size(log_fgate.rank() - 1) < 1) {
    throw Error(kWhere, "log_fgate", log_fgate.describe(), "at least one head");
  }
  const std::int64_t batch = log_fgate.rank() == 3 ? log_fgate.size(0) : 1;
  const std::int64_t tokens = log_fgate.size(log_fgate.rank() - 2), heads = this->heads();
  std::vector<double> row(static_cast<std::size_t>(heads));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t t = 0; t < tokens; ++t) {
      gate_row(log_fgate, b, t, row.data());
      for (std::int64_t h = 0; h < heads; ++h) {
        const double x = row[static_cast<std::size_t>(h)];
        if (x > 0) {  // NaN and −inf pass: they propagate as the composition gives them
          const std::string at = log_fgate.rank() == 3 ? "[" + std::to_string(b) + ", " + std::to_string(t) + ", " +
                                                             std::to_string(h) + "]"
                                                       : "[" + std::to_string(t) + ", " + std::to_string(h) + "]";
          throw Error(kWhere, "log_fgate", at + " = " + detail::to_text(x),
                      "<= 0 (the log of a forget gate in (0, 1], e.g. logsigmoid of its logit)");
        }
      }
    }
  }
}

double ForgetGate::log_gate(std::int64_t batch, std::int64_t token, std::int64_t head) const {
  return detail::load(log_fgate_.data(), log_fgate_.dtype(), gate_offset(log_fgate_, batch, token, head));
}

// c(q) − c(k) with c the running sum from the sequence's first token, as the composition sums it.
double ForgetGate::value(std::int64_t head, const TokenPair& pair) const {
  double cq = 0, ck = 0;
  for (std::int64_t l = pair.sequence_start; l <= pair.query_token; ++l) cq += log_gate(pair.batch, l, head);
  for (std::int64_t l = pair.sequence_start; l <= pair.key_token; ++l) ck += log_gate(pair.batch, l, head);
  return cq - ck;
}

// ∂(c(q) − c(k))/∂ log f_l = [l <= q] − [l <= k]: +1 on (k, q], −1 on (q, k].
void ForgetGate::accumulate_gradient(std::int64_t head, const TokenPair& pair, double weight,
                                     std::span<double> grads) const {
  const std::int64_t tokens = log_fgate_.size(log_fgate_.rank() - 2), heads = this->heads();
  const std::int64_t row = log_fgate_.rank() == 3 ? pair.batch * tokens : 0;
  const std::int64_t lo = std::min(pair.query_token, pair.key_token), hi = std::max(pair.query_token, pair.key_token);
  const double sign = pair.query_token >= pair.key_token ? 1.0 : -1.0;
  for (std::int64_t l = lo + 1; l <= hi; ++l)
    grads[static_cast<std::size_t>((row + l) * heads + head)] += sign * weight;
  // The eager composition (c = cumsum(log f), D = c_i − c_j) also sends the weight to the gates at
  // or before the earlier token, once with each sign: exactly 0 for a finite weight, NaN for a
  // non-finite one — as autograd (and the fused row and column sums) give it.
  if (!std::isfinite(weight)) {
    for (std::int64_t l = pair.sequence_start; l <= lo; ++l)
      grads[static_cast<std::size_t>((row + l) * heads + head)] += weight - weight;
  }
}

namespace detail {
namespace {

// The fused form: c per (key token, head) in fp64 once per call; the tiles add c_i − c_j, each
// rounded once (forgetting.hpp); backward sums dS by rows and columns into the unit's slot
// [key of the sequence][head of the KV group] (fp64), and reduce() takes the reverse running sums.
class ForgetTerm final : public ScoreTerm {
 public:
  ForgetTerm(const ForgetGate& gate, const AttentionPlan& p, std::int64_t group, std::int64_t index);

  std::int64_t bytes() const override { return static_cast<std::int64_t>(c_.size() * sizeof(double)); }
  // c_i − c_j <= 0 for every key at or before the query, the only keys it lets through.
  bool keeps_tile_bound() const override { return true; }
  // The decay reads the keys' tokens (c of the running sum), not their positions.
  bool reads_key_positions() const override { return false; }
  // Over keys [k_first, k_last] the decay c_i − c_j is largest at the last key (c does not grow).
  double tile_max(const Sequence& seq, std::int64_t h, std::int64_t i, std::int64_t /* k_first */,
                  std::int64_t k_last) const override {
    return ours(h) ? c(seq, query_key(seq, i), h) - c(seq, k_last, h) : 0.0;
  }
  bool steep(std::int64_t h) const override {
    return ours(h) && steep_[static_cast<std::size_t>(h - first_head_)] != 0;
  }
  void add_scores(const TermTile& tile, float* st, TermState& s) const override;

  std::int64_t unit_gradient_size() const override { return max_keys_ * p_.group_size; }
  void begin_backward(const TermRows& rows, double* unit_grads, TermState& s) const override {
    s.rows = rows;
    s.unit_grads = unit_grads;
    if (unit_grads != nullptr) row_sums(s).assign(static_cast<std::size_t>(rows.rows->width), 0.0);
  }
  void backward_tile(const TermTile& tile, const float* pt, const float* dst, TermState& s) const override;
  void finish_backward(TermState& s) const override;
  void reduce(std::span<const TermUnit> units, AttentionGradients& grads) const override;

 private:
  bool ours(std::int64_t h) const { return h >= first_head_ && h < first_head_ + heads_; }
  // c of key j of `seq` and head h (fp64).
  double c(const Sequence& seq, std::int64_t j, std::int64_t h) const {
    return c_[static_cast<std::size_t>((seq.b * p_.k_len + seq.k0 + j) * heads_ + (h - first_head_))];
  }
  std::int64_t query_key(const Sequence& seq, std::int64_t i) const { return seq.lk - seq.lq + i; }
  // Backward: Σ_j dS per row of the block (s.doubles holds the rows' c in add_scores).
  static std::vector<double>& row_sums(TermState& s) { return s.more_doubles; }

  const AttentionPlan& p_;
  std::int64_t group_ = 0, index_ = 0, first_head_ = 0, heads_ = 0, max_keys_ = 0;
  std::vector<double> c_;    // [key tokens of the grid][heads]
  std::vector<char> steep_;  // per head: the decay across some sequence is below −100
};

ForgetTerm::ForgetTerm(const ForgetGate& gate, const AttentionPlan& p, std::int64_t group, std::int64_t index)
    : p_(p), group_(group), index_(index) {
  const std::string name = "groups[" + std::to_string(group) + "].terms[" + std::to_string(index) + "]";
  const ConstTensorView v = gate.log_fgate();
  first_head_ = p.group_first_head[static_cast<std::size_t>(group)];
  heads_ = p.spec.groups[static_cast<std::size_t>(group)].heads;
  const bool shape_ok =
      p.packed ? v.rank() == 2 && v.size(0) == p.k_len : v.rank() == 3 && v.size(0) == p.batch && v.size(1) == p.k_len;
  if (!shape_ok) {
    throw Error(AttentionPlan::kWhere, (name + ".log_fgate").c_str(), v.describe(),
                p.packed
                    ? "[" + std::to_string(p.k_len) + ", heads] (the packed keys' tokens)"
                    : "[" + std::to_string(p.batch) + ", " + std::to_string(p.k_len) + ", heads] (the keys' grid)");
  }
  if (gate.heads() != heads_) {
    throw Error(AttentionPlan::kWhere, (name + ".heads").c_str(), std::to_string(gate.heads()),
                std::to_string(heads_) + " (the group's heads)");
  }
  // Every visible key at or before its query: a causal mask, or one query per sequence at the end
  // of its keys (decode), which sees no later key under any mask.
  const bool single_queries =
      std::all_of(p.sequences.begin(), p.sequences.end(), [](const Sequence& seq) { return seq.lq <= 1; });
  if (p.window_right != 0 && !single_queries) {
    throw Error(AttentionPlan::kWhere, (name + " (forget gate) mask").c_str(),
                "window_right " + std::to_string(p.window_right),
                "a causal mask: the decay Σ log f is defined for keys at or before the query");
  }
  for (const Sequence& seq : p.sequences) {
    max_keys_ = std::max(max_keys_, seq.lk);
    if (seq.lq > seq.lk) {
      throw Error(AttentionPlan::kWhere, (name + " (forget gate) queries").c_str(),
                  std::to_string(seq.lq) + " queries against " + std::to_string(seq.lk) + " keys in a sequence",
                  "at most as many queries as keys: query i is the key token Lk − Lq + i");
    }
  }
  c_.assign(static_cast<std::size_t>(p.batch * p.k_len * heads_), 0.0);
  steep_.assign(static_cast<std::size_t>(heads_), 0);
  // Key by key, every head's running sum at once: the gate's rows and c_'s are read in order.
  const auto n_heads = static_cast<std::size_t>(heads_);
  std::vector<double> row(static_cast<std::size_t>(gate.heads())), running(n_heads), first(n_heads);
  for (const Sequence& seq : p.sequences) {
    std::fill(running.begin(), running.end(), 0.0);
    for (std::int64_t j = 0; j < seq.lk; ++j) {
      gate_row(gate.log_fgate(), seq.b, seq.k0 + j, row.data());
      double* cj = c_.data() + (seq.b * p.k_len + seq.k0 + j) * heads_;
      for (std::size_t h = 0; h < n_heads; ++h) cj[h] = running[h] += row[h];
      if (j == 0) std::copy(row.begin(), row.begin() + heads_, first.begin());
    }
    for (std::size_t h = 0; seq.lk > 0 && h < n_heads; ++h) {
      if (running[h] - first[h] < -100.0) steep_[h] = 1;
    }
  }
}

// st[j][r] += D_ij = c_i − c_j, the difference taken in fp64 and rounded once, as the reference
// rounds it (a difference of two f32 offsets from a common c would round twice, each time to
// the precision of the decay across the tile rather than of D_ij: near the diagonal, where the
// probabilities are, that gives 4–10× the naive f32 error).
void ForgetTerm::add_scores(const TermTile& tile, float* st, TermState& s) const {
  const RowBlock& rb = *tile.rows;
  const Sequence& seq = *tile.seq;
  const std::int64_t w = rb.width, keys = tile.keys, k0 = tile.k0;
  std::vector<double>& ci = s.doubles;
  if (static_cast<std::int64_t>(ci.size()) < w) ci.resize(static_cast<std::size_t>(w));
  if (tile.decode || rb.compact) {
    // Few rows of mixed heads: keys outer, so that each key's c of every head (one row of c_) and
    // its scores (one row of S^T) are read in order.
    std::vector<std::int64_t>& local = s.heads;
    local.assign(static_cast<std::size_t>(w), -1);
    for (std::int64_t r = 0; r < w; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      if (h < 0 || !ours(h)) continue;
      local[static_cast<std::size_t>(r)] = h - first_head_;
      ci[static_cast<std::size_t>(r)] = c(seq, query_key(seq, rb.query[static_cast<std::size_t>(r)]), h);
    }
    // Runs of rows on consecutive heads (one query per head: every row of a decode block) read
    // consecutive doubles of each key's row of c_.
    const double* c_tile = c_.data() + (seq.b * p_.k_len + seq.k0 + k0) * heads_;
    for (std::int64_t r = 0; r < w;) {
      const std::int64_t lh = local[static_cast<std::size_t>(r)];
      std::int64_t n = 1;
      if (lh < 0) {
        ++r;
        continue;
      }
      while (r + n < w && local[static_cast<std::size_t>(r + n)] == lh + n) ++n;
      kernels::attn_add_head_differences(st, keys, w, r, n, ci.data(), c_tile + lh, heads_);
      r += n;
    }
    // The next tile's rows of c_ (up to the sequence's last key): the cache's stream evicts them
    // from L2 between tiles, and the add would wait on memory.
    const std::int64_t next = (seq.b * p_.k_len + seq.k0 + k0 + keys) * heads_;
    const std::int64_t end = std::min((seq.b * p_.k_len + seq.k0 + seq.lk) * heads_, next + keys * heads_);
    for (std::int64_t at = next; at < end; at += 8) __builtin_prefetch(c_.data() + at, 0, 2);
    return;
  }
  for_each_head_run(
      rb, [&](std::int64_t h) { return ours(h); },
      [&](std::int64_t ra, std::int64_t n, std::int64_t h) {
        for (std::int64_t r = ra; r < ra + n; ++r) {
          const std::int64_t i = rb.query[static_cast<std::size_t>(r)];
          // Padding rows (masked later) take the first key's c: a finite 0 for finite gates.
          ci[static_cast<std::size_t>(r)] = c(seq, i < 0 ? k0 : query_key(seq, i), h);
        }
        thread_local std::vector<double> cj;  // the tile's keys' c (more_doubles holds backward's row sums)
        cj.resize(static_cast<std::size_t>(keys));
        for (std::int64_t j = 0; j < keys; ++j) cj[static_cast<std::size_t>(j)] = c(seq, k0 + j, h);
        kernels::attn_add_differences(st, keys, w, ra, n, ci.data(), cj.data());
      });
}

// Row sums into the state (per row of the block), column sums into the slot (per key and head).
void ForgetTerm::backward_tile(const TermTile& tile, const float* /* pt */, const float* dst, TermState& s) const {
  if (s.unit_grads == nullptr) return;
  const RowBlock& sub = *tile.rows;
  const std::int64_t bw = sub.width, g_count = p_.group_size;
  for (std::int64_t r = 0; r < bw; ++r) {
    const std::int64_t h = sub.head[static_cast<std::size_t>(r)];
    if (h < 0 || !ours(h)) continue;
    double sum = 0;
    for (std::int64_t j = 0; j < tile.keys; ++j) sum += dst[j * bw + r];
    row_sums(s)[static_cast<std::size_t>(tile.r0 + r)] += sum;
  }
  for_each_head_run(
      sub, [&](std::int64_t h) { return ours(h); },
      [&](std::int64_t ra, std::int64_t n, std::int64_t h) {
        double* slot = s.unit_grads + (h - s.rows.kvh * g_count);
        for (std::int64_t j = 0; j < tile.keys; ++j) {
          const float* row = dst + j * bw;
          double sum = 0;
          for (std::int64_t r = ra; r < ra + n; ++r) sum += row[r];
          slot[(tile.k0 + j) * g_count] -= sum;
        }
      });
}

void ForgetTerm::finish_backward(TermState& s) const {
  if (s.unit_grads == nullptr) return;
  const RowBlock& rb = *s.rows.rows;
  const Sequence& seq = *s.rows.seq;
  const std::int64_t g_count = p_.group_size;
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0 || !ours(h)) continue;
    const std::int64_t t = query_key(seq, rb.query[static_cast<std::size_t>(r)]);
    s.unit_grads[t * g_count + (h - s.rows.kvh * g_count)] += row_sums(s)[static_cast<std::size_t>(r)];
  }
}

// dc per (token, head) from the units in order, then d log f_l = Σ_{t >= l} dc_t per sequence.
void ForgetTerm::reduce(std::span<const TermUnit> units, AttentionGradients& grads) const {
  const std::int64_t g_count = p_.group_size;
  std::vector<double> dc(c_.size(), 0.0);
  for (const TermUnit& unit : units) {
    const Sequence& seq = *unit.seq;
    for (std::int64_t g = 0; g < g_count; ++g) {
      const std::int64_t h = unit.kvh * g_count + g;
      if (!ours(h)) continue;
      for (std::int64_t t = 0; t < seq.lk; ++t) {
        dc[static_cast<std::size_t>((seq.b * p_.k_len + seq.k0 + t) * heads_ + (h - first_head_))] +=
            unit.slot[t * g_count + g];
      }
    }
  }
  std::vector<double>& out = grads.groups[static_cast<std::size_t>(group_)].terms[static_cast<std::size_t>(index_)];
  for (const Sequence& seq : p_.sequences) {
    for (std::int64_t h = 0; h < heads_; ++h) {
      double running = 0;
      for (std::int64_t t = seq.lk - 1; t >= 0; --t) {
        const auto at = static_cast<std::size_t>((seq.b * p_.k_len + seq.k0 + t) * heads_ + h);
        running += dc[at];
        out[at] += running;
      }
    }
  }
}

}  // namespace
}  // namespace detail

std::unique_ptr<detail::ScoreTerm> detail::fused_form(const ForgetGate& gate, const AttentionPlan& plan,
                                                      std::int64_t group, std::int64_t index) {
  return std::make_unique<ForgetTerm>(gate, plan, group, index);
}

namespace scheme_entries {

// Forgetting Attention as a group's whole scheme (the paper's FoX, with no positional scheme);
// beside another scheme on the same heads ("FoX Pro": RoPE) the gate is one of HeadGroup::terms.
SchemeEntry forgetting_entry() {
  SchemeEntry e{
      .name = "forgetting",
      .aliases = {"fox"},
      .family = "token-term",
      .summary = "x_ij += Σ_{l=j+1..i} log f_l: a per-token, per-head forget gate f = σ(w_f·x + b_f) decays older keys",
      .source = "Lin, Nikishin, He and Courville 2025, Forgetting Transformer: Softmax Attention with a Forget Gate",
      .options = {},
      .parameters = "",
      .parameter_shape = [](const SchemeArgs&) { return std::vector<std::int64_t>{}; },
      .make =
          [](const SchemeArgs& a) {
            HeadGroup g{a.heads, {}, {}};
            g.terms = {std::make_shared<const ForgetGate>(a.input("log_fgate"))};
            return g;
          }};
  // log σ of gate logits spread over [1, 5]: gates of 0.73 to 0.99, as a trained FoX's (its
  // forget-gate bias starts them near 1).
  e.inputs = {{"log_fgate", "log forget gate [B, Sk, heads] ([Tk, heads] packed), each <= 0",
               [](double u) { return -std::log1p(std::exp(-(1.0 + 4.0 * u))); }, true, "sum_after_key"}};
  // The entry's gate is the group's first term (the attention's sinks argument appends its own).
  e.input_gradients_of = [](const GroupGradients& g) {
    return std::vector<std::vector<double>>{g.terms.empty() ? std::vector<double>{} : g.terms[0]};
  };
  e.causal_only = true;
  return e;
}

}  // namespace scheme_entries
}  // namespace posenc
