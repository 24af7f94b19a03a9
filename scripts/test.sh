#!/usr/bin/env bash
# All the tests: install what is missing; check the C++ format; build (Release, GCC) and run the
# whole suite on every Highway target; build again with AddressSanitizer and
# UndefinedBehaviorSanitizer and run the suite under them; build the libFuzzer targets with clang
# (and both sanitizers) and run each for a short while. A table of the stages' wall times closes the output;
# docs/testing.md says what each stage proves and how to run one alone.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
trap posenc_stage_table EXIT
jobs="$(nproc)"

posenc_stage "Set-up: Debian packages, the Python environment (PyPI)"
posenc_packages test
posenc_install_dependencies
posenc_python_env

posenc_stage "Format (.clang-format)"
bash "$POSENC_ROOT/scripts/format.sh" --check

posenc_stage "Release build (GCC, every Highway target, the PyTorch extension)"
posenc_configure_test_release "$POSENC_ROOT/build"
posenc_build "$POSENC_ROOT/build"

posenc_stage "Release tests (C++ on every target, the command, installs, README, Python)"
# `pip wheel .` (readme.sh) configures its own build: CMake takes the launcher from the environment.
CMAKE_CXX_COMPILER_LAUNCHER=ccache ctest --test-dir "$POSENC_ROOT/build" --output-on-failure -j "$jobs" --timeout 600
ccache --show-stats

posenc_stage "ASan/UBSan build (GCC; AVX2 and portable targets)"
posenc_configure_sanitize "$POSENC_ROOT/build-sanitize"
posenc_build "$POSENC_ROOT/build-sanitize"

posenc_stage "ASan/UBSan tests"
# The installed-package and README tests link plain executables against the sanitized library,
# which the sanitizer runtime forbids; they ran in the Release build above, as did the Python
# tests (torch cannot be loaded into a sanitized interpreter). The 4096-token accuracy test spends
# its time in the fp64 reference (2 minutes under the sanitizers) on paths the other attention
# tests run here at smaller sizes; it ran in the Release build. A test's instance on the fp64
# reference target ("ref") runs the reference that the same test's avx2 and scalar instances run
# here as their oracle, on the same inputs: it ran in the Release build too.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir "$POSENC_ROOT/build-sanitize" --output-on-failure -j "$jobs" --timeout 900 \
  -E '^(install|readme)\.|^Attention\.AccurateAtFourThousandTokens$|/"?ref"?( |$)'

posenc_stage "Fuzz build (clang: libFuzzer, ASan, UBSan; AVX2 target)"
posenc_configure_fuzz "$POSENC_ROOT/build-fuzz"
posenc_build "$POSENC_ROOT/build-fuzz" "fuzz_config fuzz_cli fuzz_views fuzz_rope fuzz_schemes fuzz_attention fuzz_normalisers"

posenc_stage "Fuzzing (libFuzzer, ASan, UBSan): each target for 25 s, one per core"
# docs/fuzzing.md: the targets, their corpora, and how to run them longer.
bash "$POSENC_ROOT/scripts/fuzz.sh" "$POSENC_ROOT/build-fuzz" 25
