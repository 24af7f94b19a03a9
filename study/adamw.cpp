#include "adamw.hpp"

#include <cmath>
#include <string>

#include "posenc/error.hpp"

namespace posenc::study {
namespace {

constexpr double kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8;

template <class T>
void update(T* p, const T* g, T* m, T* v, std::int64_t n, double lr, double weight_decay, std::int64_t step) {
  const double bc1 = 1 - std::pow(kBeta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(kBeta2, static_cast<double>(step));
  const T decay = static_cast<T>(1 - lr * weight_decay), b1 = static_cast<T>(kBeta1), b2 = static_cast<T>(kBeta2);
  const T c1 = static_cast<T>(1 - kBeta1), c2 = static_cast<T>(1 - kBeta2);
  const T root_bc2 = static_cast<T>(std::sqrt(bc2)), eps = static_cast<T>(kEps), step_size = static_cast<T>(lr / bc1);
  for (std::int64_t i = 0; i < n; ++i) {
    const T gi = g[i];
    p[i] = p[i] * decay;
    m[i] = b1 * m[i] + c1 * gi;
    v[i] = b2 * v[i] + c2 * (gi * gi);
    const T denom = std::sqrt(v[i]) / root_bc2 + eps;  // IEEE sqrt: correctly rounded everywhere
    p[i] = p[i] - step_size * (m[i] / denom);
  }
}

}  // namespace

AdamW::AdamW(std::vector<torch::Tensor> params, double lr, double weight_decay)
    : params_(std::move(params)), lr_(lr), weight_decay_(weight_decay) {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const torch::Tensor& p = params_[i];
    if (!p.is_contiguous() || (p.scalar_type() != torch::kFloat32 && p.scalar_type() != torch::kFloat64)) {
      throw Error("study AdamW", "params[" + std::to_string(i) + "]", p.toString(),
                  "a contiguous float32 or float64 tensor");
    }
    moments_.push_back({torch::zeros_like(p), torch::zeros_like(p)});
  }
}

void AdamW::zero_grad() {
  for (torch::Tensor& p : params_) {
    if (p.grad().defined()) p.mutable_grad().reset();
  }
}

void AdamW::step() {
  const torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    const torch::Tensor g = p.grad().contiguous();
    Moments& s = moments_[i];
    ++s.steps;
    if (p.scalar_type() == torch::kFloat32) {
      update(p.data_ptr<float>(), g.data_ptr<float>(), s.m.data_ptr<float>(), s.v.data_ptr<float>(), p.numel(), lr_,
             weight_decay_, s.steps);
    } else {
      update(p.data_ptr<double>(), g.data_ptr<double>(), s.m.data_ptr<double>(), s.v.data_ptr<double>(), p.numel(), lr_,
             weight_decay_, s.steps);
    }
  }
}

}  // namespace posenc::study
