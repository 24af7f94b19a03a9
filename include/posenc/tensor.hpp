// posenc/tensor.hpp — strided, typed, non-owning views of caller memory.
//
// A view is (pointer, dtype, shape, strides). Strides count elements, not bytes, so a view of
// keys inside a fused QKV buffer or a [B, H, S, D] slice of a [B, S, H, D] tensor needs no copy:
//
//   memory:  q0 k0 v0 | q1 k1 v1 | q2 k2 v2 ...        (each block D elements)
//   K view:  data = base + D, shape = [S, D], strides = [3·D, 1]
//
// Contract (checked when the view is built; violations throw posenc::Error):
//   - 1 <= rank <= kMaxRank; every extent >= 0; every stride >= 0 (0 broadcasts an input);
//   - the element count and the furthest element offset, in elements and in bytes, fit in int64;
//   - a non-empty view has a non-null pointer.
// Kernels additionally check that an output view does not broadcast (stride 0 over an extent
// > 1), since that would write one element several times.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <type_traits>

#include "posenc/dtype.hpp"

namespace posenc {

inline constexpr int kMaxRank = 6;

// Overflow-checked int64 arithmetic; `what` names the quantity in the error message.
std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* what);
std::int64_t checked_add(std::int64_t a, std::int64_t b, const char* what);

template <bool kMutable>
class BasicTensorView {
 public:
  using Pointer = std::conditional_t<kMutable, void*, const void*>;

  BasicTensorView() = default;
  BasicTensorView(Pointer data, DType dtype, std::span<const std::int64_t> shape,
                  std::span<const std::int64_t> strides);
  // Row-major (C-contiguous) strides.
  static BasicTensorView contiguous(Pointer data, DType dtype, std::span<const std::int64_t> shape);

  // Typed conveniences: TensorView::of(ptr, {B, S, D}) or with explicit strides.
  template <class T>
  static BasicTensorView of(T* data, std::initializer_list<std::int64_t> shape) {
    return contiguous(data, dtype_of<std::remove_const_t<T>>(), {shape.begin(), shape.size()});
  }
  template <class T>
  static BasicTensorView of(T* data, std::initializer_list<std::int64_t> shape,
                            std::initializer_list<std::int64_t> strides) {
    return BasicTensorView(data, dtype_of<std::remove_const_t<T>>(), {shape.begin(), shape.size()},
                           {strides.begin(), strides.size()});
  }

  // A mutable view converts to a const one.
  operator BasicTensorView<false>() const requires kMutable {
    BasicTensorView<false> v;
    v.data_ = data_;
    v.dtype_ = dtype_;
    v.rank_ = rank_;
    v.shape_ = shape_;
    v.strides_ = strides_;
    return v;
  }

  Pointer data() const { return data_; }
  DType dtype() const { return dtype_; }
  int rank() const { return rank_; }
  std::int64_t size(int axis) const { return shape_[static_cast<std::size_t>(axis)]; }
  std::int64_t stride(int axis) const { return strides_[static_cast<std::size_t>(axis)]; }
  std::int64_t numel() const;
  bool is_contiguous() const;
  // "[2, 3, 4] strides [12, 4, 1] f32" — for error messages.
  std::string describe() const;

  // Pointer to element at `offset` elements from data() (no bounds check; kernels use it
  // after validating shapes).
  template <class T>
  auto typed(std::int64_t offset = 0) const {
    using Elem = std::conditional_t<kMutable, T, const T>;
    return static_cast<Elem*>(data_) + offset;
  }

 private:
  template <bool>
  friend class BasicTensorView;

  Pointer data_ = nullptr;
  DType dtype_ = DType::kF32;
  int rank_ = 0;
  std::array<std::int64_t, kMaxRank> shape_{};
  std::array<std::int64_t, kMaxRank> strides_{};
};

using TensorView = BasicTensorView<true>;
using ConstTensorView = BasicTensorView<false>;

extern template class BasicTensorView<true>;
extern template class BasicTensorView<false>;

}  // namespace posenc
