// CoPE as a differentiable op (posenc/cope.hpp): out and lse, with gradients into q, k, v and the
// position table from d_out.
#include <torch/library.h>
#include <torch/torch.h>

#include <string>
#include <tuple>
#include <vector>

#include "adapter.hpp"
#include "posenc/posenc.hpp"

namespace posenc::torch_adapter {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kWhere = "cope_attention";

CopeAttention make_cope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                        double scale, const std::vector<std::int64_t>& cu_seqlens_q,
                        const std::vector<std::int64_t>& cu_seqlens_k) {
  CopeSpec spec;
  spec.q = const_view(kWhere, "q", q);
  spec.k = const_view(kWhere, "k", k);
  spec.v = const_view(kWhere, "v", v);
  spec.table = const_view(kWhere, "table", table);
  spec.scale = scale;
  spec.cu_seqlens_q = cu_seqlens_q;
  spec.cu_seqlens_k = cu_seqlens_k;
  return CopeAttention(std::move(spec));
}

// The forward kernel: out in the inputs' dtype, lse, and — for 16-bit inputs — out in f32, which
// backward reads (Δ = d_out·out without the 16-bit rounding); an empty tensor for f32 and f64.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, const at::Tensor& table, double scale,
                                                           std::vector<std::int64_t> cu_seqlens_q,
                                                           std::vector<std::int64_t> cu_seqlens_k) {
  return translating([&] {
    const CopeAttention att = make_cope(q, k, v, table, scale, cu_seqlens_q, cu_seqlens_k);
    RowOutputs o = row_outputs(q, v);
    att.forward(mutable_view(kWhere, "out", o.out), mutable_view(kWhere, "lse", o.row));
    return returned(q, o);
  });
}

std::tuple<at::Tensor, at::Tensor> cope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& table, double scale,
                                            std::vector<std::int64_t> cu_seqlens_q,
                                            std::vector<std::int64_t> cu_seqlens_k) {
  const auto r = forward_cpu(q, k, v, table, scale, std::move(cu_seqlens_q), std::move(cu_seqlens_k));
  return {std::get<0>(r), std::get<1>(r)};
}

// The backward kernel: dq, dk, dv and the table's gradient from d_out, the call planned again
// from its arguments.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cpu(const at::Tensor& q, const at::Tensor& k,
                                                                        const at::Tensor& v, const at::Tensor& table,
                                                                        const at::Tensor& out, const at::Tensor& lse,
                                                                        const at::Tensor& d_out, double scale,
                                                                        std::vector<std::int64_t> cu_seqlens_q,
                                                                        std::vector<std::int64_t> cu_seqlens_k) {
  return translating([&] {
    const CopeAttention att = make_cope(q, k, v, table, scale, cu_seqlens_q, cu_seqlens_k);
    const at::Tensor dy = d_out.to(q.scalar_type()).contiguous();
    at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v), de = at::zeros_like(table);
    att.backward(const_view(kWhere, "out", out), const_view(kWhere, "lse", lse), const_view(kWhere, "d_out", dy),
                 mutable_view(kWhere, "dq", dq), mutable_view(kWhere, "dk", dk), mutable_view(kWhere, "dv", dv),
                 mutable_view(kWhere, "d_table", de));
    return std::make_tuple(dq, dk, dv, de);
  });
}

class CopeFunction : public torch::autograd::Function<CopeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& table, double scale, const std::vector<std::int64_t>& cu_seqlens_q,
                               const std::vector<std::int64_t>& cu_seqlens_k) {
    const torch::jit::Stack r =
        call_below_autograd("posenc::cope_attention_forward", {q, k, v, table, scale, cu_seqlens_q, cu_seqlens_k});
    const at::Tensor out = r[0].toTensor(), lse = r[1].toTensor(), wide = r[2].toTensor();
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["cu_seqlens_q"] = cu_seqlens_q;
    ctx->saved_data["cu_seqlens_k"] = cu_seqlens_k;
    ctx->save_for_backward({q, k, v, table, is_16_bit(q) ? wide : out, lse});
    ctx->mark_non_differentiable({lse});
    return variable_list{out, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor d_out = grads[0].defined() ? grads[0] : at::zeros(s[4].sizes(), s[0].options());
    const torch::jit::Stack d = call_below_autograd(
        "posenc::cope_attention_backward", {s[0], s[1], s[2], s[3], s[4], s[5], d_out, ctx->saved_data["scale"],
                                            ctx->saved_data["cu_seqlens_q"], ctx->saved_data["cu_seqlens_k"]});
    return variable_list{d[0].toTensor(), d[1].toTensor(), d[2].toTensor(), d[3].toTensor(),
                         at::Tensor(),    at::Tensor(),    at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> cope_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& table, double scale,
                                                 std::vector<std::int64_t> cu_seqlens_q,
                                                 std::vector<std::int64_t> cu_seqlens_k) {
  const variable_list r = CopeFunction::apply(q, k, v, table, scale, cu_seqlens_q, cu_seqlens_k);
  return {r[0], r[1]};
}

}  // namespace

void define_cope_ops(torch::Library& m) {
  // The call (CPU, and autograd over the two below), its forward with the f32 out that backward
  // reads, and its backward; traced with their fake kernels (python/posenc/_fake.py).
  define_op(m,
            "cope_attention(Tensor q, Tensor k, Tensor v, Tensor table, float scale, int[] cu_seqlens_q=[], "
            "int[] cu_seqlens_k=[]) -> (Tensor, Tensor)",
            TORCH_FN(cope_cpu), TORCH_FN(cope_autograd));
  define_op(m,
            "cope_attention_forward(Tensor q, Tensor k, Tensor v, Tensor table, float scale, int[] cu_seqlens_q, "
            "int[] cu_seqlens_k) -> (Tensor, Tensor, Tensor)",
            TORCH_FN(forward_cpu));
  define_op(m,
            "cope_attention_backward(Tensor q, Tensor k, Tensor v, Tensor table, Tensor out, Tensor lse, Tensor d_out, "
            "float scale, int[] cu_seqlens_q, int[] cu_seqlens_k) -> (Tensor, Tensor, Tensor, Tensor)",
            TORCH_FN(backward_cpu));
}

}  // namespace posenc::torch_adapter
