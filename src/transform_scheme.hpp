// QKTransformScheme, the open end of QKTransform (posenc/attention.hpp): a transform of q and k by
// their positions in one of the two forms the kernels run (pairs rotated by per-position angles,
// or per-position rows added). It gives its fused form for a call (the tables,
// attention/transforms.hpp) and its fp64 definition, which the attention reference applies
// (ref/transforms_ref.hpp). Both are the library's own types, so a new transform lives in the
// library; the public header declares the class only. Internal.
#pragma once

#include <string_view>

#include "posenc/attention.hpp"

namespace posenc {

namespace detail {
struct QKTables;
struct TransformRows;
}  // namespace detail
namespace ref {
struct TransformedRows;
}  // namespace ref

class QKTransformScheme {
 public:
  virtual ~QKTransformScheme() = default;
  virtual std::string_view scheme_name() const = 0;
  virtual detail::QKTables tables(const detail::TransformRows& rows) const = 0;
  virtual void reference_apply(const ref::TransformedRows& rows) const = 0;
};

}  // namespace posenc
