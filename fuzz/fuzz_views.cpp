// Tensor views and positions from any numbers: a view is built or refused by name (rank, extents,
// strides, their products in elements and bytes, the dtype); positions are built or refused (ids
// beyond kMaxPosition or negative, cu_seqlens not increasing, lengths that overflow); positions
// that are built answer at(b, s) for every token within max_position(), and RoPE over them either
// runs or names the mismatch with its tensor's grid.
#include <optional>
#include <string>
#include <vector>

#include "fuzzing.hpp"

using namespace posenc;

namespace {

void fuzz_view(fuzz::Input& in) {
  const auto dtype = static_cast<DType>(in.flag() ? in.byte() : in.integer(0, 3));
  const auto rank = static_cast<std::size_t>(in.integer(0, kMaxRank + 1));
  std::vector<std::int64_t> shape, strides;
  for (std::size_t i = 0; i < rank; ++i) shape.push_back(in.flag() ? in.any_integer() : in.integer(0, 9));
  const auto stride_rank = in.flag() ? static_cast<std::size_t>(in.integer(0, kMaxRank + 1)) : rank;
  for (std::size_t i = 0; i < stride_rank; ++i) strides.push_back(in.flag() ? in.any_integer() : in.integer(0, 99));
  static double memory[1];
  void* data = in.flag() ? nullptr : memory;  // never read: only built
  std::optional<ConstTensorView> view;
  if (in.flag()) {
    fuzz::accepted("TensorView::contiguous", [&] { view = ConstTensorView::contiguous(data, dtype, shape); });
  } else {
    fuzz::accepted("TensorView", [&] { view = ConstTensorView(data, dtype, shape, strides); });
  }
  if (!view) return;
  fuzz::require(view->rank() == static_cast<int>(rank), "rank changed");
  fuzz::require(!view->describe().empty(), "empty description");
  const std::int64_t n = view->numel();
  fuzz::require(n >= 0, "negative numel");
  (void)view->is_contiguous();
}

void fuzz_positions(fuzz::Input& in) {
  const std::uint8_t kind = in.byte() % 5;
  std::vector<std::int64_t> numbers(static_cast<std::size_t>(in.integer(0, 12)));
  for (auto& x : numbers) x = in.flag() ? in.any_integer() : in.integer(-2, 40);
  const std::int64_t batch = in.flag() ? in.any_integer() : in.integer(0, 4);
  const std::int64_t seq_len = in.flag() ? in.any_integer() : in.integer(0, 12);
  std::optional<Positions> p;
  fuzz::accepted("Positions", [&] {
    switch (kind) {
      case 0:
        p = Positions::range(seq_len, numbers.empty() ? 0 : numbers[0]);
        break;
      case 1:
        p = Positions::ranges(numbers, seq_len);
        break;
      case 2:
        p = Positions::ids(numbers);
        break;
      case 3:
        p = Positions::ids(numbers, batch, seq_len);
        break;
      default:
        p = Positions::packed(numbers);
    }
  });
  if (!p) return;
  fuzz::require(p->seq_len() >= 0 && p->batch() >= 0, "negative extents");
  fuzz::require(p->max_position() >= 0 && p->max_position() <= kMaxPosition,
                "max_position " + std::to_string(p->max_position()));
  // Every token when there are few, else the corners.
  const std::int64_t rows = std::max<std::int64_t>(p->batch(), 1);
  const bool all = rows <= 4096 && p->seq_len() <= 4096 / rows;
  const auto indices = [all](std::int64_t n) {
    std::vector<std::int64_t> i;
    for (std::int64_t x = 0; x < n; ++x) {
      if (all || x < 3 || x >= n - 3) {
        i.push_back(x);
      } else {
        x = n - 4;  // skip to the last three
      }
    }
    return i;
  };
  for (const std::int64_t b : indices(rows)) {
    for (const std::int64_t s : indices(p->seq_len())) {
      const std::int64_t at = p->at(b, s);
      fuzz::require(at >= 0 && at <= p->max_position(), "at(" + std::to_string(b) + ", " + std::to_string(s) +
                                                            ") = " + std::to_string(at) + " past max_position " +
                                                            std::to_string(p->max_position()));
    }
  }
  // RoPE over the positions on a grid of the fuzzer's choosing (packed: [T, H, D]).
  const std::int64_t grid_batch = in.integer(1, 3), grid_len = in.flag() ? p->seq_len() : in.integer(0, 12);
  if (grid_len > 2048) return;
  const bool packed = kind == 4 && in.flag();
  const std::int64_t heads = 2, dim = 8, tokens = (packed ? 1 : grid_batch) * grid_len;
  std::vector<float> q(static_cast<std::size_t>(tokens * heads * dim), 0.5f);
  const TensorView qv = packed ? TensorView::of(q.data(), {grid_len, heads, dim})
                               : TensorView::of(q.data(), {grid_batch, grid_len, heads, dim});
  const RopeParams params(dim, dim);
  fuzz::accepted("rope_apply", [&] { rope_apply(params, *p, qv, TensorView{}); });
  for (const float x : q) fuzz::require(std::isfinite(x), "RoPE gave a non-finite value");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::set_up();
  fuzz::Input in(data, size);
  if (in.flag()) {
    fuzz_view(in);
  } else {
    fuzz_positions(in);
  }
  return 0;
}
