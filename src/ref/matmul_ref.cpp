// The fp64 reference of posenc::matmul: products summed in fp64, the bias added, one rounding.
#include "internal.hpp"
#include "matmul_checks.hpp"
#include "posenc/matmul.hpp"

namespace posenc {

namespace ref {

void matmul(ConstTensorView a, ConstTensorView b, TensorView out, ConstTensorView bias) {
  detail::init_dispatch();
  const detail::MatmulShape s = detail::check_matmul(a, b, out, bias);
  const DType dt = out.dtype();
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < s.n; ++j) {
      double sum = 0.0;
      for (std::int64_t t = 0; t < s.k; ++t) {
        sum += detail::load(a.data(), dt, i * a.stride(0) + t * a.stride(1)) *
               detail::load(b.data(), dt, t * b.stride(0) + j * b.stride(1));
      }
      if (s.bias) sum += detail::load(bias.data(), dt, j * bias.stride(0));
      detail::store(out.data(), dt, i * out.stride(0) + j * out.stride(1), sum);
    }
  }
}

}  // namespace ref
}  // namespace posenc
