// Shortformer's position-infused attention (posenc/absolute.hpp: the sinusoid added to q and k,
// not v) as the fused attention's query/key transform (attention/transforms.hpp).
#include <string>

#include "attention/transforms.hpp"
#include "posenc/absolute.hpp"
#include "posenc/error.hpp"

namespace posenc::detail {

// The sinusoid [D] per table row.
QKTables qk_tables(const AbsoluteQK& absolute, const TransformRows& r) {
  if (absolute.params.dim() != r.head_dim) {
    throw Error(r.where, (r.name + ".params.dim").c_str(), std::to_string(absolute.params.dim()),
                "the head_dim of q, " + std::to_string(r.head_dim));
  }
  QKTables t;
  const auto rows = static_cast<std::int64_t>(r.table_ids.size());
  t.kind = QKTables::kAbsolute;
  t.transform_keys = true;
  t.absolute.resize(static_cast<std::size_t>(rows * r.head_dim));
  sinusoidal_table(absolute.params, r.table_positions, TensorView::of(t.absolute.data(), {rows, r.head_dim}));
  return t;
}

}  // namespace posenc::detail
