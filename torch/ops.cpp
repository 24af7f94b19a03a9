// posenc's PyTorch custom operators (namespace `posenc`), one adapter for C++ (libtorch) and Python
// callers: each op is a plain C++ function registered with TORCH_LIBRARY, and differentiable ops
// go through torch::autograd::Function, so autograd works from either side.
//
//   posenc::sinusoidal_table(Tensor positions, int dim, float base, bool interleaved, ScalarType dtype)
//   posenc::rope(Tensor q, Tensor k, Tensor positions, Rope params, int seq_len, int direction)
//                   -> (Tensor, Tensor)   seq_len: the length that selects dynamic / longrope
//                   frequencies (0: the positions' max + 1)
//   posenc::rope_(q, k, positions, params, seq_len, direction)   the same in place (returns q and k)
//   posenc::rope_multi(q, k, positions [axes, S], params, seq_len, int[] sections, bool interleaved,
//                   int[] axis_of_pair, bool restart, direction)   multi-axis RoPE (M-RoPE
//                   sections, interleaved M-RoPE, 2-D axial with restart)
//   posenc::rope_rerotate_(k, from_positions, Rope from_params, int from_seq_len, to_positions,
//                   Rope to_params, int to_seq_len)   a rotated KV cache moved to new positions
//   posenc::rope_pickled, rope_pickled_ (-> ()), rope_multi_pickled   the same with the Rope as its
//                   pickled bytes (uint8 [n]): what the autograd kernels call while a tracer runs
//   posenc::NAME_backward   the gradients of learned, floater_table, shaw_scores, shaw_values and
//                   xl_scores: their autograd kernels call the forward and this op through the
//                   dispatcher, so that a tracer records both (fake kernels: python/posenc/_fake.py).
//                   The score biases (ALiBi, T5, Kerple, FIRE, TUPE, …) are the registry's,
//                   through score_bias (attention_ops.cpp)
//   posenc::learned(Tensor table, Tensor x, Tensor positions) -> Tensor   x + table[positions]
//   posenc::shaw_scores, shaw_values, xl_scores   Shaw's score and value terms, Transformer-XL's
//                   position terms (differentiable in their tensors and tables)
//   posenc::floater_table(w1, b1, w2, b2, p0, int length, float time_per_position, int substeps)
//   posenc::attention(q, k, v, Scheme[] schemes, Tensor[] params, Tensor[] gates, Tensor? sinks,
//                     bool causal, int window_left, int window_right, int? chunk_size,
//                     Temperature? temperature, float softcap, float? scale, Tensor? q_positions,
//                     Tensor? k_positions, int[] cu_seqlens_q, int[] cu_seqlens_k,
//                     bool skip_vanishing_tiles) -> (Tensor out, Tensor lse)
//                   fused attention (posenc/attention.hpp), q [B, Sq, H, D], k, v [B, Sk, G, D]
//                   (or packed [T, H, D] with cu_seqlens); differentiable in q, k, v, params, the
//                   gates and the sinks. `schemes`: one registered scheme per head group, their
//                   heads covering q's in order; `params`: empty (every scheme's initial values) or
//                   one tensor per group in the registry's parameter_shape (a 1-D empty tensor for
//                   a scheme without learned parameters, or whose entry fixes them: its own); `gates`: empty, or one
//                   per head group: the per-token input of a scheme that reads one (the registry's inputs: forgetting's
//                   log_fgate), else a log forget gate [B, Sk, heads] added to the group's scheme
//                   (posenc/forgetting.hpp), or an empty tensor; `sinks`: [H] logits (posenc/sinks.hpp); `scale`: None
//                   for 1/sqrt(D)
//   posenc::attention_backward(…, out, lse, d_out, …) -> (dq, dk, dv, Tensor[] d_params)
//                   one call's backward given the whole sequence's out and lse (context parallelism)
//   posenc::schemes() -> str   the registry as JSON
//   posenc::score_bias(Scheme scheme, Tensor? params, Tensor q_positions, Tensor k_positions,
//                   ScalarType dtype, int head_dim=1) -> Tensor   any registered scheme of the
//                   relative-bias or bias family materialised, [B, H, Sq, Sk], differentiable in
//                   params (None: its initial values; head_dim: what its parameter shape reads);
//                   score_bias_pickled(Tensor scheme, …, int heads, int head_dim) its traced form and
//                   score_bias_backward(grad, Tensor scheme, params, q_positions, k_positions, head_dim)
//   posenc::qk_transform(Scheme scheme, Tensor x [P, D] f64, Tensor positions [P], bool keys,
//                   int seq_len) -> Tensor   a registered transform applied by its fp64 definition
//                   (no gradient: posenc.flex reads the transforms' tables from it)
//   posenc::empty_cache()   frees the cached blocks of large outputs (see BlockCache) and of
//                   attention plans' tables (posenc/memory.hpp)
//   posenc::huge_page_zeros(int[] shape, ScalarType dtype)   a zero-filled tensor on 2 MiB pages
//                   (posenc/memory.hpp): for KV caches that decode reads
//
// Rope, Scheme and Temperature are the typed classes torch.classes.posenc.* (classes.hpp).
// Positions are int64 tensors [S] (shared by the batch) or [B, S]. posenc::Error becomes a Python
// ValueError (its message names the parameter, the value and what was expected); tensors of an
// unsupported dtype, or on another device beside a CPU tensor, become TypeError. Meta tensors run
// the fake kernels (python/posenc/_fake.py); an op whose tensors are all on another device finds
// no kernel there (the dispatcher's NotImplementedError names the op and the device).
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "adapter.hpp"
#include "posenc/torch/classes.hpp"
#include "posenc/posenc.hpp"

namespace posenc::torch_adapter {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

DType dtype_of(const char* where, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kF32;
    case at::kDouble:
      return DType::kF64;
    case at::kBFloat16:
      return DType::kBF16;
    case at::kHalf:
      return DType::kF16;
    default:
      TORCH_CHECK_TYPE(false, where, ": ", name, ".dtype = ", c10::toString(t.scalar_type()),
                       "; expected float32, float64, bfloat16 or float16");
  }
  return DType::kF32;
}

void check_cpu(const char* where, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.device().is_cpu(), where, ": ", name, ".device = ", t.device().str(),
                   "; expected cpu (posenc's kernels run on the CPU)");
}

std::vector<std::int64_t> sizes_of(const at::Tensor& t) { return {t.sizes().begin(), t.sizes().end()}; }
std::vector<std::int64_t> strides_of(const at::Tensor& t) { return {t.strides().begin(), t.strides().end()}; }

ConstTensorView const_view(const char* where, const char* name, const at::Tensor& t) {
  check_cpu(where, name, t);
  return ConstTensorView(t.data_ptr(), dtype_of(where, name, t), sizes_of(t), strides_of(t));
}

TensorView mutable_view(const char* where, const char* name, at::Tensor& t) {
  check_cpu(where, name, t);
  return TensorView(t.data_ptr(), dtype_of(where, name, t), sizes_of(t), strides_of(t));
}

