#!/usr/bin/env bash
# All the tests: install what is missing; check the C++ format; build (Release) and run the whole
# suite; then build again with AddressSanitizer + UndefinedBehaviorSanitizer and run the suite once more;
# then build the libFuzzer targets with clang (and both sanitizers) and run each for a short while.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
POSENC_PACKAGES+=("${POSENC_TORCH_PACKAGES[@]}" "${POSENC_STUDY_PACKAGES[@]}" "${POSENC_TEST_PACKAGES[@]}")
trap posenc_stage_table EXIT
posenc_stage "Set-up: Debian packages"
posenc_install_dependencies
jobs="$(nproc)"

posenc_stage "Format (.clang-format)"
bash "$POSENC_ROOT/scripts/format.sh" --check

posenc_stage "Release build"
posenc_build "$POSENC_ROOT/build" all -DCMAKE_BUILD_TYPE=Release -DPOSENC_BUILD_TORCH=ON
posenc_stage "Release tests (C++, the command, the installed package, the Python package)"
ctest --test-dir "$POSENC_ROOT/build" --output-on-failure -j "$jobs" --timeout 600

posenc_stage "ASan/UBSan build"
# The installed-package and README tests link plain executables against the sanitized library,
# which the sanitizer runtime forbids; they ran in the Release build above, as did the Python
# tests (torch cannot be loaded into a sanitized interpreter). The 4096-token accuracy test spends
# its time in the fp64 reference (2 minutes under the sanitizers, a third of this stage) on paths
# the other attention tests run here at smaller sizes; it ran in the Release build.
posenc_build "$POSENC_ROOT/build-sanitize" all -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPOSENC_SANITIZE=ON -DPOSENC_BUILD_BENCH=OFF
posenc_stage "ASan/UBSan tests"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir "$POSENC_ROOT/build-sanitize" --output-on-failure -j "$jobs" --timeout 900 \
  -E '^(install|readme)\.|^Attention\.AccurateAtFourThousandTokens$'

posenc_stage "Fuzz build (libFuzzer, clang, ASan/UBSan)"
# docs/fuzzing.md: the targets, their corpora, and how to run them longer.
posenc_build "$POSENC_ROOT/build-fuzz" "fuzz_config fuzz_cli fuzz_views fuzz_rope fuzz_schemes fuzz_attention fuzz_stickbreaking fuzz_cope" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
  -DPOSENC_SANITIZE=ON -DPOSENC_FUZZ=ON -DPOSENC_BUILD_TESTS=OFF -DPOSENC_BUILD_BENCH=OFF
posenc_stage "Fuzzing: each target for 20 s"
bash "$POSENC_ROOT/scripts/fuzz.sh" "$POSENC_ROOT/build-fuzz" 20
