// Stick-breaking attention as a differentiable op (posenc/stickbreaking.hpp): out and rem, with
// gradients into q, k and v from d_out and d_rem.
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

// The object of one call, kept from forward to backward (the views point into the saved q, k, v).
struct StickBreakingHolder : torch::CustomClassHolder {
  std::unique_ptr<StickBreakingAttention> attention;
};

std::unique_ptr<StickBreakingAttention> make_stickbreaking(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, double scale, bool attend_current,
                                                           const std::vector<std::int64_t>& cu_seqlens_q,
                                                           const std::vector<std::int64_t>& cu_seqlens_k,
                                                           bool skip_vanishing_tiles) {
  const char* where = "stickbreaking_attention";
  StickBreakingSpec spec;
  spec.q = const_view(where, "q", q);
  spec.k = const_view(where, "k", k);
  spec.v = const_view(where, "v", v);
  spec.scale = scale;
  spec.attend_current = attend_current;
  spec.cu_seqlens_q = cu_seqlens_q;
  spec.cu_seqlens_k = cu_seqlens_k;
  spec.skip_vanishing_tiles = skip_vanishing_tiles;
  return std::make_unique<StickBreakingAttention>(std::move(spec));
}

class StickBreakingFunction : public torch::autograd::Function<StickBreakingFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double scale, bool attend_current, const std::vector<std::int64_t>& cu_seqlens_q,
                               const std::vector<std::int64_t>& cu_seqlens_k, bool skip_vanishing_tiles) {
    return translating([&] {
      auto holder = c10::make_intrusive<StickBreakingHolder>();
      holder->attention =
          make_stickbreaking(q, k, v, scale, attend_current, cu_seqlens_q, cu_seqlens_k, skip_vanishing_tiles);
      std::vector<std::int64_t> out_shape(q.sizes().begin(), q.sizes().end());
      out_shape.back() = v.size(-1);
      // 16-bit inputs: out computed in f32 and kept for backward (its G = d_out·out would carry
      // the 16-bit rounding to every key a row sees), returned rounded to the inputs' dtype.
      const bool wide = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
      at::Tensor out = at::empty(out_shape, q.options().dtype(wide ? at::kFloat : q.scalar_type()));
      std::vector<std::int64_t> rem_shape(q.sizes().begin(), q.sizes().end() - 1);  // [B, Sq, H] or [Tq, H]
      at::Tensor rem = at::empty(rem_shape, q.options().dtype(at::kFloat));
      holder->attention->forward(mutable_view("stickbreaking_attention", "out", out),
                                 mutable_view("stickbreaking_attention", "rem", rem));
      ctx->saved_data["call"] = holder;
      ctx->save_for_backward({q, k, v, out, rem});
      return variable_list{wide ? out.to(q.scalar_type()) : out, rem};
    });
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return translating([&] {
      const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &rem = saved[4];
      const StickBreakingAttention& att = *ctx->saved_data["call"].toCustomClass<StickBreakingHolder>()->attention;
      const at::Tensor d_out =
          grads[0].defined() ? grads[0].to(q.scalar_type()).contiguous() : at::zeros(out.sizes(), q.options());
      const at::Tensor d_rem = grads[1].defined() ? grads[1].to(at::kFloat).contiguous() : at::Tensor();
      at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
      const char* where = "stickbreaking_attention";
      att.backward(const_view(where, "out", out), const_view(where, "rem", rem), const_view(where, "d_out", d_out),
                   d_rem.defined() ? const_view(where, "d_rem", d_rem) : ConstTensorView(),
                   mutable_view(where, "dq", dq), mutable_view(where, "dk", dk), mutable_view(where, "dv", dv));
      return variable_list{dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    });
  }
};

std::tuple<at::Tensor, at::Tensor> stickbreaking_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale, bool attend_current,
                                                    std::vector<std::int64_t> cu_seqlens_q,
                                                    std::vector<std::int64_t> cu_seqlens_k, bool skip_vanishing_tiles) {
  const variable_list r =
      StickBreakingFunction::apply(q, k, v, scale, attend_current, cu_seqlens_q, cu_seqlens_k, skip_vanishing_tiles);
  return {r[0], r[1]};
}

}  // namespace

void define_stickbreaking_ops(torch::Library& m) {
  m.class_<StickBreakingHolder>("StickBreakingCall");
  m.def(
      "stickbreaking_attention(Tensor q, Tensor k, Tensor v, float scale, bool attend_current, int[] cu_seqlens_q=[], "
      "int[] cu_seqlens_k=[], bool skip_vanishing_tiles=True) -> (Tensor, Tensor)",
      &stickbreaking_op);
}

}  // namespace posenc::torch_adapter