// Positions borrow the ids: `ids` must stay alive (and contiguous int64) while they are used.
Positions positions_of(const char* where, const char* name, const at::Tensor& ids) {
  check_cpu(where, name, ids);
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong, where, ": ", name, ".dtype = ", c10::toString(ids.scalar_type()),
                   "; expected int64");
  TORCH_CHECK_VALUE(ids.is_contiguous() && (ids.dim() == 1 || ids.dim() == 2), where, ": ", name,
                    " must be a contiguous [S] or [B, S] tensor, got shape ", ids.sizes());
  const std::span<const std::int64_t> span(ids.data_ptr<std::int64_t>(), static_cast<std::size_t>(ids.numel()));
  if (ids.dim() == 1) return Positions::ids(span);
  // [0, S] ids (a batch of 0, whose outputs are empty) name no token: positions shared by no rows.
  if (ids.size(0) == 0) return Positions::range(ids.size(1));
  return Positions::ids(span, ids.size(0), ids.size(1));
}

// The length that selects dynamic / longrope frequencies: 0 means the positions' max + 1.
std::int64_t seq_len_of(const char* where, const char* name, std::int64_t seq_len) {
  if (seq_len < 0) throw Error(where, name, std::to_string(seq_len), ">= 0 (0: the positions' max + 1)");
  return seq_len;
}

RopeDirection direction_of(std::int64_t code) {
  if (code < 0 || code > 2)
    throw Error("rope", "direction", std::to_string(code), "0 (forward), 1 (backward) or 2 (inverse)");
  return static_cast<RopeDirection>(code);
}

bool absent(const at::Tensor& t) { return !t.defined() || (t.dim() == 1 && t.numel() == 0); }

torch::jit::Stack call_below_autograd(const char* name, torch::jit::Stack stack) {
  const c10::OperatorHandle handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  at::AutoDispatchBelowADInplaceOrView guard;
  handle.callBoxed(&stack);
  return stack;
}

bool traced(const at::Tensor& t) { return t.defined() && t.key_set().has(c10::DispatchKey::Python); }
bool traced(at::TensorList ts) {
  return std::any_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return traced(t); });
}

at::Tensor pickled(const c10::IValue& value) {
  const std::vector<char> bytes = torch::pickle_save(value);
  at::Tensor t;
  {
    // Made with data outside the tracer's modes, then handed to them as torch.tensor does: a
    // tracer records it as a constant of the graph.
    const c10::impl::ExcludeDispatchKeyGuard no_modes(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    t = at::tensor(at::ArrayRef<std::uint8_t>(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()),
                   at::kByte);
  }
  return at::lift_fresh(t);
}

std::string bytes_of(const char* where, const char* name, const at::Tensor& bytes, const char* expected) {
  TORCH_CHECK_VALUE(bytes.defined() && bytes.device().is_cpu() && bytes.scalar_type() == at::kByte && bytes.dim() == 1,
                    where, ": ", name, " is ",
                    bytes.defined() ? c10::str(bytes.scalar_type(), " ", bytes.sizes(), " on ", bytes.device())
                                    : std::string("undefined"),
                    "; expected ", expected, " as a uint8 [n] cpu tensor");
  const at::Tensor c = bytes.contiguous();
  return {reinterpret_cast<const char*>(c.data_ptr<std::uint8_t>()), static_cast<std::size_t>(c.numel())};
}

c10::IValue unpickled(const char* where, const char* name, const std::string& bytes, const char* expected) {
  try {
    return torch::jit::pickle_load_obj(bytes);
  } catch (const c10::ValueError&) {
    throw;  // a value the classes' __setstate__ refused, by name
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, where, ": ", name, " are not ", expected, " (", e.what_without_backtrace(), ")");
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, where, ": ", name, " are not ", expected, " (", e.what(), ")");
  }
}
c10::IValue unpickled(const char* where, const char* name, const at::Tensor& bytes, const char* expected) {
  return unpickled(where, name, bytes_of(where, name, bytes, expected), expected);
}

// An op split as NAME and NAME_backward, from its autograd kernel. The forward saves the tensors
// and the options (by name) and calls NAME(tensors…, options…) below autograd; the backward calls
// NAME_backward(grad, tensors…, the options it names…), whose outputs are the gradients of the
// first inputs, and gives the other inputs (positions, options) none.
at::Tensor call_forward(AutogradContext* ctx, const char* name, const variable_list& tensors,
                        std::initializer_list<std::pair<const char*, c10::IValue>> options) {
  ctx->save_for_backward(tensors);
  ctx->saved_data["inputs"] = static_cast<std::int64_t>(tensors.size() + options.size());
  torch::jit::Stack stack(tensors.begin(), tensors.end());
  for (const auto& [key, value] : options) {
    ctx->saved_data[key] = value;
    stack.push_back(value);
  }
  return call_below_autograd(name, std::move(stack))[0].toTensor();
}
variable_list call_backward(AutogradContext* ctx, const char* name, const at::Tensor& grad,
                            std::initializer_list<const char*> options) {
  const variable_list saved = ctx->get_saved_variables();
  torch::jit::Stack stack{grad};
  stack.insert(stack.end(), saved.begin(), saved.end());
  for (const char* key : options) stack.push_back(ctx->saved_data[key]);
  const torch::jit::Stack d = call_below_autograd(name, std::move(stack));
  variable_list grads;
  for (const c10::IValue& g : d) grads.push_back(g.toTensor());
  grads.resize(static_cast<std::size_t>(ctx->saved_data["inputs"].toInt()));
  return grads;
}

// Large outputs come from a cache of the blocks earlier outputs freed. A fresh block of a
// Llama-sized q and k (80 MB) costs ~25 ms of first-touch page faults on this class of machine —
// four times the rotation itself — and a training or decoding loop asks for the same sizes every
// step. Blocks are reused only for the same byte count, the cache keeps at most kMaxCachedBytes,
// and posenc.empty_cache() returns everything to the system.
class BlockCache {
 public:
  static BlockCache& instance() {
    static BlockCache* cache = new BlockCache();  // never destroyed: tensors may outlive static destruction
    return *cache;
  }
  void* take(std::size_t bytes) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto it = free_.find(bytes);
      if (it != free_.end()) {
        void* block = it->second;
        free_.erase(it);
        cached_ -= bytes;
        return block;
      }
    }
    void* block = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (block == nullptr) throw std::bad_alloc();
    return block;
  }
  void give_back(void* block, std::size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (cached_ + bytes > kMaxCachedBytes) {
      std::free(block);
      return;
    }
    free_.emplace(bytes, block);
    cached_ += bytes;
  }
  void clear() {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [bytes, block] : free_) std::free(block);
    free_.clear();
    cached_ = 0;
  }

 private:
  static constexpr std::size_t kMaxCachedBytes = std::size_t{1} << 30;
  std::mutex mutex_;
  std::multimap<std::size_t, void*> free_;
  std::size_t cached_ = 0;
};

