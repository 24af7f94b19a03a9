#include "linear.hpp"

#include <vector>

#include "posenc/error.hpp"
#include "posenc/matmul.hpp"

namespace posenc::study {
namespace {

ConstTensorView matrix(const torch::Tensor& t, std::int64_t rows, std::int64_t cols, std::int64_t s0, std::int64_t s1) {
  return ConstTensorView(t.data_ptr<float>(), DType::kF32, std::vector<std::int64_t>{rows, cols},
                         std::vector<std::int64_t>{s0, s1});
}
// t's memory as a dense [rows, cols] matrix (t may have more axes: a [..., cols] tensor).
TensorView output(torch::Tensor& t, std::int64_t rows, std::int64_t cols) {
  return TensorView::of(t.data_ptr<float>(), {rows, cols});
}

class Linear : public torch::autograd::Function<Linear> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias) {
    const std::int64_t in = weight.size(1), out = weight.size(0);
    const torch::Tensor rows = x.reshape({-1, in}).contiguous();
    const torch::Tensor w = weight.contiguous();
    std::vector<std::int64_t> shape = x.sizes().vec();
    shape.back() = out;
    // Allocated in its final shape: a view made here would be marked as one, and refuse in-place use.
    torch::Tensor y = torch::empty(shape, x.options());
    // y = rows · wᵀ: wᵀ is w read column by column.
    matmul(matrix(rows, rows.size(0), in, in, 1), matrix(w, in, out, 1, in), output(y, rows.size(0), out),
           bias.defined() ? ConstTensorView::of(bias.contiguous().data_ptr<float>(), {out}) : ConstTensorView{});
    ctx->save_for_backward({rows, w});
    ctx->saved_data["has_bias"] = bias.defined();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& rows = saved[0];
    const torch::Tensor& w = saved[1];
    const std::int64_t m = rows.size(0), in = w.size(1), out = w.size(0);
    const torch::Tensor dy = grads[0].reshape({m, out}).contiguous();
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {  // dx = dy · w, in x's shape (the output's, `in` wide)
      std::vector<std::int64_t> shape = grads[0].sizes().vec();
      shape.back() = in;
      dx = torch::empty(shape, dy.options());
      matmul(matrix(dy, m, out, out, 1), matrix(w, out, in, in, 1), output(dx, m, in));
    }
    if (ctx->needs_input_grad(1)) {  // dw = dyᵀ · rows
      dw = torch::empty({out, in}, dy.options());
      matmul(matrix(dy, out, m, 1, out), matrix(rows, m, in, in, 1), output(dw, out, in));
    }
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {  // db = 1ᵀ · dy, in row order
      const float one = 1.0f;
      db = torch::empty({out}, dy.options());
      matmul(ConstTensorView(&one, DType::kF32, std::vector<std::int64_t>{1, m}, std::vector<std::int64_t>{0, 0}),
             matrix(dy, m, out, out, 1), output(db, 1, out));
    }
    return {dx, dw, db};
  }
};

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  if (x.scalar_type() != torch::kFloat32 || weight.scalar_type() != torch::kFloat32 ||
      (bias.defined() && bias.scalar_type() != torch::kFloat32)) {
    throw Error("study linear", "dtype", std::string(c10::toString(x.scalar_type())),
                "float32 inputs, weight and bias");
  }
  if (x.dim() < 1 || x.size(-1) != weight.size(1)) {
    throw Error("study linear", "x.size(-1)", std::to_string(x.dim() < 1 ? -1 : x.size(-1)),
                std::to_string(weight.size(1)) + " (the weight's input width)");
  }
  return Linear::apply(x, weight, bias);
}

}  // namespace posenc::study
