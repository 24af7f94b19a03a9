#!/usr/bin/env bash
# All the tests: install what is missing; build (Release) and run the whole suite; then build
# again with AddressSanitizer + UndefinedBehaviorSanitizer and run the suite once more.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
posenc_install_dependencies
jobs="$(nproc)"

echo "== Release build and tests"
posenc_build "$POSENC_ROOT/build" all -DCMAKE_BUILD_TYPE=Release
ctest --test-dir "$POSENC_ROOT/build" --output-on-failure -j "$jobs" --timeout 600

echo "== AddressSanitizer + UndefinedBehaviorSanitizer build and tests"
# The installed-package test links a plain executable against the sanitized library, which the
# sanitizer runtime forbids; it ran in the Release build above.
posenc_build "$POSENC_ROOT/build-sanitize" all -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPOSENC_SANITIZE=ON -DPOSENC_BUILD_BENCH=OFF
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir "$POSENC_ROOT/build-sanitize" --output-on-failure -j "$jobs" --timeout 900 \
  -E '^install\.'
