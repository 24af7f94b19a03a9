// Run-time target selection. Kernels dispatch through Highway's tables (HWY_DYNAMIC_DISPATCH);
// forcing a target narrows the set of targets Highway may choose from to that one, which is what
// Highway's own tests do to run every compiled path. "ref" bypasses the SIMD kernels entirely.
#include <hwy/highway.h>
#include <hwy/targets.h>
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "internal.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "kernels/common/row_kernels.hpp"
#include "posenc/runtime.hpp"

namespace posenc {
namespace {

std::atomic<bool> g_reference{false};
std::atomic<int> g_threads{0};  // 0: OpenMP's default
std::mutex g_mutex;             // serialises changes of the target
std::int64_t g_usable = 0;      // compiled and supported targets, read once at initialisation

struct TargetName {
  std::int64_t bit;
  const char* name;
};
// Best first. HWY_SCALAR only appears when the compiler cannot build EMU128 (GCC < 12.3).
constexpr TargetName kTargets[] = {
    {HWY_AVX3, "avx512"}, {HWY_AVX2, "avx2"}, {HWY_SSE4, "sse4"}, {HWY_EMU128, "scalar"}, {HWY_SCALAR, "scalar"},
};

void choose(std::int64_t bits) {  // 0: no restriction
  hwy::SetSupportedTargetsForTest(bits);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

// Names of the usable targets, best first, then "ref".
std::vector<std::string> usable_names() {
  std::vector<std::string> names;
  for (const TargetName& t : kTargets) {
    if ((g_usable & t.bit) != 0 && (names.empty() || names.back() != t.name)) names.push_back(t.name);
  }
  names.push_back("ref");
  return names;
}

void apply(std::string_view name) {  // under g_mutex
  if (name == "ref") {
    g_reference = true;
    return;
  }
  if (name == "auto") {
    g_reference = false;
    choose(0);
    return;
  }
  for (const TargetName& t : kTargets) {
    if (name == t.name && (g_usable & t.bit) != 0) {
      g_reference = false;
      choose(t.bit);
      return;
    }
  }
  std::string names;
  for (const std::string& n : usable_names()) names += (names.empty() ? "" : ", ") + n;
  throw Error("set_target", "name", std::string(name), "auto or one of: " + names);
}

}  // namespace

namespace detail {

void init_dispatch() {
  static const bool once = [] {
    std::lock_guard lock(g_mutex);
    // The kernel translation units share these compile definitions, hence HWY_TARGETS.
    hwy::SetSupportedTargetsForTest(0);
    g_usable = hwy::SupportedTargets() & HWY_TARGETS;
    const char* env = std::getenv("POSENC_TARGET");
    try {
      apply(env != nullptr && *env != '\0' ? env : "auto");
    } catch (const Error& e) {
      throw Error(std::string("POSENC_TARGET: ") + e.what());
    }
    return true;
  }();
  (void)once;
}

bool use_reference() { return g_reference.load(std::memory_order_relaxed); }

int threads_for(std::int64_t work) {
  // Below ~64K elementary operations a parallel region costs more than it saves.
  constexpr std::int64_t kMinWorkPerThread = std::int64_t{1} << 16;
  const int available = num_threads();
  const std::int64_t useful = work / kMinWorkPerThread;
  return static_cast<int>(useful < 1 ? 1 : (useful < available ? useful : available));
}

}  // namespace detail

std::vector<std::string> available_targets() {
  detail::init_dispatch();
  return usable_names();
}

std::string active_target() {
  detail::init_dispatch();
  if (detail::use_reference()) return "ref";
  // Ask the kernels themselves, so that a forced target is verified, not just remembered.
  const std::int64_t bit = kernels::dispatched_target();
  for (const TargetName& t : kTargets) {
    if (t.bit == bit) return t.name;
  }
  return hwy::TargetName(bit);
}

bool bf16_dot_products() {
  detail::init_dispatch();
  if (detail::use_reference() || !kernels::attn_bf16_supported()) return false;
  std::int64_t avx512 = HWY_AVX3 | HWY_AVX3_DL;
#ifdef HWY_AVX3_ZEN4  // later Highway versions' AVX-512 targets
  avx512 |= HWY_AVX3_ZEN4;
#endif
#ifdef HWY_AVX3_SPR
  avx512 |= HWY_AVX3_SPR;
#endif
  return (kernels::dispatched_target() & avx512) != 0;
}

void set_target(std::string_view name) {
  detail::init_dispatch();
  std::lock_guard lock(g_mutex);
  apply(name);
  // RoPE's rows kept across calls come from the kernels of the target that made them.
  detail::empty_rope_row_cache();
}

void set_num_threads(int n) {
  if (n < 1) throw Error("set_num_threads", "n", std::to_string(n), ">= 1");
  g_threads = n;
}

int num_threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : omp_get_max_threads();
}

std::string_view version() { return POSENC_VERSION_STRING; }

}  // namespace posenc
