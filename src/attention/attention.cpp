// The fused attention engine (math, layouts and contracts in posenc/attention.hpp).
//
// Work is cut into units that never share outputs, so any thread count gives the same bits:
//   forward   (sequence, KV head, block of queries): rows = the block's queries × the KV head's
//             G query heads, head-major, each head's queries padded to kAttnAlign lanes (about
//             128 rows); key tiles of key_tile keys stream past them;
//   decode    (sequence, key chunk) when a sequence has at most kDecodeRows rows per KV head:
//             every KV head of each key tile in the cache's memory order (decode_tiles), the
//             heads' rows side by side in one score tile (layout_decode_rows; a block per KV
//             head with Shaw, XL and TUPE), caches split into chunks of about kDecodeChunkBytes,
//             merged in chunk order;
//   backward  (sequence, KV head): all of its rows, key tiles outer (dk, dv finished per tile),
//             row blocks inner, dq accumulated per unit in f32.
// Score tiles are transposed (S^T[key][row]) so that the softmax, the biases and the masks run
// with rows in the vector lanes; see kernels/attention/attention_kernels.hpp.
#include "posenc/attention.hpp"

#include "attention/attention_plan.hpp"
#include "internal.hpp"
#include "posenc/error.hpp"
#include "posenc/reference.hpp"

#include <string>

namespace posenc {

// ─── Public class ────────────────────────────────────────────────────────────────────────────

Attention::Attention(AttentionSpec spec) : plan_(std::make_unique<Plan>(std::move(spec))) {}
Attention::~Attention() = default;
Attention::Attention(Attention&&) noexcept = default;
Attention& Attention::operator=(Attention&&) noexcept = default;

std::int64_t Attention::batch() const { return plan_->batch; }
std::int64_t Attention::q_len() const { return plan_->q_len; }
std::int64_t Attention::k_len() const { return plan_->k_len; }
std::int64_t Attention::heads() const { return plan_->heads; }
std::int64_t Attention::kv_heads() const { return plan_->kv_heads; }
std::int64_t Attention::head_dim() const { return plan_->dim; }
std::int64_t Attention::value_dim() const { return plan_->dim_v; }
const AttentionSpec& Attention::spec() const { return plan_->spec; }
AttentionGradients Attention::zero_gradients() const { return plan_->zero_gradients(); }

AttentionStats Attention::forward(TensorView out, TensorView lse) const {
  detail::init_dispatch();
  if (plan_->normaliser != nullptr) {
    if (lse.rank() > 0) plan_->check_lse(lse, true);
    return plan_->normaliser->forward(spec(), out, lse, detail::use_reference());
  }
  if (detail::use_reference() || plan_->dtype == DType::kF64) {
    // The plan's checks first, so that errors read the same on every path.
    detail::check_output_tokens(Plan::kWhere, "out", ConstTensorView(out), plan_->out_grid());
    if (lse.rank() > 0) plan_->check_lse(lse, true);
    plan_->check_disjoint({{"out", out}, {"lse", lse}}, {{"q", spec().q}, {"k", spec().k}, {"v", spec().v}});
    ref::attention_forward(*this, out, lse);
    return {};  // the reference runs every pair: no tiles
  }
  return plan_->forward(out, lse);
}

AttentionStats Attention::backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq,
                                   TensorView dk, TensorView dv, AttentionGradients* grads,
                                   ConstTensorView d_lse) const {
  detail::init_dispatch();
  if (spec().cache) {
    throw Error(Plan::kWhere, "cache", std::string(cache_format_name(spec().cache->format)),
                "k and v tensors for backward (a quantized cache has no gradient)");
  }
  if (plan_->normaliser != nullptr) {
    if (lse.rank() > 0) plan_->check_lse(lse, false);
    if (d_lse.rank() > 0) plan_->check_lse(d_lse, false);
    if (grads != nullptr) plan_->check_gradients(*grads);
    return plan_->normaliser->backward(spec(), out, lse, d_lse, d_out, dq, dk, dv,
                                       grads != nullptr ? &grads->groups[0] : nullptr, detail::use_reference());
  }
  if (d_lse.rank() > 0) {
    throw Error(Plan::kWhere, "d_lse", d_lse.describe(), "empty (the softmax's lse takes no gradient here)");
  }
  if (detail::use_reference() || plan_->dtype == DType::kF64) {
    const detail::HeadsGrid& qg = plan_->qg;
    detail::check_output_tokens(Plan::kWhere, "out", out, plan_->out_grid());
    detail::check_output_tokens(Plan::kWhere, "d_out", d_out, plan_->out_grid());
    plan_->check_lse(lse, false);
    if (dq.rank() > 0) detail::check_output_tokens(Plan::kWhere, "dq", ConstTensorView(dq), qg);
    if (dk.rank() > 0) detail::check_output_tokens(Plan::kWhere, "dk", ConstTensorView(dk), plan_->kg);
    if (dv.rank() > 0) detail::check_output_tokens(Plan::kWhere, "dv", ConstTensorView(dv), plan_->vg);
    if (grads != nullptr) plan_->check_gradients(*grads);
    plan_->check_disjoint(
        {{"dq", dq}, {"dk", dk}, {"dv", dv}},
        {{"q", spec().q}, {"k", spec().k}, {"v", spec().v}, {"out", out}, {"lse", lse}, {"d_out", d_out}});
    ref::attention_backward(*this, out, lse, d_out, dq, dk, dv, grads);
    return {};  // the reference runs every pair: no steps
  }
  return plan_->backward(out, lse, d_out, dq, dk, dv, grads);
}

}  // namespace posenc
