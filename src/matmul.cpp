// posenc::matmul (posenc/matmul.hpp): checks, then the attention's matrix kernel (attn_gemm: each
// element one chain of fused multiply-adds in depth order) over blocks of rows. B is packed when
// its rows are not unit-stride multiples of kAttnAlign floats; C goes through a scratch block
// when it cannot be written in place. Neither copy changes a bit.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "absolute_checks.hpp"
#include "internal.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "kernels/common/row_kernels.hpp"
#include "matmul_checks.hpp"
#include "posenc/matmul.hpp"

namespace posenc {
namespace detail {

MatmulShape check_matmul(ConstTensorView a, ConstTensorView b, ConstTensorView out, ConstTensorView bias) {
  constexpr const char* kWhere = "matmul";
  const auto rank2 = [](const char* name, ConstTensorView v) {
    if (v.rank() != 2) throw Error(kWhere, std::string(name) + ".rank()", std::to_string(v.rank()), "2");
  };
  rank2("a", a);
  rank2("b", b);
  rank2("out", out);
  MatmulShape s{a.size(0), a.size(1), b.size(1), bias.rank() != 0};
  if (b.size(0) != s.k) {
    throw Error(kWhere, "b.size(0)", std::to_string(b.size(0)), std::to_string(s.k) + " (a.size(1): the depth)");
  }
  if (out.size(0) != s.m)
    throw Error(kWhere, "out.size(0)", std::to_string(out.size(0)), std::to_string(s.m) + " (a.size(0))");
  if (out.size(1) != s.n)
    throw Error(kWhere, "out.size(1)", std::to_string(out.size(1)), std::to_string(s.n) + " (b.size(1))");
  if (s.bias) {
    if (bias.rank() != 1)
      throw Error(kWhere, "bias.rank()", std::to_string(bias.rank()), "1 (or an empty view: no bias)");
    if (bias.size(0) != s.n)
      throw Error(kWhere, "bias.size(0)", std::to_string(bias.size(0)), std::to_string(s.n) + " (b.size(1))");
  }
  if (out.dtype() != DType::kF32 && out.dtype() != DType::kF64) {
    throw Error(kWhere, "out.dtype()", std::string(dtype_name(out.dtype())), "f32 or f64");
  }
  check_dtype(kWhere, "a", a.dtype(), out.dtype());
  check_dtype(kWhere, "b", b.dtype(), out.dtype());
  if (s.bias) check_dtype(kWhere, "bias", bias.dtype(), out.dtype());
  check_writable(kWhere, "out", out);
  check_disjoint(kWhere, {{"out", out}}, {{"a", a}, {"b", b}, {"bias", bias}});
  return s;
}

}  // namespace detail

namespace {

using detail::AlignedFloats;

// Rows per block: a block's rows of A at one depth pass (<= 128 deep) stay in L1/L2 while every
// column strip of B walks them. 60 is a multiple of both register blockings (6 and 4 rows).
constexpr std::int64_t kBlockRows = 60;
// Depth per call of the kernel. A weight gradient walks the batch's tokens down rows 1 KiB apart
// (x of width 256) or 256 B (dy of width 64): 128 such rows (the kernel's own pass) fall into 4
// of L1's 64 sets and evict each other. 32 rows fit. One core of an Intel Xeon (family 6, model 167),
// AVX2, GFLOP/s of the down layer's dW = dyᵀ·x (64 × 2048 × 256): 62 in one pass, 66 at 64, 82 at 32; the forward
// and input-gradient products of the study's layers 88–98 at either.
constexpr std::int64_t kDepthChunk = 32;

AlignedFloats& scratch(int slot) {  // grown on demand, never shrunk: no first touch once warm
  thread_local AlignedFloats buffers[2];
  return buffers[slot];
}

}  // namespace

void matmul(ConstTensorView a, ConstTensorView b, TensorView out, ConstTensorView bias) {
  detail::init_dispatch();
  const detail::MatmulShape s = detail::check_matmul(a, b, out, bias);
  if (detail::use_reference() || out.dtype() == DType::kF64) {
    ref::matmul(a, b, out, bias);
    return;
  }
  if (s.m == 0 || s.n == 0) return;
  if (s.k == 0) {  // no products: the bias, or zeros (the kernel is not handed empty operands)
    for (std::int64_t i = 0; i < s.m; ++i) {
      for (std::int64_t j = 0; j < s.n; ++j) {
        out.typed<float>()[i * out.stride(0) + j * out.stride(1)] =
            s.bias ? bias.typed<float>()[j * bias.stride(0)] : 0.0f;
      }
    }
    return;
  }
  const std::int64_t padded = (s.n + kernels::kAttnAlign - 1) / kernels::kAttnAlign * kernels::kAttnAlign;
  // B as the kernel reads it: rows of `padded` floats, unit stride.
  const float* bp = b.typed<float>();
  std::int64_t ldb = b.stride(0);
  AlignedFloats* packed_b = nullptr;
  if (b.stride(1) != 1 || padded != s.n) {
    packed_b = &scratch(0);
    packed_b->assign(static_cast<std::size_t>(checked_mul(s.k, padded, "matmul: packed b")), 0.0f);
    for (std::int64_t t = 0; t < s.k; ++t) {
      for (std::int64_t j = 0; j < s.n; ++j) {
        (*packed_b)[static_cast<std::size_t>(t * padded + j)] = b.typed<float>()[t * b.stride(0) + j * b.stride(1)];
      }
    }
    bp = packed_b->data();
    ldb = padded;
  }
  std::vector<float> bias_row;
  if (s.bias) {
    bias_row.resize(static_cast<std::size_t>(s.n));
    for (std::int64_t j = 0; j < s.n; ++j)
      bias_row[static_cast<std::size_t>(j)] = bias.typed<float>()[j * bias.stride(0)];
  }
  // In place when out's rows are unit-stride multiples of the alignment (the bias then added there).
  const bool direct = out.stride(1) == 1 && padded == s.n;
  const float* a0 = a.typed<float>();
  const std::int64_t blocks = (s.m + kBlockRows - 1) / kBlockRows;
  // Multiply-adds, saturated: broadcast (stride-0) operands can be logically larger than int64 counts.
  std::int64_t work = 0;
  if (__builtin_mul_overflow(s.m, s.n, &work) || __builtin_mul_overflow(work, s.k, &work)) {
    work = std::numeric_limits<std::int64_t>::max();
  }
  const int threads = detail::threads_for(work);
  // Each thread's block of C, when C cannot be written in place: allocated here, where a failure
  // throws to the caller (inside the parallel region it would terminate the process).
  const std::int64_t tile_floats = direct ? 0 : checked_mul(std::min(kBlockRows, s.m), padded, "matmul: scratch block");
  AlignedFloats& tiles = scratch(1);
  const auto need = static_cast<std::size_t>(checked_mul(tile_floats, threads, "matmul: scratch blocks"));
  if (tiles.size() < need) tiles.resize(need);
#pragma omp parallel num_threads(threads)
  {
    float* tile = tiles.data() + omp_get_thread_num() * tile_floats;
#pragma omp for schedule(static)
    for (std::int64_t block = 0; block < blocks; ++block) {
      const std::int64_t r0 = block * kBlockRows, rows = std::min(kBlockRows, s.m - r0);
      float* c = direct ? out.typed<float>(r0 * out.stride(0)) : tile;
      const std::int64_t ldc = direct ? out.stride(0) : padded;
      // Depth in chunks, each chaining from the last through C (exact: the same bits as one pass).
      for (std::int64_t t0 = 0; t0 < s.k; t0 += kDepthChunk) {
        kernels::attn_gemm(a0 + r0 * a.stride(0) + t0 * a.stride(1), a.stride(0), a.stride(1), bp + t0 * ldb, ldb, c,
                           ldc, rows, padded, std::min(kDepthChunk, s.k - t0), t0 > 0);
      }
      for (std::int64_t r = 0; s.bias && r < rows; ++r) {
        float* row = c + r * ldc;
        kernels::add_rows_f32(row, bias_row.data(), row, s.n);
      }
      if (direct) continue;
      for (std::int64_t r = 0; r < rows; ++r) {
        const float* row = tile + r * padded;
        float* dst = out.typed<float>((r0 + r) * out.stride(0));
        if (out.stride(1) == 1) {
          std::copy(row, row + s.n, dst);
        } else {
          for (std::int64_t j = 0; j < s.n; ++j) dst[j * out.stride(1)] = row[j];
        }
      }
    }
  }
}

}  // namespace posenc
