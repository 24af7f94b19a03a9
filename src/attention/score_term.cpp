// Helpers of the score terms (score_term.hpp): large f32 matrix products for their tables and
// gradients, head-major tables, and the per-KV-head sums of the backward units' slots.
#include "attention/score_term.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention/engine.hpp"
#include "kernels/attention/attention_kernels.hpp"

namespace posenc::detail {

// C[m][n] = Σ_t A(m, t)·B[t][n] for large operands (XL's and TUPE's tables and gradients):
// attn_gemm streams all of B for every few rows of A, so the work is cut into tiles of kRows ×
// kCols, run in parallel, each summing its depth panels of kDepth in order — the same bits for
// any thread count. The operands are copied into aligned per-thread buffers with strides off a
// multiple of 4 KiB first: the callers' operands have row strides of H·D or d_model floats (4 KiB
// at 1024), which put every row of a panel in the same few L1 sets.
//   A   a strip of kRows rows over the whole depth, copied once per row block and kept while the
//       thread's tiles stay in that block (the static schedule gives each thread consecutive
//       tiles, row block major). A transposed source (a_row = 1, as XL's dW_R and TUPE's dU read
//       theirs) is kept transposed, [t][m], so that every copy is a contiguous run and attn_gemm
//       reads it with a_row = 1; a row source as rows, [m][t]. A strip holds (kRows + 16) × depth
//       floats per thread: 10 MiB at a depth of 32768, a small part of the operands it is cut
//       from (XL's dW_R reads a [δ span, H·D] matrix: 128 MiB at that span and H·D = 1024).
//   B   a panel of kDepth × kCols per tile and depth step.
// attn_gemm sums every element in depth order whatever A's layout, so the layout does not move a
// bit. perf on an XL backward (S 2048, H 8, D 128, 2 threads): blocked_gemm's and memmove's
// samples are at most 3.8% of the run's with the strip, 5.8% with A's panel copied per tile.
// cols: a multiple of kAttnAlign.
void blocked_gemm(const float* a, std::int64_t a_row, std::int64_t a_depth, const float* b, std::int64_t ldb, float* c,
                  std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t depth) {
  constexpr std::int64_t kRows = 64, kCols = 128, kDepth = 256;
  constexpr std::int64_t kLdb = kCols + kAttnAlign;
  const bool a_transposed = a_depth != 1;
  // The strip's stride: kRows + pad floats per depth step when transposed, else depth + pad per row.
  const std::int64_t lda = a_transposed ? kRows + kAttnAlign : round_up(depth, kAttnAlign) + kAttnAlign;
  const std::int64_t row_blocks = (rows + kRows - 1) / kRows, col_blocks = (cols + kCols - 1) / kCols;
  const std::int64_t tiles = row_blocks * col_blocks;
  const int threads =
      std::min<int>(threads_for(rows * cols * depth), static_cast<int>(std::max<std::int64_t>(tiles, 1)));
#pragma omp parallel num_threads(threads)
  {
    thread_local AlignedFloats a_strip, b_panel;
    a_strip.resize(static_cast<std::size_t>(a_transposed ? depth * lda : kRows * lda));
    b_panel.resize(static_cast<std::size_t>(kDepth * kLdb));
    std::int64_t strip_m0 = -1;  // the row block a_strip holds
#pragma omp for schedule(static)
    for (std::int64_t tile = 0; tile < tiles; ++tile) {
      const std::int64_t m0 = tile / col_blocks * kRows, n0 = tile % col_blocks * kCols;
      const std::int64_t m = std::min(kRows, rows - m0), n = std::min(kCols, cols - n0);
      if (m0 != strip_m0) {
        if (a_transposed) {
          for (std::int64_t t = 0; t < depth; ++t) {
            const float* from = a + m0 * a_row + t * a_depth;
            float* to = a_strip.data() + t * lda;
            if (a_row == 1) {
              std::copy(from, from + m, to);
            } else {
              for (std::int64_t i = 0; i < m; ++i) to[i] = from[i * a_row];
            }
          }
        } else {
          for (std::int64_t i = 0; i < m; ++i) {
            const float* from = a + (m0 + i) * a_row;
            std::copy(from, from + depth, a_strip.data() + i * lda);
          }
        }
        strip_m0 = m0;
      }
      for (std::int64_t t0 = 0; t0 < depth; t0 += kDepth) {
        const std::int64_t k = std::min(kDepth, depth - t0);
        for (std::int64_t t = 0; t < k; ++t) {
          const float* from = b + (t0 + t) * ldb + n0;
          std::copy(from, from + n, b_panel.data() + t * kLdb);
        }
        if (a_transposed) {
          kernels::attn_gemm(a_strip.data() + t0 * lda, 1, lda, b_panel.data(), kLdb, c + m0 * ldc + n0, ldc, m, n, k,
                             t0 > 0);
        } else {
          kernels::attn_gemm(a_strip.data() + t0, lda, 1, b_panel.data(), kLdb, c + m0 * ldc + n0, ldc, m, n, k,
                             t0 > 0);
        }
      }
    }
  }
}

// [rows][heads][dp] → [heads][rows][dp]: one head's rows contiguous (see XlTables).
AlignedFloats heads_major(const std::vector<float>& by_row, std::int64_t rows, std::int64_t heads, std::int64_t dp) {
  AlignedFloats out(by_row.size());
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* from = by_row.data() + (r * heads + h) * dp;
      std::copy(from, from + dp, out.data() + (h * rows + r) * dp);
    }
  }
  return out;
}

const std::vector<double>& sum_slots_per_kv_head(std::span<const TermUnit> units, std::int64_t size,
                                                 std::int64_t kv_heads, CallBuffer buffer) {
  // Each element sums its units in order, so splitting the elements over the cores keeps the bits.
  std::vector<double>& totals = zeroed_doubles(buffer, static_cast<std::size_t>(size * kv_heads));
  constexpr std::int64_t kBlock = 4096;
  const std::int64_t blocks = (size + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) num_threads(threads_for(size* static_cast <std::int64_t>(units.size())))
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t t0 = b * kBlock, t1 = std::min(size, t0 + kBlock);
    for (const TermUnit& unit : units) {
      double* total = totals.data() + unit.kvh * size;
      for (std::int64_t t = t0; t < t1; ++t) total[t] += unit.slot[t];
    }
  }
  return totals;
}

}  // namespace posenc::detail
