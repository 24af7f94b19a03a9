# Shared by scripts/main.sh and scripts/test.sh: install what is missing, configure, build.
# Debian 12; runs as root or through sudo; idempotent (installs nothing when all is present).
set -euo pipefail

POSENC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
POSENC_PACKAGES=(g++ cmake ninja-build pkg-config libhwy-dev libgtest-dev libbenchmark-dev
                 libcli11-dev nlohmann-json3-dev libfmt-dev)
# The PyTorch extension and its tests: libtorch's headers and CMake config, Debian's python3 with
# torch, numpy and pytest, and an optimised libblas.so.3 for torch (Debian's torch otherwise uses
# the reference BLAS).
POSENC_TORCH_PACKAGES=(libtorch-dev python3-torch python3-numpy python3-pytest libopenblas0-pthread)

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

# posenc_build DIR [TARGET] [CMAKE ARGS…]: configure (Ninja) and build TARGET (or everything).
posenc_build() {
  local dir="$1" target="${2:-all}"
  shift 2 || shift $#
  cmake -S "$POSENC_ROOT" -B "$dir" -G Ninja "$@" > "$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; return 1; }
  cmake --build "$dir" --target "$target" -- -j "$(nproc)"
}
