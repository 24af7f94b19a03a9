// The study's optimiser: AdamW (Loshchilov & Hutter 2019, Algorithm 2; β = (0.9, 0.999), ε = 1e-8,
// decoupled weight decay as in torch.optim.AdamW) written out element by element. libtorch's
// AdamW takes the square root of its second moments through ATen's sqrt, which PyPI's wheels
// hand to MKL's vector library, whose code path (and last bits: measured on one host, MKL_CBWR=AVX2
// against AVX512 and COMPATIBLE) follows the CPU. Here each operation is one IEEE operation in the
// parameter's type, compiled without contraction (-ffp-contract=off), so the step is the same on
// every host.
#pragma once

#include <torch/torch.h>

#include <vector>

namespace posenc::study {

class AdamW {
 public:
  // Contiguous f32 or f64 parameters (posenc::Error otherwise).
  AdamW(std::vector<torch::Tensor> params, double lr, double weight_decay = 0.01);
  void set_lr(double lr) { lr_ = lr; }
  void zero_grad();
  // One step over the parameters that have gradients.
  void step();

 private:
  struct Moments {
    torch::Tensor m, v;
    std::int64_t steps = 0;  // steps this parameter took (it takes none without a gradient)
  };
  std::vector<torch::Tensor> params_;
  std::vector<Moments> moments_;
  double lr_, weight_decay_;
};

}  // namespace posenc::study
