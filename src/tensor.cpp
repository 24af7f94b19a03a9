#include "posenc/tensor.hpp"

#include <cstdio>
#include <string>

#include "posenc/error.hpp"

namespace posenc {

std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t result = 0;
  if (__builtin_mul_overflow(a, b, &result)) {
    throw Error("size arithmetic", what, std::to_string(a) + " * " + std::to_string(b), "a product that fits in int64");
  }
  return result;
}

std::int64_t checked_add(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t result = 0;
  if (__builtin_add_overflow(a, b, &result)) {
    throw Error("size arithmetic", what, std::to_string(a) + " + " + std::to_string(b), "a sum that fits in int64");
  }
  return result;
}

template <bool kMutable>
BasicTensorView<kMutable>::BasicTensorView(Pointer data, DType dtype, std::span<const std::int64_t> shape,
                                           std::span<const std::int64_t> strides)
    : data_(data), dtype_(dtype) {
  if (shape.empty() || shape.size() > static_cast<std::size_t>(kMaxRank)) {
    throw Error("tensor view", "rank", std::to_string(shape.size()), "1 to " + std::to_string(kMaxRank));
  }
  if (strides.size() != shape.size()) {
    throw Error("tensor view", "strides", std::to_string(strides.size()) + " entries",
                "one stride per axis (" + std::to_string(shape.size()) + ")");
  }
  if (dtype_size(dtype) == 0) {
    throw Error("tensor view", "dtype", std::to_string(static_cast<int>(dtype)), "one of f32, f64, bf16, f16");
  }
  rank_ = static_cast<int>(shape.size());
  std::int64_t count = 1;
  std::int64_t last_offset = 0;
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    const std::string name = "[" + std::to_string(axis) + "]";
    if (shape[axis] < 0) {
      throw Error("tensor view", "shape" + name, std::to_string(shape[axis]), ">= 0");
    }
    if (strides[axis] < 0) {
      throw Error("tensor view", "strides" + name, std::to_string(strides[axis]), ">= 0");
    }
    shape_[axis] = shape[axis];
    strides_[axis] = strides[axis];
    count = checked_mul(count, shape[axis], "tensor view element count");
    if (shape[axis] > 0) {
      last_offset = checked_add(last_offset, checked_mul(shape[axis] - 1, strides[axis], "tensor view extent"),
                                "tensor view extent");
    }
  }
  checked_mul(checked_add(last_offset, 1, "tensor view extent"), static_cast<std::int64_t>(dtype_size(dtype)),
              "tensor view extent in bytes");
  if (count > 0 && data == nullptr) {
    throw Error("tensor view", "data", "null", "a valid pointer for a non-empty view");
  }
  const auto alignment = static_cast<std::uintptr_t>(dtype_size(dtype));  // natural alignment
  if (reinterpret_cast<std::uintptr_t>(data) % alignment != 0) {
    char address[32];
    std::snprintf(address, sizeof(address), "%p", static_cast<const void*>(data));
    throw Error("tensor view", "data", address,
                "a pointer aligned to " + std::to_string(alignment) + " bytes for " + std::string(dtype_name(dtype)));
  }
}

template <bool kMutable>
BasicTensorView<kMutable> BasicTensorView<kMutable>::contiguous(Pointer data, DType dtype,
                                                                std::span<const std::int64_t> shape) {
  std::array<std::int64_t, kMaxRank> strides{};
  if (shape.empty() || shape.size() > static_cast<std::size_t>(kMaxRank)) {
    throw Error("tensor view", "rank", std::to_string(shape.size()), "1 to " + std::to_string(kMaxRank));
  }
  std::int64_t stride = 1;
  for (std::size_t axis = shape.size(); axis-- > 0;) {
    strides[axis] = stride;
    if (shape[axis] > 0) stride = checked_mul(stride, shape[axis], "tensor view element count");
  }
  return BasicTensorView(data, dtype, shape, {strides.data(), shape.size()});
}

template <bool kMutable>
std::int64_t BasicTensorView<kMutable>::numel() const {
  std::int64_t count = rank_ > 0 ? 1 : 0;
  for (int axis = 0; axis < rank_; ++axis) count *= shape_[static_cast<std::size_t>(axis)];
  return count;  // cannot overflow: checked at construction
}

template <bool kMutable>
bool BasicTensorView<kMutable>::is_contiguous() const {
  std::int64_t expected = 1;
  for (int axis = rank_; axis-- > 0;) {
    const auto a = static_cast<std::size_t>(axis);
    if (shape_[a] != 1 && strides_[a] != expected) return false;
    expected *= shape_[a];
  }
  return true;
}

template <bool kMutable>
std::string BasicTensorView<kMutable>::describe() const {
  std::string shape = "[", strides = "[";
  for (int axis = 0; axis < rank_; ++axis) {
    const char* sep = axis + 1 < rank_ ? ", " : "";
    shape += std::to_string(size(axis)) + sep;
    strides += std::to_string(stride(axis)) + sep;
  }
  return shape + "] strides " + strides + "] " + std::string(dtype_name(dtype_));
}

template class BasicTensorView<true>;
template class BasicTensorView<false>;

}  // namespace posenc
