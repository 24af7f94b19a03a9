// Stick-breaking and CoPE as registered schemes: RowNormalisers (attention.hpp) that run an
// Attention call on their own engines (stickbreaking.hpp, cope.hpp), and their registry entries.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/cope.hpp"
#include "posenc/dtype.hpp"
#include "posenc/error.hpp"
#include "posenc/reference.hpp"
#include "posenc/registry.hpp"
#include "posenc/stickbreaking.hpp"
#include "internal.hpp"

namespace posenc {
namespace {

// Attention's row statistic [B, H, Sq] (packed [H, Tq]) as the row engines index theirs, [B, Sq, H]
// ([Tq, H]): the same memory through permuted strides. Another rank stays as it is, for the
// engine to refuse by name.
template <class View>
View rows_of(View stat) {
  if (stat.rank() == 3) {
    const std::int64_t shape[3] = {stat.size(0), stat.size(2), stat.size(1)};
    const std::int64_t strides[3] = {stat.stride(0), stat.stride(2), stat.stride(1)};
    return View(stat.data(), stat.dtype(), shape, strides);
  }
  if (stat.rank() == 2) {
    const std::int64_t shape[2] = {stat.size(1), stat.size(0)};
    const std::int64_t strides[2] = {stat.stride(1), stat.stride(0)};
    return View(stat.data(), stat.dtype(), shape, strides);
  }
  return stat;
}

bool is_16_bit(DType dt) { return dt == DType::kBF16 || dt == DType::kF16; }

// Both backwards read out in the sums their positions carry leftwards (stick-breaking's G − Σ g,
// CoPE's Δ = d_out·out inside Σ dp), where a 16-bit out's rounding reaches every key a row sees
// (stickbreaking.hpp): for 16-bit inputs the forward runs again into an f32 out, which backward
// reads instead. `forward(out)` runs it; `backward(out)` is the backward given an out.
template <class Forward, class Backward>
AttentionStats with_wide_out(ConstTensorView out, const Forward& forward, const Backward& backward) {
  if (out.rank() == 0 || !is_16_bit(out.dtype())) return backward(out);
  std::vector<std::int64_t> shape(static_cast<std::size_t>(out.rank()));
  for (int a = 0; a < out.rank(); ++a) shape[static_cast<std::size_t>(a)] = out.size(a);
  const std::int64_t count = out.numel();
  std::vector<float> wide(static_cast<std::size_t>(count));
  const TensorView wide_out = TensorView::contiguous(wide.data(), DType::kF32, shape);
  AttentionStats stats = forward(wide_out);
  const AttentionStats back = backward(ConstTensorView(wide_out));
  stats.workspace_bytes =
      std::max(stats.workspace_bytes, back.workspace_bytes) + count * static_cast<std::int64_t>(sizeof(float));
  stats.tiles += back.tiles;
  stats.skipped += back.skipped;
  return stats;
}

// A view's values widened to a contiguous f64 buffer of its shape.
struct Widened {
  std::vector<double> values;
  std::vector<std::int64_t> shape;
  ConstTensorView view() const { return ConstTensorView::contiguous(values.data(), DType::kF64, shape); }
};
Widened widened(ConstTensorView x) {
  Widened w;
  for (int a = 0; a < x.rank(); ++a) w.shape.push_back(x.size(a));
  w.values.resize(static_cast<std::size_t>(x.numel()));
  std::vector<std::int64_t> index(w.shape.size(), 0);
  for (std::size_t i = 0; i < w.values.size(); ++i) {
    std::int64_t offset = 0;
    for (std::size_t a = 0; a < index.size(); ++a) offset += index[a] * x.stride(static_cast<int>(a));
    w.values[i] = detail::load(x.data(), x.dtype(), offset);
    for (std::size_t a = index.size(); a-- > 0;) {
      if (++index[a] < w.shape[a]) break;
      index[a] = 0;
    }
  }
  return w;
}

// The fp64 reference writes an f64 out for inputs of any dtype, as Attention's does: it then runs
// on the inputs widened to f64 (the same values, so the same sums).
template <class Run>
void reference_forward(const AttentionSpec& spec, TensorView out, const Run& run) {
  if (out.dtype() != DType::kF64 || spec.q.dtype() == DType::kF64) {
    run(spec);
    return;
  }
  const Widened q = widened(spec.q), k = widened(spec.k), v = widened(spec.v);
  AttentionSpec wide = spec;
  wide.q = q.view();
  wide.k = k.view();
  wide.v = v.view();
  run(wide);
}

class StickBreakingRows final : public RowNormaliser {
 public:
  explicit StickBreakingRows(bool attend_current) : attend_current_(attend_current) {}
  std::string_view name() const override { return "stickbreaking"; }
  bool attend_current() const { return attend_current_; }
  void check(const AttentionSpec& spec) const override { (void)StickBreakingAttention(spec_of(spec)); }

