#!/usr/bin/env bash
# scripts/fuzz.sh BUILD SECONDS [TARGET…]: runs each libFuzzer target of BUILD (configured with
# -DPOSENC_FUZZ=ON) for SECONDS, starting from its corpus in fuzz/corpus/<name>. New inputs go to
# BUILD/fuzz/new/<name> (merge them into the corpus with -merge=1 when they add coverage); a
# finding fails the run, with the input that caused it in BUILD/fuzz/findings (the other targets
# still finish and report). A fuzzer runs on one core, so as many run at once as the machine has
# cores (POSENC_FUZZ_JOBS to choose): on an otherwise idle machine each gets SECONDS of a core.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$1" seconds="$2"
shift 2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(config cli views rope schemes attention normalisers)
parallel="${POSENC_FUZZ_JOBS:-$(nproc)}"
[[ "$parallel" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz: POSENC_FUZZ_JOBS = '$parallel', expected an integer >= 1" >&2; exit 2; }
mkdir -p "$build/fuzz/findings"
# Fuzzers still running when this script stops (an error, a signal) stop with it.
trap 'kill $(jobs -p) 2> /dev/null || true' EXIT

# fuzz_one NAME: runs one target; its exit status goes to BUILD/fuzz/NAME.status.
fuzz_one() {
  local name="$1" status=0
  mkdir -p "$build/fuzz/new/$name"
  # -timeout: a single input that runs 25 s is a hang (the sanitized build runs about 100 times
  # slower than a release build); -rss_limit_mb: far above the fuzzers' own
  # allocation limit (256 MiB), so that an allocation it fails to bound is reported.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$build/fuzz/fuzz_$name" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$build/fuzz/findings/$name-" "$build/fuzz/new/$name" "$root/fuzz/corpus/$name" \
    > "$build/fuzz/$name.log" 2>&1 || status=$?
  echo "$status" > "$build/fuzz/$name.status"
}

running=0
for name in "${targets[@]}"; do
  if [ "$running" -ge "$parallel" ]; then
    wait -n || true  # fuzz_one's own status is in its file
    running=$((running - 1))
  fi
  rm -f "$build/fuzz/$name.status"
  fuzz_one "$name" &
  running=$((running + 1))
done
wait

failed=0
for name in "${targets[@]}"; do
  log="$build/fuzz/$name.log"
  echo "fuzz: $name for $seconds s"
  grep -a -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb|posenc fuzz finding|SUMMARY|Test unit written)" "$log" 2> /dev/null || true
  status="$(cat "$build/fuzz/$name.status" 2> /dev/null || echo missing)"
  if [ "$status" != 0 ]; then
    { grep -a -A30 -E "ERROR|runtime error|posenc fuzz finding" "$log" 2> /dev/null || true; } | head -60 >&2 || true
    echo "fuzz: $name found a failure (status $status); the input is in $build/fuzz/findings, the log in $log" >&2
    failed=1
  fi
done
exit "$failed"
