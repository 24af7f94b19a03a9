#!/usr/bin/env bash
# bf16 attention on the host's bf16 dot products against f32 attention of the same shape, run
# alternately: the ratio of their GFLOP/s per pair of runs, forward and backward
# (docs/performance.md, "Native bf16 products"). Uses posenc's Release build in build/
# (scripts/main.sh or test.sh makes it).
#
#   bench/bf16_products.sh [PAIRS] [THREADS] [SCHEMES…]
#
# Shapes: S = 2048, causal, D = 128, 8 heads over 8 KV heads and 32 over 8. A host without
# AVX512-BF16 runs bf16 widened to f32; the script says which.
set -euo pipefail
pairs="${1:-5}"
threads="${2:-2}"
shift $(($# > 2 ? 2 : $#))
schemes=("$@")
[[ ${#schemes[@]} -gt 0 ]] || schemes=(none rope alibi)
root="$(cd "$(dirname "$0")/.." && pwd)"
posenc="$root/build/posenc"
[[ -x "$posenc" ]] || { echo "bf16_products: $posenc is missing; build posenc first (scripts/main.sh)" >&2; exit 1; }
python="$(command -v python3)"

gflops() {  # pass scheme heads kv-heads dtype
  local pass="$1"
  shift
  "$posenc" bench attention --scheme "$1" --pass "$pass" --seq 2048 --heads "$2" --kv-heads "$3" --head-dim 128 \
    --causal --rounds 3 --dtype "$4" -t "$threads" --format json |
    "$python" -c 'import json, sys; r = json.load(sys.stdin); print("%.1f %.2f" % (r["throughput"], r["ratio"]))'
}

echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs) model $(grep -m1 '^model' /proc/cpuinfo | cut -d: -f2 | xargs); avx512_bf16: $(grep -qw avx512_bf16 /proc/cpuinfo && echo yes || echo no)"
printf '%-9s %-8s %-6s %22s %22s %8s\n' pass scheme heads "f32 GFLOP/s (of fma)" "bf16 GFLOP/s (of fma)" "bf16/f32"
for pass in forward backward; do
  for scheme in "${schemes[@]}"; do
    for heads in "8 8" "32 8"; do
      read -r h g <<< "$heads"
      for _ in $(seq "$pairs"); do
        read -r f fr <<< "$(gflops "$pass" "$scheme" "$h" "$g" f32)"
        read -r b br <<< "$(gflops "$pass" "$scheme" "$h" "$g" bf16)"
        printf '%-9s %-8s %-6s %14s (%5s) %14s (%5s) %8s\n' "$pass" "$scheme" "$h/$g" "$f" "$fr" "$b" "$br" \
          "$("$python" -c "print('%.2f' % ($b / $f))")"
      done
    done
  done
done
