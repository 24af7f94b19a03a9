// The schemes a HeadGroup holds in fields of its own (Shaw, Transformer-XL) as term definitions
// (term.hpp), so that the attention reference reads them as it reads HeadGroup::terms; and their
// gradients, flat in the definitions' layout, read from and written back to GroupGradients.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "posenc/attention.hpp"
#include "posenc/term.hpp"

namespace posenc::ref {

struct FieldScheme {
  // The group's definition, or null when the group does not hold the scheme. A definition may
  // memoise (a reference call owns the ones it builds; they are not shared between threads).
  std::shared_ptr<const TermDefinition> (*definition)(const HeadGroup& group);
  // The sizes of the scheme's gradient vectors in GroupGradients ({}: none there).
  std::vector<std::size_t> (*sizes)(const GroupGradients& grads);
  // Its gradients, flat in the definition's layout, and back.
  std::vector<double> (*load)(const GroupGradients& grads);
  void (*store)(std::span<const double> flat, GroupGradients& grads);
};
std::span<const FieldScheme> field_schemes();

std::shared_ptr<const TermDefinition> shaw_definition(const ShawParams& params);  // [key table | value table]
std::shared_ptr<const TermDefinition> xl_definition(const XlParams& params);      // [u | v | W_R]

}  // namespace posenc::ref
