#include "internal.hpp"

#include <cmath>

namespace posenc::detail {

Grid token_grid(const char* where, const char* name, ConstTensorView view) {
  Grid g;
  if (view.rank() == 3) {
    g.batch = view.size(0);
    g.seq = view.size(1);
    g.dim = view.size(2);
    g.batch_stride = view.stride(0);
    g.seq_stride = view.stride(1);
    g.dim_stride = view.stride(2);
  } else if (view.rank() == 2) {
    g.seq = view.size(0);
    g.dim = view.size(1);
    g.seq_stride = view.stride(0);
    g.dim_stride = view.stride(1);
  } else {
    throw Error(where, std::string(name) + ".rank()", std::to_string(view.rank()),
                "3 ([B, S, D]) or 2 ([S, D])");
  }
  return g;
}

Grid matrix_grid(const char* where, const char* name, ConstTensorView view) {
  if (view.rank() != 2) {
    throw Error(where, std::string(name) + ".rank()", std::to_string(view.rank()), "2 ([rows, D])");
  }
  return token_grid(where, name, view);
}

void check_same_dims(const char* where, const char* name, const Grid& got, const char* ref_name,
                     const Grid& ref) {
  if (got.batch != ref.batch || got.seq != ref.seq || got.dim != ref.dim) {
    auto text = [](const Grid& g) {
      return "[" + std::to_string(g.batch) + ", " + std::to_string(g.seq) + ", " +
             std::to_string(g.dim) + "]";
    };
    throw Error(where, std::string(name) + " shape", text(got),
                "the shape of " + std::string(ref_name) + ", " + text(ref));
  }
}

void check_dtype(const char* where, const char* name, DType got, DType expected) {
  if (got != expected) {
    throw Error(where, std::string(name) + ".dtype()", std::string(dtype_name(got)),
                std::string(dtype_name(expected)) + " (all tensors of a call share one dtype)");
  }
}

void check_writable(const char* where, const char* name, ConstTensorView view) {
  for (int axis = 0; axis < view.rank(); ++axis) {
    if (view.stride(axis) == 0 && view.size(axis) > 1) {
      throw Error(where, std::string(name) + ".stride(" + std::to_string(axis) + ")", "0",
                  "a non-zero stride: an output cannot broadcast (" + view.describe() + ")");
    }
  }
}

double sinusoid_inv_frequency(double base, std::int64_t dim, std::int64_t i) {
  // Extended precision so that the exponent 2i/d (often not a binary fraction) and the power
  // round once, at the final conversion to fp64.
  const long double exponent = -2.0L * static_cast<long double>(i) / static_cast<long double>(dim);
  return static_cast<double>(std::pow(static_cast<long double>(base), exponent));
}

}  // namespace posenc::detail
