#!/usr/bin/env bash
# posenc plot end to end: every figure written as PNG and SVG of the intended size, with its
# title; the numbers behind three figures checked against an independent computation and the
# `posenc t5-buckets` command; --only and --format honoured; bad input gives one clear line.
#   plots.sh POSENC_BINARY WORK_DIR
set -euo pipefail
posenc="$1" work="$2"
python=/usr/bin/python3
rm -rf "$work" && mkdir -p "$work"

"$posenc" plot --out "$work/all" > "$work/all.log" 2> "$work/all.err"
[ ! -s "$work/all.err" ] || { echo "gnuplot complained:"; cat "$work/all.err"; exit 1; }
# name width height title-fragment (the figures' sizes and titles, cli/plot.cpp)
while read -r name width height title; do
  png="$work/all/$name.png" svg="$work/all/$name.svg"
  grep -qx "$png" "$work/all.log" || { echo "$name.png not listed"; exit 1; }
  head -c 8 "$png" | od -An -tx1 | grep -q "89 50 4e 47 0d 0a 1a 0a" || { echo "$name.png is not a PNG"; exit 1; }
  # IHDR: width and height, big-endian, at bytes 16–23.
  size=$(od -An -tu1 -j16 -N8 "$png" | awk '{print $1*16777216+$2*65536+$3*256+$4, $5*16777216+$6*65536+$7*256+$8}')
  [ "$size" = "$width $height" ] || { echo "$name.png is $size, expected $width $height"; exit 1; }
  # A blank canvas of these sizes compresses to under 10 KB; a drawn figure does not.
  [ "$(stat -c %s "$png")" -gt 20000 ] || { echo "$name.png too small to hold a figure"; exit 1; }
  grep -q "<svg" "$svg" || { echo "$name.svg is not SVG"; exit 1; }
  grep -q "$title" "$svg" || { echo "$name.svg lacks its title ($title)"; exit 1; }
done <<'FIGURES'
sinusoid-squiggles 1000 600 Sinusoidal encoding PE(p) per dimension
sinusoidal-table 900 700 Sinusoidal table
rope-table 1200 650 RoPE rotation angles
sinusoidal-similarity 1000 600 dot-product similarity against distance
rope-decay 1000 600 long-term decay
alibi-bias 1000 900 ALiBi biases
t5-bias 1000 900 T5 biases table
t5-bucket-map 1200 650 T5 relative-position buckets of
t5-buckets 1000 600 T5 buckets against relative position
kerple-bias 1000 900 Kerple biases
fire-bias 1000 900 FIRE biases
rope-scaling 1000 650 RoPE scalings
sandwich-bias 1000 900 sandwich:
tupe-bias 1000 900 tupe: biases with its registry defaults
FIGURES
# Axis labels and a legend are there too (two samples).
grep -q "rotation pair i" "$work/all/rope-scaling.svg" && grep -q "llama3, factor 8" "$work/all/rope-scaling.svg" \
  || { echo "rope-scaling.svg lacks its labels or legend"; exit 1; }

# The numbers: sinusoids by the formula, RoPE wavelengths by the formula and Llama 3.1's rule,
# T5 buckets by the command that Hugging Face's goldens check.
"$posenc" t5-buckets --from -300 --to 300 > "$work/t5-bidirectional.json"
"$posenc" t5-buckets --from -300 --to 300 --causal > "$work/t5-causal.json"
"$python" - "$work" <<'PY'
import json, math, sys
work = sys.argv[1]
rows = [l.split() for l in open(f"{work}/all/sinusoid-squiggles.dat") if not l.startswith("#")]
dims = [4, 5, 16, 32, 64]
for row in rows:
    p = int(row[0])
    for d, v in zip(dims, row[1:]):
        w = 10000.0 ** (-(d // 2 * 2) / 128)
        want = math.sin(p * w) if d % 2 == 0 else math.cos(p * w)
        # printed with 6 decimals
        assert abs(float(v) - want) <= 1e-6, (p, d, v, want)
scaling = [l.split() for l in open(f"{work}/all/rope-scaling.dat") if not l.startswith("#")]
assert len(scaling) == 64
for row in scaling:
    i = int(row[0])
    default = 2 * math.pi * 500000.0 ** (2 * i / 128)
    # 6 significant digits
    assert abs(float(row[1]) / default - 1) < 1e-5, (i, row[1], default)
    assert abs(float(row[2]) / (8 * default) - 1) < 1e-5, ("linear", i)
    # llama3: wavelengths under 8192/4 = 2048 unchanged, over 8192/1 divided by... ω/8, i.e. ×8
    if default < 2048:
        assert abs(float(row[5]) / default - 1) < 1e-5, ("llama3 high", i)
    if default > 8192:
        assert abs(float(row[5]) / (8 * default) - 1) < 1e-5, ("llama3 low", i)
t5 = [l.split() for l in open(f"{work}/all/t5-buckets.dat") if not l.startswith("#")]
assert [int(r[1]) for r in t5] == json.load(open(f"{work}/t5-bidirectional.json"))
assert [int(r[2]) for r in t5] == json.load(open(f"{work}/t5-causal.json"))
# A heat map's masked cells: keys after the query (ALiBi head 0, slope 1/2).
m = [l.split() for l in open(f"{work}/all/alibi-bias-0.dat") if not l.startswith("#")]
assert len(m) == 64 and all(len(r) == 64 for r in m)
for i in range(64):
    for j in range(64):
        if j > i:
            assert m[i][j] == "1e99", (i, j, m[i][j])
        else:
            # −(i − j)/2 is a half-integer under 32: printed with 6 significant digits it is exact.
            assert abs(float(m[i][j]) + 0.5 * (i - j)) < 1e-9, (i, j, m[i][j])
# A registry scheme's figure (Sandwich's defaults, d' = 128): head 0 is Σ_k cos(r·ω_k) − 64, times 8/8.
m = [l.split() for l in open(f"{work}/all/sandwich-bias-0.dat") if not l.startswith("#")]
for i in range(0, 64, 7):
    for j in range(0, i + 1, 5):
        want = sum(math.cos((j - i) * 10000.0 ** (-2 * k / 128)) for k in range(64)) - 64
        assert abs(float(m[i][j]) - want) <= 1e-5 * max(1.0, abs(want)), (i, j, m[i][j], want)
PY

# --only and --format.
"$posenc" plot --out "$work/one" --only t5-buckets,rope-decay --format svg > /dev/null
[ "$(ls "$work"/one/*.svg | wc -l)" = 2 ] && ! ls "$work"/one/*.png > /dev/null 2>&1 || { echo "--only/--format ignored"; ls "$work/one"; exit 1; }

# Errors: one line each, naming the value.
expect_error() {  # expected-fragment args…
  local expected="$1"; shift
  if "$posenc" plot "$@" > /dev/null 2> "$work/err"; then echo "accepted: $*"; exit 1; fi
  [ "$(wc -l < "$work/err")" = 1 ] && grep -qF -- "$expected" "$work/err" || { echo "for $*:"; cat "$work/err"; exit 1; }
}
expect_error "--only = squiggle; expected one of sinusoid-squiggles" --out "$work/e" --only squiggle
expect_error "--format = gif; expected png, svg or both" --out "$work/e" --format gif
expect_error "expected a path without a single quote" --out "$work/it's"
touch "$work/file"
expect_error "--out = $work/file/sub; expected a directory that can be created" --out "$work/file/sub"
echo "plots: ok"