// An uninitialised contiguous output; blocks of 1 MiB or more come from the BlockCache.
at::Tensor empty_output(at::IntArrayRef sizes, c10::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
  std::size_t bytes = c10::elementSize(dtype);
  for (const auto size : sizes) bytes *= static_cast<std::size_t>(size);
  if (bytes < (std::size_t{1} << 20)) return at::empty(sizes, options);
  void* block = BlockCache::instance().take(bytes);
  return at::from_blob(
      block, sizes, [bytes](void* p) { BlockCache::instance().give_back(p, bytes); }, options);
}

void empty_cache_op() {
  BlockCache::instance().clear();
  posenc::empty_cache();  // the attention plans' tables
}

bool bf16_dot_products_op() { return posenc::bf16_dot_products(); }

// A zero-filled contiguous CPU tensor on 2 MiB pages (posenc::HugePageBuffer), for KV caches:
// decode reads one head's row per 4 KiB page of an ordinary allocation (posenc/memory.hpp).
at::Tensor huge_page_zeros_op(at::IntArrayRef sizes, c10::ScalarType dtype) {
  return translating([&] {
    std::int64_t count = 1;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] < 0) {
        throw Error("huge_page_zeros", "shape[" + std::to_string(i) + "]", std::to_string(sizes[i]), ">= 0");
      }
      count = checked_mul(count, sizes[i], "huge_page_zeros: shape");
    }
    const auto bytes = static_cast<std::size_t>(
        checked_mul(count, static_cast<std::int64_t>(c10::elementSize(dtype)), "huge_page_zeros: shape"));
    auto* buffer = new HugePageBuffer(bytes);
    return at::from_blob(
        buffer->data() != nullptr ? buffer->data() : static_cast<void*>(buffer), sizes,
        [buffer](void*) { delete buffer; }, at::TensorOptions().dtype(dtype));
  });
}

// Rotates q (and k) out of place; returns (q_out, k_out), k_out empty without k.
std::tuple<at::Tensor, at::Tensor> rope_apply_tensors(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& positions,
                                                      const c10::intrusive_ptr<RopeClass>& params, std::int64_t seq_len,
                                                      std::int64_t direction) {
  return translating([&] {
    const char* where = "rope";
    const RopeParams& p = params->params;
    const at::Tensor ids = positions.contiguous();
    const Positions pos = positions_of(where, "positions", ids);
    at::Tensor q_out = empty_output(q.sizes(), q.scalar_type());
    at::Tensor k_out = absent(k) ? q.new_empty({0}) : empty_output(k.sizes(), k.scalar_type());
    rope_apply(p, pos, const_view(where, "q", q), absent(k) ? ConstTensorView() : const_view(where, "k", k),
               mutable_view(where, "q_out", q_out), absent(k) ? TensorView() : mutable_view(where, "k_out", k_out),
               direction_of(direction), seq_len_of(where, "seq_len", seq_len));
    return std::make_tuple(q_out, k_out);
  });
}

// In place: q (and k) rotated where they are.
void rope_apply_inplace(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                        const c10::intrusive_ptr<RopeClass>& params, std::int64_t seq_len, std::int64_t direction) {
  translating([&] {
    const char* where = "rope_";
    const RopeParams& p = params->params;
    const at::Tensor ids = positions.contiguous();
    const Positions pos = positions_of(where, "positions", ids);
    rope_apply(p, pos, mutable_view(where, "q", q), absent(k) ? TensorView() : mutable_view(where, "k", k),
               direction_of(direction), seq_len_of(where, "seq_len", seq_len));
    return 0;
  });
}

// KV-cache re-rotation in place (rotary.hpp: rope_rerotate): keys rotated under (from params,
// from positions) become keys rotated under (to params, to positions). Caches hold no gradient.
at::Tensor rope_rerotate_op(at::Tensor k, const at::Tensor& from_positions,
                            const c10::intrusive_ptr<RopeClass>& from_params, std::int64_t from_seq_len,
                            const at::Tensor& to_positions, const c10::intrusive_ptr<RopeClass>& to_params,
                            std::int64_t to_seq_len) {
  return translating([&] {
    const char* where = "rope_rerotate_";
    const RopeParams &from = from_params->params, &to = to_params->params;
    const at::Tensor from_ids = from_positions.contiguous(), to_ids = to_positions.contiguous();
    const Positions from_pos = positions_of(where, "from_positions", from_ids);
    const Positions to_pos = positions_of(where, "to_positions", to_ids);
    rope_rerotate(from, from_pos, seq_len_of(where, "from_seq_len", from_seq_len), to, to_pos,
                  seq_len_of(where, "to_seq_len", to_seq_len), const_view(where, "k", k), mutable_view(where, "k", k));
    return k;
  });
}

// Caches hold no gradient: refused for a k that requires one; the in-place write bumps k's version.
at::Tensor rope_rerotate_autograd(at::Tensor k, const at::Tensor& from_positions,
                                  const c10::intrusive_ptr<RopeClass>& from_params, std::int64_t from_seq_len,
                                  const at::Tensor& to_positions, const c10::intrusive_ptr<RopeClass>& to_params,
                                  std::int64_t to_seq_len) {
  TORCH_CHECK_VALUE(!k.requires_grad() || !at::GradMode::is_enabled(),
                    "rope_rerotate_: k requires grad; expected a cache tensor (re-rotation has no gradient)");
  call_below_autograd("posenc::rope_rerotate_", torch::jit::Stack{k, from_positions, from_params, from_seq_len,
                                                                  to_positions, to_params, to_seq_len});
  if (!k.is_inference()) torch::autograd::impl::bump_version(k);
  return k;
}

// Multi-axis RoPE (M-RoPE, 2-D axial): positions [A, S] or [A, B, S], one row per axis.
std::tuple<at::Tensor, at::Tensor> rope_multi_tensors(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& positions,
                                                      const c10::intrusive_ptr<RopeClass>& params, std::int64_t seq_len,
                                                      const std::vector<std::int64_t>& sections, bool interleaved,
                                                      const std::vector<std::int64_t>& axis_of_pair, bool restart,
                                                      std::int64_t direction) {
  return translating([&] {
    const char* where = "rope_multi";
    const RopeParams& p = params->params;
    TORCH_CHECK_VALUE(positions.dim() == 2 || positions.dim() == 3, where, ": positions shape ", positions.sizes(),
                      "; expected [axes, S] or [axes, B, S]");
    // The pairs' axes: given, or from the sections (consecutive or interleaved, rotary.hpp).
    std::vector<std::int64_t> axes = axis_of_pair;
    if (axes.empty()) {
      if (positions.size(0) != static_cast<std::int64_t>(sections.size())) {
        throw Error(where, "positions.size(0)", std::to_string(positions.size(0)),
                    "one Positions per section (" + std::to_string(sections.size()) + ")");
      }
      std::int64_t total = 0;
      for (const std::int64_t n : sections) total += n;
      if (total != p.rotary_dim() / 2) {
        throw Error(where, "sum of sections", std::to_string(total),
                    "rotary_dim / 2 = " + std::to_string(p.rotary_dim() / 2));
      }
      axes = mrope_axis_of_pair(sections, interleaved ? MropeLayout::kInterleaved : MropeLayout::kSections);
    } else if (!sections.empty()) {
      throw Error(where, "sections", std::to_string(sections.size()) + " given", "none beside axis_of_pair");
    }
    const at::Tensor ids = positions.contiguous();
    std::vector<at::Tensor> rows;
    std::vector<Positions> axis_rows;
    for (std::int64_t a = 0; a < ids.size(0); ++a) rows.push_back(ids[a].contiguous());
    for (const at::Tensor& row : rows) axis_rows.push_back(positions_of(where, "positions", row));
    at::Tensor q_out = empty_output(q.sizes(), q.scalar_type());
    at::Tensor k_out = absent(k) ? q.new_empty({0}) : empty_output(k.sizes(), k.scalar_type());
    rope_apply_axes(p, axes, axis_rows, const_view(where, "q", q),
                    absent(k) ? ConstTensorView() : const_view(where, "k", k), mutable_view(where, "q_out", q_out),
                    absent(k) ? TensorView() : mutable_view(where, "k_out", k_out), direction_of(direction), restart,
                    seq_len_of(where, "seq_len", seq_len));
    return std::make_tuple(q_out, k_out);
  });
}

