// CoPE as a differentiable op (posenc/cope.hpp): out and lse, with gradients into q, k, v and the
// position table from d_out.
#include <torch/library.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "adapter.hpp"
#include "posenc/posenc.hpp"

namespace posenc::torch_adapter {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kWhere = "cope_attention";

// The object of one call, kept from forward to backward (the views point into the saved tensors).
struct CopeHolder : torch::CustomClassHolder {
  std::unique_ptr<CopeAttention> attention;
};

class CopeFunction : public torch::autograd::Function<CopeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& table, double scale, const std::vector<std::int64_t>& cu_seqlens_q,
                               const std::vector<std::int64_t>& cu_seqlens_k) {
    return translating([&] {
      auto holder = c10::make_intrusive<CopeHolder>();
      CopeSpec spec;
      spec.q = const_view(kWhere, "q", q);
      spec.k = const_view(kWhere, "k", k);
      spec.v = const_view(kWhere, "v", v);
      spec.table = const_view(kWhere, "table", table);
      spec.scale = scale;
      spec.cu_seqlens_q = cu_seqlens_q;
      spec.cu_seqlens_k = cu_seqlens_k;
      holder->attention = std::make_unique<CopeAttention>(std::move(spec));
      std::vector<std::int64_t> out_shape(q.sizes().begin(), q.sizes().end());
      out_shape.back() = v.size(-1);
      // 16-bit inputs: out computed in f32 and kept for backward (Δ = d_out·out without the
      // 16-bit rounding), returned rounded to the inputs' dtype.
      const bool wide = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
      at::Tensor out = at::empty(out_shape, q.options().dtype(wide ? at::kFloat : q.scalar_type()));
      std::vector<std::int64_t> lse_shape(q.sizes().begin(), q.sizes().end() - 1);  // [B, Sq, H] or [Tq, H]
      at::Tensor lse = at::empty(lse_shape, q.options().dtype(at::kFloat));
      holder->attention->forward(mutable_view(kWhere, "out", out), mutable_view(kWhere, "lse", lse));
      ctx->saved_data["call"] = holder;
      ctx->save_for_backward({q, k, v, table, out, lse});
      ctx->mark_non_differentiable({lse});
      return variable_list{wide ? out.to(q.scalar_type()) : out, lse};
    });
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return translating([&] {
      const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &table = saved[3], &out = saved[4], &lse = saved[5];
      const CopeAttention& att = *ctx->saved_data["call"].toCustomClass<CopeHolder>()->attention;
      const at::Tensor d_out =
          grads[0].defined() ? grads[0].to(q.scalar_type()).contiguous() : at::zeros(out.sizes(), q.options());
      at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v), de = at::zeros_like(table);
      att.backward(const_view(kWhere, "out", out), const_view(kWhere, "lse", lse), const_view(kWhere, "d_out", d_out),
                   mutable_view(kWhere, "dq", dq), mutable_view(kWhere, "dk", dk), mutable_view(kWhere, "dv", dv),
                   mutable_view(kWhere, "d_table", de));
      return variable_list{dq, dk, dv, de, at::Tensor(), at::Tensor(), at::Tensor()};
    });
  }
};

std::tuple<at::Tensor, at::Tensor> cope_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& table, double scale,
                                           std::vector<std::int64_t> cu_seqlens_q,
                                           std::vector<std::int64_t> cu_seqlens_k) {
  const variable_list r = CopeFunction::apply(q, k, v, table, scale, cu_seqlens_q, cu_seqlens_k);
  return {r[0], r[1]};
}

}  // namespace

void define_cope_ops(torch::Library& m) {
  m.class_<CopeHolder>("CopeCall");
  m.def(
      "cope_attention(Tensor q, Tensor k, Tensor v, Tensor table, float scale, int[] cu_seqlens_q=[], "
      "int[] cu_seqlens_k=[]) -> (Tensor, Tensor)",
      &cope_op);
}

}  // namespace posenc::torch_adapter
