// Argument validation of the absolute encodings, shared by the SIMD entry points (absolute.cpp)
// and the fp64 reference (ref/absolute_ref.cpp), so that both reject exactly the same input.
#pragma once

#include <initializer_list>
#include <utility>

#include "internal.hpp"
#include "posenc/absolute.hpp"

namespace posenc::detail {

struct AddGrids {
  Grid x, out;
};
struct LearnedGrids {
  Grid table, x, out;
  bool has_dx = false;
};

Grid check_sinusoidal_table(const SinusoidalParams& params, const Positions& positions, ConstTensorView out);
AddGrids check_sinusoidal_add(const SinusoidalParams& params, ConstTensorView x, const Positions& positions,
                              ConstTensorView out);
// Grids: forward (table, x, y); backward (d_table, dy, dx) with dx optional (an empty view).
LearnedGrids check_learned_forward(ConstTensorView table, ConstTensorView x, const Positions& positions,
                                   ConstTensorView y);
LearnedGrids check_learned_backward(ConstTensorView dy, const Positions& positions, ConstTensorView d_table,
                                    ConstTensorView dx);

enum class Alias : bool { kDisjoint, kDisjointOrInPlace };
// `out` must not overlap `in`, except (with kDisjointOrInPlace) by being exactly the same view.
void check_alias(const char* where, const char* out_name, ConstTensorView out, const char* in_name, ConstTensorView in,
                 Alias allowed);
// Outputs (name, view) disjoint from every input and from each other (empty views skipped).
using NamedView = std::pair<const char*, ConstTensorView>;
void check_disjoint(const char* where, std::initializer_list<NamedView> outputs,
                    std::initializer_list<NamedView> inputs);

}  // namespace posenc::detail
