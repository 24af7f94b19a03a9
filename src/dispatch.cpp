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
#include "posenc/runtime.hpp"

namespace posenc {
namespace {

std::atomic<bool> g_reference{false};
std::atomic<int> g_threads{0};  // 0: OpenMP's default

struct TargetName {
  std::int64_t bit;
  const char* name;
};
// Best first. HWY_SCALAR only appears when the compiler cannot build EMU128.
constexpr TargetName kTargets[] = {
    {HWY_AVX3, "avx512"}, {HWY_AVX2, "avx2"},     {HWY_SSE4, "sse4"},
    {HWY_EMU128, "scalar"}, {HWY_SCALAR, "scalar"},
};

// Compiled into this library (the kernel translation units share these compile definitions)
// and supported by this CPU.
std::int64_t usable_targets() {
  hwy::SetSupportedTargetsForTest(0);
  return hwy::SupportedTargets() & HWY_TARGETS;
}

void choose(std::int64_t bits) {
  hwy::SetSupportedTargetsForTest(bits);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

std::int64_t g_forced_bit = 0;  // 0: the best usable target
std::mutex g_mutex;              // guards g_forced_bit and Highway's target mask

// Names of the usable targets, best first, then "ref".
std::vector<std::string> names_of(std::int64_t usable) {
  std::vector<std::string> names;
  for (const TargetName& t : kTargets) {
    if ((usable & t.bit) != 0 && (names.empty() || names.back() != t.name)) names.push_back(t.name);
  }
  names.push_back("ref");
  return names;
}

void apply(std::string_view name) {
  if (name == "ref") {
    g_reference = true;
    return;
  }
  const std::int64_t usable = usable_targets();
  if (name == "auto") {
    g_reference = false;
    g_forced_bit = 0;
    choose(0);
    return;
  }
  for (const TargetName& t : kTargets) {
    if (name == t.name && (usable & t.bit) != 0) {
      g_reference = false;
      g_forced_bit = t.bit;
      choose(t.bit);
      return;
    }
  }
  if (g_forced_bit != 0) choose(g_forced_bit);  // usable_targets() lifted the narrowing
  std::string names;
  for (const std::string& n : names_of(usable)) names += (names.empty() ? "" : ", ") + n;
  throw Error("set_target", "name", std::string(name), "auto or one of: " + names);
}

}  // namespace

namespace detail {

void init_dispatch() {
  static const bool once = [] {
    const char* env = std::getenv("POSENC_TARGET");
    std::lock_guard lock(g_mutex);
    if (env != nullptr && *env != '\0') {
      try {
        apply(env);
      } catch (const Error& e) {
        throw Error(std::string("POSENC_TARGET: ") + e.what());
      }
    } else {
      apply("auto");
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
  std::lock_guard lock(g_mutex);
  const std::int64_t usable = usable_targets();
  if (g_forced_bit != 0) choose(g_forced_bit);  // usable_targets() lifted the narrowing
  return names_of(usable);
}

std::string active_target() {
  detail::init_dispatch();
  if (detail::use_reference()) return "ref";
  std::lock_guard lock(g_mutex);
  if (g_forced_bit != 0) {
    for (const TargetName& t : kTargets) {
      if (t.bit == g_forced_bit) return t.name;
    }
  }
  const std::int64_t usable = usable_targets();
  for (const TargetName& t : kTargets) {
    if ((usable & t.bit) != 0) return t.name;
  }
  return "scalar";
}

void set_target(std::string_view name) {
  detail::init_dispatch();
  std::lock_guard lock(g_mutex);
  apply(name);
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
