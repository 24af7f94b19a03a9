#!/usr/bin/env bash
# posenc's fused attention beside ggml's CPU flash attention (ggml_flash_attn_ext) on this host,
# the two run alternately: prefill over f32 and f16 keys and values, decode over f16 and q8_0
# caches, after a check that the two write and read the same cache blocks (docs/performance.md,
# "Beside ggml"). Nothing is downloaded: give a ggml checkout.
#
#   bench/ggml_side_by_side.sh GGML_SOURCE_DIR [RUNS] [THREADS]
#
# It builds ggml's CPU backend under build-ggml/ (Release, ggml's own default flags, which
# compile for this host's processor) and the peer harness bench/ggml_attention.cpp against
# it, checks posenc's q8_0 and q4_0 blocks against ggml's quantizers (bench/ggml_blocks.cpp), and
# uses posenc's Release build in build/ (scripts/main.sh or test.sh makes it). Shapes: 32
# query heads over 8 KV heads of 128, no positional scheme; prefill 2048 tokens, causal; decode one
# query over 32768 keys. ggml takes an f32 query: its f16 decode converts it to f16 and sums the
# values in f16, its q8_0 decode quantizes it to q8_0; posenc's "f16" rows run q, k and v in f16
# (--dtype f16, f32 arithmetic), its q8_0 rows an f32 query over the q8_0 cache (--kv-dtype).
set -euo pipefail
ggml_src="${1:?usage: bench/ggml_side_by_side.sh GGML_SOURCE_DIR [RUNS] [THREADS]}"
runs="${2:-3}"
threads="${3:-2}"
root="$(cd "$(dirname "$0")/.." && pwd)"
posenc="$root/build/posenc"
[[ -x "$posenc" ]] || { echo "ggml_side_by_side: $posenc is missing; build posenc first (scripts/main.sh)" >&2; exit 1; }
grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$root/build/CMakeCache.txt" ||
  { echo "ggml_side_by_side: $root/build is not a Release build; expected the one scripts/main.sh makes" >&2; exit 1; }
[[ -f "$ggml_src/include/ggml.h" ]] || { echo "ggml_side_by_side: $ggml_src has no include/ggml.h; expected a ggml checkout" >&2; exit 1; }

out="$root/build-ggml"
ggml_src="$(cd "$ggml_src" && pwd)"
# One build folder per checkout (CMake's cache names its source). Native flags and shared
# libraries named, not left to ggml's defaults (which turn GGML_NATIVE off under
# SOURCE_DATE_EPOCH or a cross-compile).
build="$out/ggml-$(printf '%s' "$ggml_src" | md5sum | cut -c1-12)"
mkdir -p "$out"
cmake -S "$ggml_src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON \
  -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF > "$out/configure.log" 2>&1 ||
  { cat "$out/configure.log" >&2; exit 1; }
ninja -C "$build" ggml ggml-base ggml-cpu > "$out/build.log" 2>&1 || { tail -30 "$out/build.log" >&2; exit 1; }
lib="$build/src"
[[ -f "$lib/libggml-cpu.so" ]] || { echo "ggml_side_by_side: no libggml-cpu.so under $lib" >&2; exit 1; }
g++ -O2 -std=c++17 -I"$ggml_src/include" "$root/bench/ggml_attention.cpp" -o "$out/ggml_attention" \
  -L"$lib" -lggml -lggml-base -lggml-cpu -Wl,-rpath,"$lib"
g++ -O2 -std=c++20 -I"$ggml_src/include" -I"$root/include" "$root/bench/ggml_blocks.cpp" -o "$out/ggml_blocks" \
  -L"$lib" -L"$root/build" -lggml -lggml-base -lggml-cpu -lposenc -Wl,-rpath,"$lib:$root/build"

# The caches first: ggml's q8_0 and q4_0 blocks are posenc's, byte for byte.
"$out/ggml_blocks"

heads=32 kv_heads=8 head_dim=128
shape=(--heads "$heads" --kv-heads "$kv_heads" --head-dim "$head_dim" --scheme none -t "$threads" --rounds 1 --format json)
posenc_ms() {
  "$posenc" bench attention "${shape[@]}" "$@" | python3 -c 'import json, sys; print("%.3f" % (json.load(sys.stdin)["seconds"] * 1e3))'
}
ggml_ms() {
  "$out/ggml_attention" "$@" "$heads" "$kv_heads" "$head_dim" "$threads" 1 | sed -n 's/.*: \([0-9.]*\) ms.*/\1/p'
}
cases=("prefill f32|--pass forward --causal --seq 2048|prefill f32 2048"
       "prefill f16|--pass forward --causal --seq 2048 --dtype f16|prefill f16 2048"
       "decode f16|--pass decode --seq 32768 --dtype f16|decode f16 32768"
       "decode q8_0|--pass decode --seq 32768 --kv-dtype q8_0|decode q8_0 32768")
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $threads threads; ggml $(git -C "$ggml_src" log -1 --format='%h %cs' 2>/dev/null || echo '(not a git checkout)')"
printf '%-12s %4s %12s %12s %16s\n' case run "posenc ms" "ggml ms" "ggml / posenc"
for ((r = 1; r <= runs; ++r)); do
  for c in "${cases[@]}"; do
    IFS='|' read -r name posenc_args ggml_args <<< "$c"
    # shellcheck disable=SC2086  # the arguments split on spaces
    p="$(posenc_ms $posenc_args)"
    # shellcheck disable=SC2086
    g="$(ggml_ms $ggml_args)"
    printf '%-12s %4d %12s %12s %16s\n' "$name" "$r" "$p" "$g" "$(python3 -c "print(f'{$g / $p:.2f}')")"
  done
done