// A Rope argument: the object (an eager call of rope, rope_, rope_multi) or its pickled bytes (their
// _pickled forms, which a traced call records).
c10::intrusive_ptr<RopeClass> rope_object(const char* where, const c10::IValue& params) {
  if (!params.isTensor()) return params.toCustomClass<RopeClass>();
  return unpickled_object<RopeClass>(where, "params", params.toTensor(), "a pickled torch.classes.posenc.Rope");
}

// The op a rotation's autograd kernel calls below autograd: NAME with the object, or, while a
// tracer runs, NAME_pickled (NAME_pickled_ in place) with its bytes as a constant of the graph.
std::string rotation_op(const std::string& name, torch::jit::Stack& options, bool tracing) {
  if (tracing && !options[0].isTensor()) options[0] = pickled(options[0]);
  if (!options[0].isTensor()) return "posenc::" + name;
  return "posenc::" + (name.back() == '_' ? name.substr(0, name.size() - 1) + "_pickled_" : name + "_pickled");
}

c10::List<c10::IValue> ivalue_list(const torch::jit::Stack& values) {
  c10::List<c10::IValue> list(c10::AnyType::get());
  for (const c10::IValue& v : values) list.push_back(v);
  return list;
}

// An eager rotation with the Rope object runs its kernel directly, as attention's eager path does:
// no boxed call through the dispatcher in a decode loop. NAME: rope or rope_multi.
std::tuple<at::Tensor, at::Tensor> rotate_eagerly(const std::string& name, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& positions, const torch::jit::Stack& o) {
  const auto rope = o[0].toCustomClass<RopeClass>();
  if (name == "rope") return rope_apply_tensors(q, k, positions, rope, o[1].toInt(), o[2].toInt());
  return rope_multi_tensors(q, k, positions, rope, o[1].toInt(), o[2].toIntVector(), o[3].toBool(), o[4].toIntVector(),
                            o[5].toBool(), o[6].toInt());
}
// The rotation NAME through the op `op` below autograd (traced, the Rope as bytes, or meta tensors
// for the fake kernel), else directly.
std::tuple<at::Tensor, at::Tensor> rotate(const std::string& name, const std::string& op, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& positions,
                                          const torch::jit::Stack& options) {
  if (!options[0].isTensor() && q.device().is_cpu()) return rotate_eagerly(name, q, k, positions, options);
  torch::jit::Stack stack{q, k, positions};
  stack.insert(stack.end(), options.begin(), options.end());
  const torch::jit::Stack out = call_below_autograd(op.c_str(), std::move(stack));
  return {out[0].toTensor(), out[1].toTensor()};
}

// The gradient of a rotation: y = α·S·R(±θ)·x, so dx = α·S·R(∓θ)·dy — the same op out of place
// with the direction flipped. The inverse, R(−θ)·y/(α·S), would need R(θ)/(α·S), none of the three
// directions. `options` are the op's arguments after positions: the Rope first, the direction last.
variable_list rotation_gradients(AutogradContext* ctx, const std::string& name, const variable_list& grads) {
  const bool has_k = ctx->saved_data["has_k"].toBool();
  torch::jit::Stack options = ctx->saved_data["options"].toList().vec();
  const std::int64_t direction = options.back().toInt();
  TORCH_CHECK_VALUE(direction != 2, name, ": direction = 2 (inverse); expected 0 or 1 when gradients are needed");
  options.back() = direction == 0 ? 1 : 0;
  const std::string op = rotation_op(name, options, false);  // the forward's: bytes if it was traced
  // Both gradients are defined: autograd materializes an unused output's as zeros.
  const at::Tensor dq = grads[0].contiguous();
  const at::Tensor dk = has_k ? grads[1].contiguous() : dq.new_empty({0});
  const auto [gq, gk] = rotate(name, op, dq, dk, ctx->get_saved_variables()[0], options);
  return {gq, has_k ? gk : at::Tensor()};
}

void save_rotation(AutogradContext* ctx, const at::Tensor& k, const at::Tensor& positions,
                   const torch::jit::Stack& options) {
  ctx->saved_data["has_k"] = !absent(k);
  ctx->saved_data["options"] = ivalue_list(options);
  ctx->save_for_backward({positions});
}

// The autograd kernel of rope, rope_multi and their _pickled forms.
class RotationFunction : public torch::autograd::Function<RotationFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const std::string& name, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& positions, torch::jit::Stack options) {
    const std::string op = rotation_op(name, options, traced({q, k, positions}));
    ctx->saved_data["name"] = name;
    save_rotation(ctx, k, positions, options);
    const auto [q_out, k_out] = rotate(name, op, q, k, positions, options);
    return {q_out, k_out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::string name = ctx->saved_data["name"].toStringRef();
    const variable_list d = rotation_gradients(ctx, name, grads);
    return {at::Tensor(), d[0], d[1], at::Tensor(), at::Tensor()};
  }
};

// In place, differentiable: the rotated tensors are marked dirty (autograd then rejects leaves
// that require grad, as for any in-place op); the gradient is the flipped rotation out of place.
class RotationInplaceFunction : public torch::autograd::Function<RotationInplaceFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, const at::Tensor& positions,
                               torch::jit::Stack options) {
    TORCH_CHECK_VALUE(options.back().toInt() != 2 || !(q.requires_grad() || (!absent(k) && k.requires_grad())),
                      "rope_: direction = 2 (inverse); expected 0 or 1 when gradients are needed");
    const std::string op = rotation_op("rope_", options, traced({q, k, positions}));
    save_rotation(ctx, k, positions, options);
    if (options[0].isTensor() || !q.device().is_cpu()) {
      torch::jit::Stack stack{q, k, positions};
      stack.insert(stack.end(), options.begin(), options.end());
      call_below_autograd(op.c_str(), std::move(stack));
    } else {
      rope_apply_inplace(q, k, positions, options[0].toCustomClass<RopeClass>(), options[1].toInt(),
                         options[2].toInt());
    }
    // mark_dirty bumps their versions: a backward that saved them before refuses to run.
    if (absent(k)) {
      ctx->mark_dirty({q});
    } else {
      ctx->mark_dirty({q, k});
    }
    return {q, k};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list d = rotation_gradients(ctx, "rope", grads);
    return {d[0], d[1], at::Tensor(), at::Tensor()};
  }
};

