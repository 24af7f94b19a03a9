#include "internal.hpp"

#include "posenc/memory.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <vector>

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
    throw Error(where, std::string(name) + ".rank()", std::to_string(view.rank()), "3 ([B, S, D]) or 2 ([S, D])");
  }
  return g;
}

Grid matrix_grid(const char* where, const char* name, ConstTensorView view) {
  if (view.rank() != 2) {
    throw Error(where, std::string(name) + ".rank()", std::to_string(view.rank()), "2 ([rows, D])");
  }
  return token_grid(where, name, view);
}

std::size_t table_count(const char* where, const char* what, std::initializer_list<std::int64_t> factors) {
  std::int64_t count = 1;
  bool overflow = false;
  std::string text;
  for (const std::int64_t f : factors) {
    overflow = overflow || __builtin_mul_overflow(count, f, &count);
    text += (text.empty() ? "" : " · ") + std::to_string(f);
  }
  if (overflow) throw Error(where, what, text, "a table whose element count fits in int64");
  return checked_allocation(count, sizeof(double), where, what) / sizeof(double);
}

void check_same_dims(const char* where, const char* name, const Grid& got, const char* ref_name, const Grid& ref) {
  if (got.batch != ref.batch || got.seq != ref.seq || got.dim != ref.dim) {
    auto text = [](const Grid& g) {
      return "[" + std::to_string(g.batch) + ", " + std::to_string(g.seq) + ", " + std::to_string(g.dim) + "]";
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
  // Axes of extent > 1 by increasing stride: each stride must reach past everything the axes
  // inside it span, or two indices would name one element and threads would race on it. (A
  // sufficient condition; it accepts every layout made by slicing a contiguous tensor.)
  struct Axis {
    std::int64_t size, stride;
    int index;
  };
  std::vector<Axis> axes;
  for (int axis = 0; axis < view.rank(); ++axis) {
    if (view.size(axis) == 0) return;  // an empty view writes nothing
    if (view.size(axis) > 1) axes.push_back({view.size(axis), view.stride(axis), axis});
  }
  std::sort(axes.begin(), axes.end(),
            [](const Axis& a, const Axis& b) { return a.stride != b.stride ? a.stride < b.stride : a.size < b.size; });
  std::int64_t span = 1;  // elements covered by the axes already visited (their extent + 1)
  for (const Axis& a : axes) {
    if (a.stride < span) {
      throw Error(where, std::string(name) + ".stride(" + std::to_string(a.index) + ")", std::to_string(a.stride),
                  ">= " + std::to_string(span) + ", so that no two elements of an output share memory (" +
                      view.describe() + ")");
    }
    span = a.stride * (a.size - 1) + span;  // <= the view's extent + 1: checked at construction
  }
}

HeadsGrid heads_grid(const char* where, const char* name, ConstTensorView v) {
  if (v.rank() == 4)
    return {v.size(0), v.size(1), v.size(2), v.size(3), v.stride(0), v.stride(1), v.stride(2), v.stride(3)};
  if (v.rank() == 3) return {1, v.size(0), v.size(1), v.size(2), 0, v.stride(0), v.stride(1), v.stride(2)};
  throw Error(where, std::string(name) + ".rank()", std::to_string(v.rank()),
              "4 ([B, S, H, D]) or 3 (packed [T, H, D])");
}

void check_gradient_size(const char* where, const char* name, std::size_t got, std::int64_t expected) {
  if (static_cast<std::int64_t>(got) != expected) {
    throw Error(where, std::string(name) + ".size()", std::to_string(got), std::to_string(expected));
  }
}

HeadsGrid check_output_tokens(const char* where, const char* name, ConstTensorView view, const HeadsGrid& like) {
  const HeadsGrid g = heads_grid(where, name, view);
  if (g.batch != like.batch || g.seq != like.seq || g.heads != like.heads || g.dim != like.dim) {
    throw Error(where, std::string(name) + " shape", view.describe(),
                "[" + std::to_string(like.batch) + ", " + std::to_string(like.seq) + ", " + std::to_string(like.heads) +
                    ", " + std::to_string(like.dim) + "], the shape of the tokens it belongs to");
  }
  check_writable(where, name, view);
  return g;
}

void check_parameter(const char* where, const char* name, const std::vector<double>& values, std::size_t size,
                     const std::string& expected_size) {
  if (values.size() != size)
    throw Error(where, std::string(name) + ".size()", std::to_string(values.size()), expected_size);
  for (std::size_t e = 0; e < values.size(); ++e) {
    if (!std::isfinite(values[e]))
      throw Error(where, std::string(name) + "[" + std::to_string(e) + "]", to_text(values[e]), "finite");
  }
}

void check_cu_seqlens(const char* where, const char* name, const std::vector<std::int64_t>& cu, std::int64_t tokens) {
  if (cu.size() < 2) throw Error(where, name, "size " + std::to_string(cu.size()), "at least 2 entries (0, …, tokens)");
  if (cu.front() != 0) throw Error(where, name, "[0] = " + std::to_string(cu.front()), "0");
  for (std::size_t t = 1; t < cu.size(); ++t) {
    if (cu[t] < cu[t - 1]) {
      throw Error(where, name, "[" + std::to_string(t) + "] = " + std::to_string(cu[t]),
                  "non-decreasing (>= " + std::to_string(cu[t - 1]) + ")");
    }
  }
  if (cu.back() != tokens)
    throw Error(where, name, "last = " + std::to_string(cu.back()), "the token count " + std::to_string(tokens));
}

std::string to_text(double value) {
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

namespace {
// SplitMix64 (Steele, Lea, Flood 2014).
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Uniform in (0, 1]: 53 random bits, never 0 (log is taken below).
double uniform_open0(std::uint64_t bits) { return (static_cast<double>(bits >> 11) + 1.0) * 0x1p-53; }
}  // namespace

double seeded_normal(std::uint64_t seed, std::uint64_t index) {
  // Box–Muller (1958) on draws 2·index and 2·index + 1 of the seed's stream.
  const std::uint64_t key = splitmix64(seed) ^ (index * 2);
  const double u1 = uniform_open0(splitmix64(key));
  const double u2 = uniform_open0(splitmix64(key + 1));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

double sinusoid_inv_frequency(double base, std::int64_t dim, std::int64_t i) {
  // Extended precision so that the exponent 2i/d (often not a binary fraction) and the power
  // round once, at the final conversion to fp64.
  const long double exponent = -2.0L * static_cast<long double>(i) / static_cast<long double>(dim);
  return static_cast<double>(std::pow(static_cast<long double>(base), exponent));
}

}  // namespace posenc::detail
