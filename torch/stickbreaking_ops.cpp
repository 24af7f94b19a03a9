// Stick-breaking attention as a differentiable op (posenc/stickbreaking.hpp): out and rem, with
// gradients into q, k and v from d_out and d_rem.
#include <torch/library.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "adapter.hpp"
#include "posenc/posenc.hpp"

namespace posenc::torch_adapter {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kWhere = "stickbreaking_attention";

StickBreakingAttention make_stickbreaking(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                          bool attend_current, const std::vector<std::int64_t>& cu_seqlens_q,
                                          const std::vector<std::int64_t>& cu_seqlens_k, bool skip_vanishing_tiles) {
  StickBreakingSpec spec;
  spec.q = const_view(kWhere, "q", q);
  spec.k = const_view(kWhere, "k", k);
  spec.v = const_view(kWhere, "v", v);
  spec.scale = scale;
  spec.attend_current = attend_current;
  spec.cu_seqlens_q = cu_seqlens_q;
  spec.cu_seqlens_k = cu_seqlens_k;
  spec.skip_vanishing_tiles = skip_vanishing_tiles;
  return StickBreakingAttention(std::move(spec));
}

// The forward kernel: out in the inputs' dtype, rem, and — for 16-bit inputs — out in f32, which
// backward reads (its G = d_out·out would carry the 16-bit rounding to every key a row sees);
// an empty tensor for f32 and f64, whose out is exact as it is.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, double scale, bool attend_current,
                                                           std::vector<std::int64_t> cu_seqlens_q,
                                                           std::vector<std::int64_t> cu_seqlens_k,
                                                           bool skip_vanishing_tiles) {
  return translating([&] {
    const StickBreakingAttention att =
        make_stickbreaking(q, k, v, scale, attend_current, cu_seqlens_q, cu_seqlens_k, skip_vanishing_tiles);
    RowOutputs o = row_outputs(q, v);
    att.forward(mutable_view(kWhere, "out", o.out), mutable_view(kWhere, "rem", o.row));
    return returned(q, o);
  });
}

std::tuple<at::Tensor, at::Tensor> stickbreaking_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     double scale, bool attend_current,
                                                     std::vector<std::int64_t> cu_seqlens_q,
                                                     std::vector<std::int64_t> cu_seqlens_k,
                                                     bool skip_vanishing_tiles) {
  const auto r = forward_cpu(q, k, v, scale, attend_current, std::move(cu_seqlens_q), std::move(cu_seqlens_k),
                             skip_vanishing_tiles);
  return {std::get<0>(r), std::get<1>(r)};
}

// The backward kernel: dq, dk, dv from d_out and d_rem (absent: 0), the call planned again from
// its arguments (the plan holds no tables: cheap next to the backward).
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& rem,
    const at::Tensor& d_out, const std::optional<at::Tensor>& d_rem, double scale, bool attend_current,
    std::vector<std::int64_t> cu_seqlens_q, std::vector<std::int64_t> cu_seqlens_k, bool skip_vanishing_tiles) {
  return translating([&] {
    const StickBreakingAttention att =
        make_stickbreaking(q, k, v, scale, attend_current, cu_seqlens_q, cu_seqlens_k, skip_vanishing_tiles);
    const at::Tensor dy = d_out.to(q.scalar_type()).contiguous();
    const at::Tensor dr = d_rem.has_value() ? d_rem->to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    att.backward(const_view(kWhere, "out", out), const_view(kWhere, "rem", rem), const_view(kWhere, "d_out", dy),
                 dr.defined() ? const_view(kWhere, "d_rem", dr) : ConstTensorView(), mutable_view(kWhere, "dq", dq),
                 mutable_view(kWhere, "dk", dk), mutable_view(kWhere, "dv", dv));
    return std::make_tuple(dq, dk, dv);
  });
}

class StickBreakingFunction : public torch::autograd::Function<StickBreakingFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double scale, bool attend_current, const std::vector<std::int64_t>& cu_seqlens_q,
                               const std::vector<std::int64_t>& cu_seqlens_k, bool skip_vanishing_tiles) {
    const torch::jit::Stack r =
        call_below_autograd("posenc::stickbreaking_attention_forward",
                            {q, k, v, scale, attend_current, cu_seqlens_q, cu_seqlens_k, skip_vanishing_tiles});
    const at::Tensor out = r[0].toTensor(), rem = r[1].toTensor(), wide = r[2].toTensor();
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["attend_current"] = attend_current;
    ctx->saved_data["cu_seqlens_q"] = cu_seqlens_q;
    ctx->saved_data["cu_seqlens_k"] = cu_seqlens_k;
    ctx->saved_data["skip_vanishing_tiles"] = skip_vanishing_tiles;
    ctx->save_for_backward({q, k, v, is_16_bit(q) ? wide : out, rem});
    return variable_list{out, rem};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor d_out = grads[0].defined() ? grads[0] : at::zeros(s[3].sizes(), s[0].options());
    const torch::jit::Stack d = call_below_autograd(
        "posenc::stickbreaking_attention_backward",
        {s[0], s[1], s[2], s[3], s[4], d_out, grads[1].defined() ? c10::IValue(grads[1]) : c10::IValue(),
         ctx->saved_data["scale"], ctx->saved_data["attend_current"], ctx->saved_data["cu_seqlens_q"],
         ctx->saved_data["cu_seqlens_k"], ctx->saved_data["skip_vanishing_tiles"]});
    return variable_list{d[0].toTensor(), d[1].toTensor(), d[2].toTensor(), at::Tensor(),
                         at::Tensor(),    at::Tensor(),    at::Tensor(),    at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> stickbreaking_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          double scale, bool attend_current,
                                                          std::vector<std::int64_t> cu_seqlens_q,
                                                          std::vector<std::int64_t> cu_seqlens_k,
                                                          bool skip_vanishing_tiles) {
  const variable_list r =
      StickBreakingFunction::apply(q, k, v, scale, attend_current, cu_seqlens_q, cu_seqlens_k, skip_vanishing_tiles);
  return {r[0], r[1]};
}

}  // namespace

void define_stickbreaking_ops(torch::Library& m) {
  // Three ops, as the other differentiable ones: the call (CPU, and autograd over the two below),
  // its forward with the f32 out that backward reads, and its backward; torch.compile and opcheck
  // trace them with their fake kernels (python/posenc/_fake.py).
  define_op(
      m,
      "stickbreaking_attention(Tensor q, Tensor k, Tensor v, float scale, bool attend_current, int[] cu_seqlens_q=[], "
      "int[] cu_seqlens_k=[], bool skip_vanishing_tiles=True) -> (Tensor, Tensor)",
      TORCH_FN(stickbreaking_cpu), TORCH_FN(stickbreaking_autograd));
  define_op(m,
            "stickbreaking_attention_forward(Tensor q, Tensor k, Tensor v, float scale, bool attend_current, "
            "int[] cu_seqlens_q, int[] cu_seqlens_k, bool skip_vanishing_tiles) -> (Tensor, Tensor, Tensor)",
            TORCH_FN(forward_cpu));
  define_op(m,
            "stickbreaking_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor rem, Tensor d_out, "
            "Tensor? d_rem, float scale, bool attend_current, int[] cu_seqlens_q, int[] cu_seqlens_k, "
            "bool skip_vanishing_tiles) -> (Tensor, Tensor, Tensor)",
            TORCH_FN(backward_cpu));
}

}  // namespace posenc::torch_adapter