// A config.json's RoPE for one layer (rotary.hpp: rope_params_from_hf), as the parameters
// Python's RotaryPositionalEncoding takes: {"head_dim", "rotary_dim", "base",
// "max_position_embeddings", "layer_type", "scaling": {rope_type and its keys}}, and an M-RoPE
// config's "mrope_section" and "mrope_interleaved".
std::string rope_config_op(const std::string& config, c10::optional<std::int64_t> layer) {
  return translating([&] {
    const HfRopeConfig c = hf_rope_config_from_json(config, layer ? std::optional<std::int64_t>(*layer) : std::nullopt);
    const RopeParams p = rope_params_from_hf(c);
    const RopeScaling& s = p.scaling();
    nlohmann::json scaling = {{"rope_type", std::string(rope_type_name(s.type))},
                              {"factor", s.factor},
                              {"original_max_position_embeddings", s.original_max_position_embeddings},
                              {"beta_fast", s.beta_fast},
                              {"beta_slow", s.beta_slow},
                              {"mscale", s.mscale},
                              {"mscale_all_dim", s.mscale_all_dim},
                              {"truncate", s.truncate},
                              {"low_freq_factor", s.low_freq_factor},
                              {"high_freq_factor", s.high_freq_factor},
                              {"short_factor", s.short_factor},
                              {"long_factor", s.long_factor},
                              {"partial_rotary_factor", s.partial_rotary_factor}};
    if (!std::isnan(s.attention_factor)) scaling["attention_factor"] = s.attention_factor;  // NaN: derived
    nlohmann::json out = {{"head_dim", p.head_dim()},   {"rotary_dim", p.rotary_dim()},
                          {"base", p.base()},           {"max_position_embeddings", p.max_position_embeddings()},
                          {"layer_type", c.layer_type}, {"scaling", scaling}};
    if (c.qk_head_dim > 0) out["softmax_scale"] = mla_softmax_scale(c);  // MLA: DeepSeek's scale
    if (!c.mrope_section.empty()) {
      out["mrope_section"] = c.mrope_section;  // M-RoPE: the pairs of each axis (Qwen-VL)
      out["mrope_interleaved"] = c.mrope_interleaved;
    }
    return out.dump();
  });
}

// An op's name in its messages: NAME, or its _pickled form's (PICKLED) for the bytes.
template <class Params>
constexpr const char* where_of(const char* name, const char* pickled_name) {
  return std::is_same_v<Params, at::Tensor> ? pickled_name : name;
}

// The kernels of rope and rope_pickled (CPU) and their autograd kernel.
template <class Params>
std::tuple<at::Tensor, at::Tensor> rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                            const Params& params, std::int64_t seq_len, std::int64_t direction) {
  return rope_apply_tensors(q, k, positions, rope_object(where_of<Params>("rope", "rope_pickled"), params), seq_len,
                            direction);
}
template <class Params>
std::tuple<at::Tensor, at::Tensor> rope_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                                 const Params& params, std::int64_t seq_len, std::int64_t direction) {
  const variable_list out =
      RotationFunction::apply("rope", q, k, positions, torch::jit::Stack{params, seq_len, direction});
  return {out[0], out[1]};
}

// rope_ and rope_pickled_ (which returns nothing, so that torch.compile functionalizes it).
template <class Params>
std::tuple<at::Tensor, at::Tensor> rope_inplace_cpu(at::Tensor q, at::Tensor k, const at::Tensor& positions,
                                                    const Params& params, std::int64_t seq_len,
                                                    std::int64_t direction) {
  rope_apply_inplace(q, k, positions, rope_object(where_of<Params>("rope_", "rope_pickled_"), params), seq_len,
                     direction);
  return {q, k};
}
template <class Params>
std::tuple<at::Tensor, at::Tensor> rope_inplace_autograd(at::Tensor q, at::Tensor k, const at::Tensor& positions,
                                                         const Params& params, std::int64_t seq_len,
                                                         std::int64_t direction) {
  const variable_list out =
      RotationInplaceFunction::apply(q, k, positions, torch::jit::Stack{params, seq_len, direction});
  return {out[0], out[1]};
}
void rope_pickled_inplace_cpu(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& params,
                              std::int64_t seq_len, std::int64_t direction) {
  rope_inplace_cpu(q, k, positions, params, seq_len, direction);
}
void rope_pickled_inplace_autograd(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& params,
                                   std::int64_t seq_len, std::int64_t direction) {
  rope_inplace_autograd(q, k, positions, params, seq_len, direction);
}

// rope_multi and rope_multi_pickled.
template <class Params>
std::tuple<at::Tensor, at::Tensor> rope_multi_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                                  const Params& params, std::int64_t seq_len,
                                                  std::vector<std::int64_t> sections, bool interleaved,
                                                  std::vector<std::int64_t> axis_of_pair, bool restart,
                                                  std::int64_t direction) {
  return rope_multi_tensors(q, k, positions, rope_object(where_of<Params>("rope_multi", "rope_multi_pickled"), params),
                            seq_len, sections, interleaved, axis_of_pair, restart, direction);
}
template <class Params>
std::tuple<at::Tensor, at::Tensor> rope_multi_autograd(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& positions, const Params& params,
                                                       std::int64_t seq_len, std::vector<std::int64_t> sections,
                                                       bool interleaved, std::vector<std::int64_t> axis_of_pair,
                                                       bool restart, std::int64_t direction) {
  const variable_list out = RotationFunction::apply(
      "rope_multi", q, k, positions,
      torch::jit::Stack{params, seq_len, sections, interleaved, axis_of_pair, restart, direction});
  return {out[0], out[1]};
}

at::Tensor sinusoidal_table_op(const at::Tensor& positions, std::int64_t dim, double base, bool interleaved,
                               c10::ScalarType dtype) {
  return translating([&] {
    const at::Tensor ids = positions.contiguous();
    const Positions pos = positions_of("sinusoidal_table", "positions", ids);
    TORCH_CHECK_VALUE(ids.dim() == 1, "sinusoidal_table: positions must be [S], got shape ", ids.sizes());
    at::Tensor out = empty_output({ids.size(0), dim}, dtype);
    sinusoidal_table(
        SinusoidalParams(dim, base, interleaved ? SinusoidalLayout::kInterleaved : SinusoidalLayout::kSplitHalves), pos,
        mutable_view("sinusoidal_table", "out", out));
    return out;
  });
}