  // The statistic is rem, the stick left over, and d_stat its gradient.
  AttentionStats forward(const AttentionSpec& spec, TensorView out, TensorView stat, bool reference) const override {
    if (reference) {
      reference_forward(spec, out, [&](const AttentionSpec& s) {
        ref::stickbreaking_forward(StickBreakingAttention(spec_of(s)), out, rows_of(stat));
      });
      return {};
    }
    return StickBreakingAttention(spec_of(spec)).forward(out, rows_of(stat));
  }

  AttentionStats backward(const AttentionSpec& spec, ConstTensorView out, ConstTensorView stat, ConstTensorView d_stat,
                          ConstTensorView d_out, TensorView dq, TensorView dk, TensorView dv, GroupGradients*,
                          bool reference) const override {
    const StickBreakingAttention att(spec_of(spec));
    if (reference) {
      ref::stickbreaking_backward(att, out, rows_of(stat), d_out, rows_of(d_stat), dq, dk, dv);
      return {};
    }
    return with_wide_out(
        out, [&](TensorView wide) { return att.forward(wide, {}); },
        [&](ConstTensorView o) { return att.backward(o, rows_of(stat), d_out, rows_of(d_stat), dq, dk, dv); });
  }

 private:
  StickBreakingSpec spec_of(const AttentionSpec& s) const {
    return {.q = s.q,
            .k = s.k,
            .v = s.v,
            .scale = s.scale,
            .attend_current = attend_current_,
            .cu_seqlens_q = s.cu_seqlens_q,
            .cu_seqlens_k = s.cu_seqlens_k,
            .skip_vanishing_tiles = s.skip_vanishing_tiles};
  }
  bool attend_current_;
};

class CopeRows final : public RowNormaliser {
 public:
  CopeRows(std::int64_t positions, std::int64_t head_dim, std::vector<double> table)
      : positions_(positions), head_dim_(head_dim), table_(std::move(table)), table32_(table_.begin(), table_.end()) {}
  std::string_view name() const override { return "cope"; }
  std::int64_t gradient_size() const override { return static_cast<std::int64_t>(table_.size()); }
  void check(const AttentionSpec& spec) const override { (void)CopeAttention(spec_of(spec)); }
  const std::vector<double>& table() const { return table_; }

  AttentionStats forward(const AttentionSpec& spec, TensorView out, TensorView stat, bool reference) const override {
    if (reference) {
      reference_forward(
          spec, out, [&](const AttentionSpec& s) { ref::cope_forward(CopeAttention(spec_of(s)), out, rows_of(stat)); });
      return {};
    }
    return CopeAttention(spec_of(spec)).forward(out, rows_of(stat));
  }

  // Its lse takes no gradient.
  AttentionStats backward(const AttentionSpec& spec, ConstTensorView out, ConstTensorView stat, ConstTensorView d_stat,
                          ConstTensorView d_out, TensorView dq, TensorView dk, TensorView dv, GroupGradients* grads,
                          bool reference) const override {
    if (d_stat.rank() > 0) throw Error("Attention", "d_lse", d_stat.describe(), "empty (CoPE's lse takes no gradient)");
    const CopeAttention att(spec_of(spec));
    // d_table in the table's dtype, added to the group's fp64 gradient.
    const bool f64 = spec.q.dtype() == DType::kF64;
    std::vector<double> d64(grads != nullptr && f64 ? table_.size() : 0, 0.0);
    std::vector<float> d32(grads != nullptr && !f64 ? table_.size() : 0, 0.0f);
    const TensorView d_table = grads == nullptr ? TensorView{}
                               : f64            ? TensorView::of(d64.data(), {positions_, head_dim_})
                                                : TensorView::of(d32.data(), {positions_, head_dim_});
    AttentionStats stats;
    if (reference) {
      ref::cope_backward(att, out, rows_of(stat), d_out, dq, dk, dv, d_table);
    } else {
      stats = with_wide_out(
          out, [&](TensorView wide) { return att.forward(wide, {}); },
          [&](ConstTensorView o) { return att.backward(o, rows_of(stat), d_out, dq, dk, dv, d_table); });
    }
    if (grads != nullptr) {
      for (std::size_t i = 0; i < table_.size(); ++i) grads->normaliser[i] += f64 ? d64[i] : double{d32[i]};
    }
    return stats;
  }

