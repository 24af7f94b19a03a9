#include "kernels.hpp"

#include <hwy/aligned_allocator.h>

#include <algorithm>
#include <vector>

#include "posenc/posenc.hpp"

namespace posenc::perf {
namespace {

// 64-byte aligned, as PyTorch and NumPy allocate tensors.
struct Buffer {
  hwy::AlignedFreeUniquePtr<float[]> data;
  std::size_t count = 0;
  void assign(std::size_t n, float value) {
    data = hwy::AllocateAligned<float>(n);
    count = n;
    std::fill(data.get(), data.get() + n, value);
  }
  std::size_t size() const { return count; }
  float* get() const { return data.get(); }
};
struct Buffers {
  Buffer a, b, c;
};

void require_positive(const char* name, std::int64_t value) {
  if (value < 1) throw Error("bench", name, std::to_string(value), ">= 1");
}

std::string shape(const CaseOptions& o) {
  return "[" + std::to_string(o.batch) + ", " + std::to_string(o.length) + ", " +
         std::to_string(o.dim) + "] f32";
}

}  // namespace

std::vector<std::string> case_names() {
  return {"sinusoidal", "sinusoidal-add", "learned-forward", "learned-backward", "rope"};
}

Case make_case(const std::string& name, const CaseOptions& o) {
  require_positive("length", o.length);
  require_positive("dim", o.dim);
  require_positive("batch", o.batch);
  auto buf = std::make_shared<Buffers>();
  const auto tokens = static_cast<std::size_t>(checked_mul(o.batch, o.length, "tokens"));
  const auto elems = static_cast<std::size_t>(checked_mul(static_cast<std::int64_t>(tokens), o.dim, "elements"));
  const double bytes = static_cast<double>(elems) * sizeof(float);
  Case c;
  c.name = name;
  c.state = buf;
  if (name == "sinusoidal") {
    const SinusoidalParams params(o.dim);
    buf->a.assign(static_cast<std::size_t>(o.length * o.dim), 0.0f);
    c.description = "table [" + std::to_string(o.length) + ", " + std::to_string(o.dim) + "] f32";
    c.bytes_per_run = static_cast<double>(buf->a.size()) * sizeof(float);
    c.limit_name = "copy_nt";
    c.run = [params, buf, o] {
      sinusoidal_table(params, Positions::range(o.length),
                       TensorView::of(buf->a.get(), {o.length, o.dim}));
    };
  } else if (name == "sinusoidal-add") {
    const SinusoidalParams params(o.dim);
    buf->a.assign(elems, 1.0f);
    buf->b.assign(elems, 0.0f);
    c.description = "x, out " + shape(o);
    c.bytes_per_run = 2 * bytes;  // read x, write out
    c.limit_name = "copy";
    c.run = [params, buf, o] {
      sinusoidal_add(params, ConstTensorView::of(buf->a.get(), {o.batch, o.length, o.dim}),
                     Positions::range(o.length),
                     TensorView::of(buf->b.get(), {o.batch, o.length, o.dim}));
    };
  } else if (name == "learned-forward" || name == "learned-backward") {
    // A GPT-2-like table of max_len = length rows; positions 0 … length-1 per batch row.
    buf->a.assign(elems, 1.0f);                                    // x or dy
    buf->b.assign(static_cast<std::size_t>(o.length * o.dim), 0.5f);  // table or d_table
    buf->c.assign(elems, 0.0f);                                    // y or dx
    c.limit_name = "copy";
    if (name == "learned-forward") {
      c.description = "x, y " + shape(o) + ", table [" + std::to_string(o.length) + ", " +
                      std::to_string(o.dim) + "]";
      c.bytes_per_run = 2 * bytes + static_cast<double>(buf->b.size()) * sizeof(float);
      c.run = [buf, o] {
        learned_forward(ConstTensorView::of(buf->b.get(), {o.length, o.dim}),
                        ConstTensorView::of(buf->a.get(), {o.batch, o.length, o.dim}),
                        Positions::range(o.length),
                        TensorView::of(buf->c.get(), {o.batch, o.length, o.dim}));
      };
    } else {
      c.description = "dy " + shape(o) + " scattered into d_table [" + std::to_string(o.length) +
                      ", " + std::to_string(o.dim) + "]";
      // read dy; read and write each d_table row (all rows are touched, and a row's repeats
      // across the batch stay in cache)
      c.bytes_per_run = bytes + 2 * static_cast<double>(buf->b.size()) * sizeof(float);
      c.limit_name = "rmw";
      c.run = [buf, o] {
        learned_backward(ConstTensorView::of(buf->a.get(), {o.batch, o.length, o.dim}),
                         Positions::range(o.length),
                         TensorView::of(buf->b.get(), {o.length, o.dim}));
      };
    }
  } else if (name == "rope") {
    require_positive("heads", o.heads);
    require_positive("kv_heads", o.kv_heads);
    const RopeParams params(o.dim, o.dim, 10000.0, o.interleaved ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit);
    const std::int64_t q_count = checked_mul(static_cast<std::int64_t>(tokens), o.heads * o.dim, "q elements");
    const std::int64_t k_count = checked_mul(static_cast<std::int64_t>(tokens), o.kv_heads * o.dim, "k elements");
    buf->a.assign(static_cast<std::size_t>(q_count + k_count), 0.5f);  // q then k
    buf->b.assign(static_cast<std::size_t>(q_count + k_count), 0.0f);  // q_out then k_out
    c.description = "q [" + std::to_string(o.batch) + ", " + std::to_string(o.length) + ", " + std::to_string(o.heads) +
                    ", " + std::to_string(o.dim) + "], k with " + std::to_string(o.kv_heads) + " heads, f32, " +
                    (o.interleaved ? "interleaved" : "half-split") + ", out of place";
    c.bytes_per_run = 2.0 * static_cast<double>(q_count + k_count) * sizeof(float);  // read + write
    c.limit_name = "copy_nt";
    c.run = [params, buf, o, q_count] {
      rope_apply(params, Positions::range(o.length),
                 ConstTensorView::of(buf->a.get(), {o.batch, o.length, o.heads, o.dim}),
                 ConstTensorView::of(buf->a.get() + q_count, {o.batch, o.length, o.kv_heads, o.dim}),
                 TensorView::of(buf->b.get(), {o.batch, o.length, o.heads, o.dim}),
                 TensorView::of(buf->b.get() + q_count, {o.batch, o.length, o.kv_heads, o.dim}));
    };
  } else {
    std::string names;
    for (const auto& n : case_names()) names += (names.empty() ? "" : ", ") + n;
    throw Error("bench", "kernel", name, "one of: " + names);
  }
  return c;
}

}  // namespace posenc::perf