// Scores [B, H, Sq, Sk] (B from the positions: 1 for [S] ids) of a bias scheme, in the dtype of
// the learned parameter tensor.
at::Tensor materialize(const BiasScheme& scheme, const at::Tensor& q_ids, const at::Tensor& k_ids,
                       c10::ScalarType dtype) {
  const Positions qp = positions_of("bias", "q_positions", q_ids), kp = positions_of("bias", "k_positions", k_ids);
  const std::int64_t batch = q_ids.dim() == 2 ? q_ids.size(0) : 1;
  at::Tensor out = empty_output({batch, bias_heads(scheme), q_ids.size(-1), k_ids.size(-1)}, dtype);
  bias_materialize(scheme, qp, kp, mutable_view("bias", "out", out));
  return out;
}

std::vector<double> doubles_of(const char* where, const char* name, const at::Tensor& t) {
  check_cpu(where, name, t);
  const at::Tensor d = t.detach().to(at::kDouble).contiguous();
  return {d.data_ptr<double>(), d.data_ptr<double>() + d.numel()};
}

at::Tensor tensor_of(const std::vector<double>& values, const at::Tensor& like) {
  TORCH_CHECK(static_cast<std::int64_t>(values.size()) == like.numel(), "posenc: ", values.size(),
              " gradient values for a tensor of ", like.numel(), " elements");
  return at::from_blob(const_cast<double*>(values.data()), like.sizes(), at::kDouble).clone().to(like.scalar_type());
}

// Learned absolute encoding: y = x + table[positions]; differentiable in x and the table.
class LearnedFunction : public torch::autograd::Function<LearnedFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& table, const at::Tensor& x,
                            const at::Tensor& positions) {
    ctx->save_for_backward({table, positions});
    return call_below_autograd("posenc::learned", {table, x, positions})[0].toTensor();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor d_table = call_below_autograd("posenc::learned_backward", {grads[0], s[0], s[1]})[0].toTensor();
    return variable_list{d_table, grads[0], at::Tensor()};  // y = x + table[p]: x's gradient is y's
  }

  // The kernels: y = x + table[positions], and the table's gradient (CPU).
  static at::Tensor cpu(const at::Tensor& table, const at::Tensor& x, const at::Tensor& positions) {
    return translating([&] {
      const at::Tensor ids = positions.contiguous();
      at::Tensor y = empty_output(x.sizes(), x.scalar_type());
      learned_forward(const_view("learned", "table", table), const_view("learned", "x", x),
                      positions_of("learned", "positions", ids), mutable_view("learned", "y", y));
      return y;
    });
  }
  static at::Tensor backward_cpu(const at::Tensor& grad, const at::Tensor& table, const at::Tensor& positions) {
    return translating([&] {
      const at::Tensor dy = grad.contiguous(), ids = positions.contiguous();
      at::Tensor d_table = at::zeros(table.sizes(), table.options());
      learned_backward(const_view("learned", "dy", dy), positions_of("learned", "positions", ids),
                       mutable_view("learned", "d_table", d_table));
      return d_table;
    });
  }
};

// FLOATER: the table [length, dim] of a dynamical system, differentiable in all its parameters.
class FloaterFunction : public torch::autograd::Function<FloaterFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                            const at::Tensor& b2, const at::Tensor& p0, std::int64_t length, double time_per_position,
                            std::int64_t substeps) {
    return call_forward(ctx, "posenc::floater_table", {w1, b1, w2, b2, p0},
                        {{"length", length}, {"time_per_position", time_per_position}, {"substeps", substeps}});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return call_backward(ctx, "posenc::floater_table_backward", grads[0], {"time_per_position", "substeps"});
  }

  // The kernels: the table and its parameters' gradients (CPU).
  static at::Tensor cpu(const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                        const at::Tensor& p0, std::int64_t length, double time_per_position, std::int64_t substeps) {
    return translating([&] {
      const FloaterParams p = params_of(w1, b1, w2, b2, p0, time_per_position, substeps);
      if (length < 0) throw Error("floater_table", "length", std::to_string(length), ">= 0");
      at::Tensor out = empty_output({length, p.dim()}, p0.scalar_type());
      floater_table(p, mutable_view("floater_table", "out", out));
      return out;
    });
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cpu(
      const at::Tensor& grad, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
      const at::Tensor& p0, double time_per_position, std::int64_t substeps) {
    return translating([&] {
      const FloaterParams p = params_of(w1, b1, w2, b2, p0, time_per_position, substeps);
      FloaterGradients g(p);
      const at::Tensor dt = grad.contiguous();
      floater_table_backward(p, const_view("floater_table", "grad", dt), g);
      return std::make_tuple(tensor_of(g.w1, w1), tensor_of(g.b1, b1), tensor_of(g.w2, w2), tensor_of(g.b2, b2),
                             tensor_of(g.p0, p0));
    });
  }

 private:
  static FloaterParams params_of(const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                                 const at::Tensor& p0, double time_per_position, std::int64_t substeps) {
    return FloaterParams(p0.numel(), doubles_of("floater_table", "w1", w1), doubles_of("floater_table", "b1", b1),
                         doubles_of("floater_table", "w2", w2), doubles_of("floater_table", "b2", b2),
                         doubles_of("floater_table", "p0", p0), time_per_position, substeps);
  }
};

// Zero-filled [B, H, Sq, Sk] scores for q [B, Sq, H, D] (or [Sq, H, D]) against keys [.., Sk].
at::Tensor zero_scores(const at::Tensor& q, std::int64_t k_len, c10::ScalarType dtype) {
  const std::int64_t batch = q.dim() == 4 ? q.size(0) : 1;
  return empty_output({batch, q.size(-2), q.size(-3), k_len}, dtype).zero_();
}

// Shaw's score and value terms share their autograd: (x, table, q_positions, k_positions,
// max_distance), differentiable in x and the table; Term names the op and holds its kernels.
template <class Term>
class ShawFunction : public torch::autograd::Function<ShawFunction<Term>> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& table,
                            const at::Tensor& q_positions, const at::Tensor& k_positions, std::int64_t max_distance) {
    return call_forward(ctx, Term::kOp, {x, table, q_positions, k_positions}, {{"max_distance", max_distance}});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return call_backward(ctx, Term::kBackwardOp, grads[0], {"max_distance"});
  }
};

// Shaw's score term: q [B, S, H, D] and key_table [2k + 1, D] give scores [B, H, Sq, Sk].
struct ShawScores {
  static constexpr const char* kOp = "posenc::shaw_scores";
  static constexpr const char* kBackwardOp = "posenc::shaw_scores_backward";
  static at::Tensor cpu(const at::Tensor& q, const at::Tensor& key_table, const at::Tensor& q_positions,
                        const at::Tensor& k_positions, std::int64_t max_distance) {
    return translating([&] {
      const at::Tensor qi = q_positions.contiguous(), ki = k_positions.contiguous();
      const ShawParams p(max_distance, key_table.size(-1), doubles_of("shaw", "key_table", key_table));
      at::Tensor scores = zero_scores(q, ki.size(-1), q.scalar_type());
      shaw_add_score_term(p, const_view("shaw", "q", q), positions_of("shaw", "q_positions", qi),
                          positions_of("shaw", "k_positions", ki), mutable_view("shaw", "scores", scores));
      return scores;
    });
  }
  static std::tuple<at::Tensor, at::Tensor> backward_cpu(const at::Tensor& grad, const at::Tensor& q,
                                                         const at::Tensor& key_table, const at::Tensor& q_positions,
                                                         const at::Tensor& k_positions, std::int64_t max_distance) {
    return translating([&] {
      const ShawParams p(max_distance, key_table.size(-1), doubles_of("shaw", "key_table", key_table));
      at::Tensor dq = at::zeros_like(q);
      std::vector<double> d_table(p.key_table().size(), 0.0);
      const at::Tensor ds = grad.contiguous(), qi = q_positions.contiguous(), ki = k_positions.contiguous();
      shaw_score_term_backward(p, const_view("shaw", "q", q), const_view("shaw", "grad", ds),
                               positions_of("shaw", "q_positions", qi), positions_of("shaw", "k_positions", ki),
                               mutable_view("shaw", "dq", dq), d_table);
      return std::make_tuple(dq, tensor_of(d_table, key_table));
    });
  }
};