 private:
  CopeSpec spec_of(const AttentionSpec& s) const {
    const bool f64 = s.q.dtype() == DType::kF64;
    return {.q = s.q,
            .k = s.k,
            .v = s.v,
            .table = f64 ? ConstTensorView::of(table_.data(), {positions_, head_dim_})
                         : ConstTensorView::of(table32_.data(), {positions_, head_dim_}),
            .scale = s.scale,
            .cu_seqlens_q = s.cu_seqlens_q,
            .cu_seqlens_k = s.cu_seqlens_k};
  }
  std::int64_t positions_, head_dim_;
  std::vector<double> table_;  // fp64 calls read it; the others its f32 copy
  std::vector<float> table32_;
};

template <class Rows>
const Rows& rows_of_group(const HeadGroup& g, const char* scheme) {
  const auto* rows = dynamic_cast<const Rows*>(g.normaliser.get());
  if (rows == nullptr)
    throw Error(std::string("scheme ") + scheme, "normaliser", "another", "the group its entry makes");
  return *rows;
}

}  // namespace

namespace scheme_entries {

SchemeEntry stickbreaking_entry() {
  return {.name = "stickbreaking",
          .family = "normaliser",
          .summary = "A_ij = σ(z_ij)·Π_{j<m<i} (1 − σ(z_im)) replaces the softmax, z = scale·q·k: no positions",
          .source = "Tan, Shen, Yang, Courville and Panda 2025 (ICLR), Scaling Stick-Breaking Attention",
          .options = {flag_option("attend_current", false, "1: the query's own token takes the first break")},
          .parameters = "",
          .parameter_shape = [](const SchemeArgs&) { return std::vector<std::int64_t>{}; },
          .make =
              [](const SchemeArgs& a) {
                HeadGroup g{a.heads, {}, {}};
                g.normaliser = std::make_shared<const StickBreakingRows>(a.flag("attend_current"));
                return g;
              },
          .causal_only = true,
          .statistic_has_gradient = true,
          .parameters_of = [](const HeadGroup&) { return std::vector<double>{}; },
          .gradients_of = [](const GroupGradients&) { return std::vector<double>{}; },
          .decoder_statistic_bias = true};
}

SchemeEntry cope_entry() {
  SchemeOption positions =
      size_option("positions", 64, "npos: the table's rows; counts beyond npos − 1 share the last");
  positions.maximum = 65536;  // each block keeps a row of npos floats per query
  return {
      .name = "cope",
      .family = "normaliser",
      .summary = "softmax of z_ij + ⟨q_i, e[p_ij]⟩ interpolated, p_ij = Σ_{m=j..i} σ(z_im): positions counted by gates",
      .source = "Golovneva, Wang, Weston and Sukhbaatar 2024, Contextual Position Encoding (arXiv:2405.18719)",
      .options = {positions},
      .parameters = "e [positions, head_dim], shared by the heads (zeros at first)",
      .parameter_shape =
          [](const SchemeArgs& a) {
            return std::vector<std::int64_t>{a.integer("positions"), a.head_dim};
          },
      .make =
          [](const SchemeArgs& a) {
            const std::int64_t n = a.integer("positions");
            std::vector<double> table = a.parameters;
            if (table.empty()) table.assign(static_cast<std::size_t>(n * a.head_dim), 0.0);
            HeadGroup g{a.heads, {}, {}};
            g.normaliser = std::make_shared<const CopeRows>(n, a.head_dim, std::move(table));
            return g;
          },
      .causal_only = true,
      .parameters_of = [](const HeadGroup& g) { return rows_of_group<CopeRows>(g, "cope").table(); },
      .gradients_of = [](const GroupGradients& g) { return g.normaliser; },
      // A decoder's table: one row per position of its training length, and position 0 (the
      // authors' default, block size + 1), zeros at first as theirs.
      .decoder_preset = [](SchemeArgs& a, std::int64_t train_length) { a.options["positions"] = train_length + 1; },
      .training =
          [](const SchemeArgs& a, std::int64_t) {
            return std::vector<TrainedSlice>{
                {.name = "table", .shape = {a.integer("positions"), a.head_dim}, .dtype = DType::kF32}};
          }};
}

}  // namespace scheme_entries
}  // namespace posenc
