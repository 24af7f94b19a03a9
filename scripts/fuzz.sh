#!/usr/bin/env bash
# scripts/fuzz.sh BUILD SECONDS [TARGET…]: runs each libFuzzer target of BUILD (configured with
# -DPOSENC_FUZZ=ON) for SECONDS, starting from its corpus in fuzz/corpus/<name>. New inputs go to
# BUILD/fuzz/new/<name> (merge them into the corpus with -merge=1 when they add coverage); a
# finding stops the run with the input that caused it in BUILD/fuzz/findings.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$1" seconds="$2"
shift 2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(config cli views rope schemes attention stickbreaking cope)
mkdir -p "$build/fuzz/findings"
for name in "${targets[@]}"; do
  mkdir -p "$build/fuzz/new/$name"
  echo "fuzz: $name for $seconds s"
  # -timeout: a single input that runs 25 s is a hang (the sanitized build runs about 100 times
  # slower than a release build); -rss_limit_mb: far above the fuzzers' own
  # allocation limit (256 MiB), so that an allocation it fails to bound is reported.
  log="$build/fuzz/$name.log"
  status=0
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$build/fuzz/fuzz_$name" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$build/fuzz/findings/$name-" "$build/fuzz/new/$name" "$root/fuzz/corpus/$name" \
    > "$log" 2>&1 || status=$?
  grep -a -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb|posenc fuzz finding|SUMMARY|Test unit written)" "$log" || true
  if [ "$status" -ne 0 ]; then
    grep -a -A30 -E "ERROR|runtime error|posenc fuzz finding" "$log" | head -60 >&2
    echo "fuzz: $name found a failure (status $status); the input is in $build/fuzz/findings, the log in $log" >&2
    exit 1
  fi
done