// Shaw's value term: probs [B, H, Sq, Sk] and value_table [2k + 1, D] give [B, Sq, H, D].
struct ShawValues {
  static constexpr const char* kOp = "posenc::shaw_values";
  static constexpr const char* kBackwardOp = "posenc::shaw_values_backward";
  static at::Tensor cpu(const at::Tensor& probs, const at::Tensor& value_table, const at::Tensor& q_positions,
                        const at::Tensor& k_positions, std::int64_t max_distance) {
    return translating([&] {
      TORCH_CHECK_VALUE(probs.dim() == 4, "shaw: probs shape ", probs.sizes(), "; expected [B, H, Sq, Sk]");
      const at::Tensor qi = q_positions.contiguous(), ki = k_positions.contiguous();
      const ShawParams p(max_distance, value_table.size(-1), {}, doubles_of("shaw", "value_table", value_table));
      at::Tensor out =
          empty_output({probs.size(0), probs.size(2), probs.size(1), value_table.size(-1)}, probs.scalar_type())
              .zero_();
      shaw_add_value_term(p, const_view("shaw", "probs", probs), positions_of("shaw", "q_positions", qi),
                          positions_of("shaw", "k_positions", ki), mutable_view("shaw", "out", out));
      return out;
    });
  }
  static std::tuple<at::Tensor, at::Tensor> backward_cpu(const at::Tensor& grad, const at::Tensor& probs,
                                                         const at::Tensor& value_table, const at::Tensor& q_positions,
                                                         const at::Tensor& k_positions, std::int64_t max_distance) {
    return translating([&] {
      const ShawParams p(max_distance, value_table.size(-1), {}, doubles_of("shaw", "value_table", value_table));
      at::Tensor d_probs = at::zeros_like(probs);
      std::vector<double> d_table(p.value_table().size(), 0.0);
      const at::Tensor d_out = grad.contiguous(), qi = q_positions.contiguous(), ki = k_positions.contiguous();
      shaw_value_term_backward(p, const_view("shaw", "probs", probs), const_view("shaw", "grad", d_out),
                               positions_of("shaw", "q_positions", qi), positions_of("shaw", "k_positions", ki),
                               mutable_view("shaw", "d_probs", d_probs), d_table);
      return std::make_tuple(d_probs, tensor_of(d_table, value_table));
    });
  }
};

// Transformer-XL's position terms: q, k [B, S, H, D], u, v [H, D], w_r [H·D, d_model].
class XlFunction : public torch::autograd::Function<XlFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& u,
                            const at::Tensor& v, const at::Tensor& w_r, const at::Tensor& q_positions,
                            const at::Tensor& k_positions, double scale, double base) {
    return call_forward(ctx, "posenc::xl_scores", {q, k, u, v, w_r, q_positions, k_positions},
                        {{"scale", scale}, {"base", base}});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return call_backward(ctx, "posenc::xl_scores_backward", grads[0], {"scale", "base"});
  }

  // The kernels: the terms' scores, and the gradients of q, k, u, v and W_R (CPU).
  static at::Tensor cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& u, const at::Tensor& v,
                        const at::Tensor& w_r, const at::Tensor& q_positions, const at::Tensor& k_positions,
                        double scale, double base) {
    return translating([&] {
      const at::Tensor qi = q_positions.contiguous(), ki = k_positions.contiguous();
      const XlParams p = params_of(u, v, w_r, scale, base);
      at::Tensor scores = zero_scores(q, k.size(-3), q.scalar_type());
      xl_add_position_terms(p, const_view("xl", "q", q), const_view("xl", "k", k),
                            positions_of("xl", "q_positions", qi), positions_of("xl", "k_positions", ki),
                            mutable_view("xl", "scores", scores));
      return scores;
    });
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cpu(
      const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& u, const at::Tensor& v,
      const at::Tensor& w_r, const at::Tensor& q_positions, const at::Tensor& k_positions, double scale, double base) {
    return translating([&] {
      const XlParams p = params_of(u, v, w_r, scale, base);
      at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k);
      XlGradients g(p);
      const at::Tensor ds = grad.contiguous(), qi = q_positions.contiguous(), ki = k_positions.contiguous();
      xl_position_terms_backward(p, const_view("xl", "q", q), const_view("xl", "k", k), const_view("xl", "grad", ds),
                                 positions_of("xl", "q_positions", qi), positions_of("xl", "k_positions", ki),
                                 mutable_view("xl", "dq", dq), mutable_view("xl", "dk", dk), g);
      return std::make_tuple(dq, dk, tensor_of(g.u, u), tensor_of(g.v, v), tensor_of(g.w_r, w_r));
    });
  }

 private:
  static XlParams params_of(const at::Tensor& u, const at::Tensor& v, const at::Tensor& w_r, double scale,
                            double base) {
    TORCH_CHECK_VALUE(u.dim() == 2 && w_r.dim() == 2, "xl: u shape ", u.sizes(), ", w_r shape ", w_r.sizes(),
                      "; expected u [H, D] and w_r [H·D, d_model]");
    return XlParams(u.size(0), u.size(1), w_r.size(1), doubles_of("xl", "u", u), doubles_of("xl", "v", v),
                    doubles_of("xl", "w_r", w_r), scale, base);
  }
};

at::Tensor shaw_scores_op(const at::Tensor& q, const at::Tensor& key_table, const at::Tensor& q_positions,
                          const at::Tensor& k_positions, std::int64_t max_distance) {
  return ShawFunction<ShawScores>::apply(q, key_table, q_positions, k_positions, max_distance);
}
at::Tensor shaw_values_op(const at::Tensor& probs, const at::Tensor& value_table, const at::Tensor& q_positions,
                          const at::Tensor& k_positions, std::int64_t max_distance) {
  return ShawFunction<ShawValues>::apply(probs, value_table, q_positions, k_positions, max_distance);
}
at::Tensor xl_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& u, const at::Tensor& v,
                 const at::Tensor& w_r, const at::Tensor& q_positions, const at::Tensor& k_positions, double scale,
                 double base) {
  return XlFunction::apply(q, k, u, v, w_r, q_positions, k_positions, scale, base);
}
at::Tensor learned_op(const at::Tensor& table, const at::Tensor& x, const at::Tensor& positions) {
  return LearnedFunction::apply(table, x, positions);
}
at::Tensor floater_op(const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                      const at::Tensor& p0, std::int64_t length, double time_per_position, std::int64_t substeps) {
  return FloaterFunction::apply(w1, b1, w2, b2, p0, length, time_per_position, substeps);
}

// An op of three kernels: its forward (CPU), autograd over it and NAME_backward, and that backward
// op's own kernel (CPU); torch.compile and opcheck trace the two ops with their fake kernels.
template <class Cpu, class Autograd, class Backward>
void define_with_backward(torch::Library& m, const char* schema, Cpu cpu, Autograd autograd,
                          const char* backward_schema, Backward backward) {
  define_op(m, schema, cpu, autograd);
  define_op(m, backward_schema, backward);
}

}  // namespace posenc::torch_adapter

TORCH_LIBRARY(posenc, m) {
  using namespace posenc::torch_adapter;
  define_classes(m);
  define_attention_ops(m);
  define_op(m, "sinusoidal_table(Tensor positions, int dim, float base, bool interleaved, ScalarType dtype) -> Tensor",
            TORCH_FN(sinusoidal_table_op));
  // RoPE: each op with the Rope object (eager) and as NAME_pickled with its bytes (traced; see
  // rotation_op), with a CPU kernel and an autograd kernel each; the fake kernels are in _fake.py.
  using Rope = c10::intrusive_ptr<RopeClass>;
  const auto rotation = [&m](const char* name, const std::string& args, const std::string& returns, auto cpu,
                             auto autograd, auto pickled_cpu, auto pickled_autograd,
                             const std::string& pickled_returns) {
    const std::string rope = "__torch__.torch.classes.posenc.Rope params";
    std::string pickled_name = name;
    pickled_name = pickled_name.back() == '_' ? pickled_name.substr(0, pickled_name.size() - 1) + "_pickled_"
                                              : pickled_name + "_pickled";
    const auto with = [&](const std::string& params) {
      std::string a = args;
      a.replace(a.find("PARAMS"), 6, params);
      return a;
    };
    define_op(m, name + ("(" + with(rope) + ") -> " + returns), cpu, autograd);
    define_op(m, pickled_name + "(" + with("Tensor params") + ") -> " + pickled_returns, pickled_cpu, pickled_autograd);
  };
  rotation("rope", "Tensor q, Tensor k, Tensor positions, PARAMS, int seq_len, int direction", "(Tensor, Tensor)",
           TORCH_FN(rope_cpu<Rope>), TORCH_FN(rope_autograd<Rope>), TORCH_FN(rope_cpu<at::Tensor>),
           TORCH_FN(rope_autograd<at::Tensor>), "(Tensor, Tensor)");
  rotation("rope_", "Tensor(a!) q, Tensor(b!) k, Tensor positions, PARAMS, int seq_len, int direction",
           "(Tensor(a!), Tensor(b!))", TORCH_FN(rope_inplace_cpu<Rope>), TORCH_FN(rope_inplace_autograd<Rope>),
           TORCH_FN(rope_pickled_inplace_cpu), TORCH_FN(rope_pickled_inplace_autograd), "()");
  rotation("rope_multi",
           "Tensor q, Tensor k, Tensor positions, PARAMS, int seq_len, int[] sections, bool interleaved, "
           "int[] axis_of_pair, bool restart, int direction",
           "(Tensor, Tensor)", TORCH_FN(rope_multi_cpu<Rope>), TORCH_FN(rope_multi_autograd<Rope>),
           TORCH_FN(rope_multi_cpu<at::Tensor>), TORCH_FN(rope_multi_autograd<at::Tensor>), "(Tensor, Tensor)");
  m.def("rope_config(str config, int? layer) -> str", &rope_config_op);
  m.def(
      "rope_rerotate_(Tensor(a!) k, Tensor from_positions, __torch__.torch.classes.posenc.Rope from_params, "
      "int from_seq_len, Tensor to_positions, __torch__.torch.classes.posenc.Rope to_params, int to_seq_len) "
      "-> Tensor(a!)",
      {at::Tag::inplace});  // mutates and returns k: torch.compile functionalizes it
  m.impl("rope_rerotate_", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(rope_rerotate_op)));
  m.impl("rope_rerotate_", torch::dispatch(c10::DispatchKey::Autograd, TORCH_FN(rope_rerotate_autograd)));
  m.def("empty_cache() -> ()", &empty_cache_op);
  m.def("bf16_dot_products() -> bool", &bf16_dot_products_op);
  m.def("huge_page_zeros(int[] shape, ScalarType dtype) -> Tensor");
  m.impl("huge_page_zeros", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(huge_page_zeros_op)));
  define_with_backward(m, "learned(Tensor table, Tensor x, Tensor positions) -> Tensor", TORCH_FN(LearnedFunction::cpu),
                       TORCH_FN(learned_op), "learned_backward(Tensor grad, Tensor table, Tensor positions) -> Tensor",
                       TORCH_FN(LearnedFunction::backward_cpu));
  define_with_backward(
      m, "shaw_scores(Tensor q, Tensor key_table, Tensor q_positions, Tensor k_positions, int max_distance) -> Tensor",
      TORCH_FN(ShawScores::cpu), TORCH_FN(shaw_scores_op),
      "shaw_scores_backward(Tensor grad, Tensor q, Tensor key_table, Tensor q_positions, Tensor k_positions, "
      "int max_distance) -> (Tensor, Tensor)",
      TORCH_FN(ShawScores::backward_cpu));
  define_with_backward(
      m,
      "shaw_values(Tensor probs, Tensor value_table, Tensor q_positions, Tensor k_positions, int max_distance) -> "
      "Tensor",
      TORCH_FN(ShawValues::cpu), TORCH_FN(shaw_values_op),
      "shaw_values_backward(Tensor grad, Tensor probs, Tensor value_table, Tensor q_positions, Tensor k_positions, "
      "int max_distance) -> (Tensor, Tensor)",
      TORCH_FN(ShawValues::backward_cpu));
  define_with_backward(
      m,
      "xl_scores(Tensor q, Tensor k, Tensor u, Tensor v, Tensor w_r, Tensor q_positions, Tensor k_positions, "
      "float scale, float base) -> Tensor",
      TORCH_FN(XlFunction::cpu), TORCH_FN(xl_op),
      "xl_scores_backward(Tensor grad, Tensor q, Tensor k, Tensor u, Tensor v, Tensor w_r, Tensor q_positions, "
      "Tensor k_positions, float scale, float base) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      TORCH_FN(XlFunction::backward_cpu));
  define_with_backward(
      m,
      "floater_table(Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor p0, int length, float time_per_position, "
      "int substeps) -> Tensor",
      TORCH_FN(FloaterFunction::cpu), TORCH_FN(floater_op),
      "floater_table_backward(Tensor grad, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor p0, "
      "float time_per_position, int substeps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      TORCH_FN(FloaterFunction::backward_cpu));
}
