#!/usr/bin/env bash
# The study end to end with tiny settings (posenc study --quick on a few schemes): files written,
# numbers finite, the same seed gives the same numbers, a killed run resumes from its finished
# schemes, and bad input gives a clear error.
#   pipeline.sh POSENC_BINARY SOURCE_DIR WORK_DIR
set -euo pipefail
posenc="$1" src="$2" work="$3"
python=/usr/bin/python3
rm -rf "$work" && mkdir -p "$work"
# A real English corpus that needs no download: the repository's own documentation.
cat "$src"/README.md "$src"/docs/*.md > "$work/corpus.txt"
run() { "$posenc" study --quick --schemes rope,alibi,rope-yarn,learned --corpus "$work/corpus.txt" "$@"; }

run --out "$work/a" > "$work/a.log" 2> "$work/a.err"
for f in results.json report.md bpb.png bpb.svg bpb_sliding.png bpb_sliding.svg copy_accuracy.png copy_accuracy.svg retrieval_accuracy.png retrieval_accuracy.svg schemes/rope.seed1.json schemes/alibi.seed1.json schemes/rope-yarn.seed1.json schemes/learned.seed1.json schemes/rope-yarn.seed1.retrieval.json schemes/learned.seed1.retrieval.json; do
  [ -s "$work/a/$f" ] || { echo "missing or empty: $f"; exit 1; }
done
grep -q "| rope-yarn |" "$work/a.log" || { echo "no results table"; cat "$work/a.log"; exit 1; }
# PNG signature and a plot of a sane size.
head -c 8 "$work/a/bpb.png" | od -An -tx1 | grep -q "89 50 4e 47 0d 0a 1a 0a" || { echo "bpb.png is not a PNG"; exit 1; }
[ "$(stat -c %s "$work/a/bpb.png")" -gt 10000 ] || { echo "bpb.png too small"; exit 1; }
grep -q "<svg" "$work/a/bpb.svg" || { echo "bpb.svg is not SVG"; exit 1; }
head -c 8 "$work/a/copy_accuracy.png" | od -An -tx1 | grep -q "89 50 4e 47 0d 0a 1a 0a" || { echo "copy_accuracy.png is not a PNG"; exit 1; }
grep -q "Copy task" "$work/a/report.md" || { echo "no copy task in the report"; exit 1; }
grep -q "Retrieval task" "$work/a/report.md" || { echo "no retrieval task in the report"; exit 1; }

numbers() {  # every bpb of a results.json, one per line
  "$python" -c '
import json, math, sys
r = json.load(open(sys.argv[1]))["results"]
for scheme in ("rope", "alibi", "rope-yarn", "learned"):
    for kind in ("bpb", "bpb_sliding"):
        for length, value in r[scheme][kind].items():
            assert math.isfinite(value) and 0 < value < 8.5, (scheme, kind, length, value)
            print(scheme, kind, length, repr(value))
    for task in ("copy_accuracy", "retrieval_accuracy"):
        for length, value in r[scheme][task].items():
            assert 0 <= value <= 1, (scheme, task, length, value)
            print(scheme, task, length, repr(value))' "$1"
}
numbers "$work/a/results.json" > "$work/a.numbers"
# rope and rope-yarn share one trained model: equal at the training length, apart beyond it.
"$python" -c '
import json, sys
r = json.load(open(sys.argv[1]))["results"]
assert r["rope"]["bpb"]["32"] == r["rope-yarn"]["bpb"]["32"], "rope-yarn at L differs from rope"
assert r["rope"]["bpb"]["512"] != r["rope-yarn"]["bpb"]["512"], "rope-yarn at 16L equals rope"' "$work/a/results.json"

# Same seed, fresh directory, one job instead of two: the same numbers.
run --out "$work/b" --jobs 1 > /dev/null 2>&1
numbers "$work/b/results.json" > "$work/b.numbers"
cmp "$work/a.numbers" "$work/b.numbers" || { echo "same seed, different numbers"; exit 1; }
# posenc's SIMD target is pinned (avx2 on any host that has it), so that a host's own choice
# changes no number: forcing another through POSENC_TARGET gives the same numbers, while asking
# the study for another target (--target) gives other ones, as other reduction orders must.
target=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["settings"]["target"])' "$work/a/results.json")
if [ "$target" = avx2 ]; then
  POSENC_TARGET=sse4 run --out "$work/t" > /dev/null 2>&1
  numbers "$work/t/results.json" > "$work/t.numbers"
  cmp "$work/a.numbers" "$work/t.numbers" || { echo "the host's SIMD target changes the numbers"; exit 1; }
  run --out "$work/u" --target sse4 > /dev/null 2>&1
  numbers "$work/u/results.json" > "$work/u.numbers"
  ! cmp -s "$work/a.numbers" "$work/u.numbers" || { echo "--target sse4 changes nothing"; exit 1; }
fi
# Another seed: other numbers.
run --out "$work/c" --seed 2 > /dev/null 2>&1
numbers "$work/c/results.json" > "$work/c.numbers"
! cmp -s "$work/a.numbers" "$work/c.numbers" || { echo "--seed changes nothing"; exit 1; }

# Resume: kill a run once its first scheme is written; whole files only; the rerun skips it.
run --out "$work/d" --jobs 1 > /dev/null 2>&1 &
pid=$!
for _ in $(seq 1 600); do
  compgen -G "$work/d/schemes/*.json" > /dev/null && break
  sleep 0.1
done
kill -9 "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
for f in "$work"/d/schemes/*.json; do "$python" -c 'import json, sys; json.load(open(sys.argv[1]))' "$f"; done
run --out "$work/d" --jobs 1 > /dev/null 2> "$work/d.err"
grep -q "done in an earlier run" "$work/d.err" || { echo "the rerun did not resume"; cat "$work/d.err"; exit 1; }
numbers "$work/d/results.json" > "$work/d.numbers"
cmp "$work/a.numbers" "$work/d.numbers" || { echo "a resumed run gives other numbers"; exit 1; }
# The retrieval panel resumes on its own: without its file, alibi retrains that task only.
rm "$work/d/schemes/alibi.seed1.retrieval.json"
run --out "$work/d" --jobs 1 > /dev/null 2> "$work/d2.err"
grep -q "alibi (seed 1): done in an earlier run" "$work/d2.err" || { echo "alibi's language model retrained"; exit 1; }
grep -q "alibi: retrieval task evaluated" "$work/d2.err" || { echo "alibi's retrieval task not retrained"; exit 1; }
grep -q "rope retrieval (seed 1): done in an earlier run" "$work/d2.err" || { echo "rope's retrieval task retrained"; exit 1; }
numbers "$work/d/results.json" > "$work/d.numbers"
cmp "$work/a.numbers" "$work/d.numbers" || { echo "a resumed retrieval panel gives other numbers"; exit 1; }

# Two seeds in the same directory: seed 1's files are reused, seed 2 trains; every cell has a mean
# (seed 1's value and seed 2's between them) and a 95% interval; the table prints both.
run --out "$work/a" --seeds 2 > "$work/a2.log" 2> "$work/a2.err"
grep -q "(seed 1): done in an earlier run" "$work/a2.err" || { echo "--seeds 2 did not reuse seed 1"; exit 1; }
[ -s "$work/a/schemes/rope.seed2.json" ] || { echo "--seeds 2: no seed 2 file"; exit 1; }
grep -q "| rope | [0-9.]* ± [0-9.]* |" "$work/a2.log" || { echo "--seeds 2: no intervals in the table"; cat "$work/a2.log"; exit 1; }
"$python" -c '
import json, math, sys
all = json.load(open(sys.argv[1]))
assert all["seeds"] == 2
for scheme, r in all["results"].items():
    runs = r["runs"]
    assert len(runs) == 2
    for length, mean in r["bpb"].items():
        a, b = (run["bpb"][length] for run in runs)
        assert abs(mean - (a + b) / 2) < 1e-12 and r["bpb_ci95"][length] > 0, (scheme, length)
        # Student t with 1 degree of freedom: 12.706 · |a − b| / 2.
        assert abs(r["bpb_ci95"][length] - 12.706 * abs(a - b) / 2) < 1e-9, (scheme, length)
' "$work/a/results.json" || { echo "--seeds 2: bad means or intervals"; exit 1; }

# The model's shape from the command line, and its errors.
one() { "$posenc" study --quick --schemes alibi --corpus "$work/corpus.txt" "$@"; }
one --out "$work/m" --width 48 --layers 1 --heads 3 --train-length 16 --train-bytes 20000 > /dev/null 2>&1
"$python" -c '
import json, sys
s = json.load(open(sys.argv[1]))["settings"]
assert (s["width"], s["layers"], s["heads"], s["train_length"], s["train_tokens"]) == (48, 1, 3, 16, 20000), s
assert s["eval_tokens"] % (16 * 16) == 0' "$work/m/results.json" || { echo "model flags not applied"; exit 1; }
for bad in "--width 30|--width = 30; expected 2 to 4096, a multiple of --heads (2) whose head size is even" "--heads 0|--heads = 0; expected 1 to 64" \
           "--train-length 4|--train-length = 4; expected 8 to 4096" "--seeds 0|--seeds = 0; expected 1 to 100" \
           "--train-bytes 0|--train-bytes = 0; expected 1 to 1e12" "--layers 65|--layers = 65; expected 1 to 64"; do
  flag="${bad%%|*}" message="${bad#*|}"
  if one --out "$work/e" $flag 2> "$work/e.err"; then echo "$flag accepted"; exit 1; fi
  grep -qF -- "$message" "$work/e.err" || { echo "$flag: unexpected message"; cat "$work/e.err"; exit 1; }
done

# Train short, test long: rope also trained at 2L (no synthetic tasks), evaluated at L … 16L, with
# its training time and one step's peak memory beside the others'.
one --out "$work/t" --train-long rope > "$work/t.log" 2>&1 || { cat "$work/t.log"; exit 1; }
"$python" -c '
import json, sys
r = json.load(open(sys.argv[1]))["results"]
assert sorted(r) == ["alibi", "rope@2L"], sorted(r)
assert r["rope@2L"]["train_length"] == 64 and r["alibi"]["train_length"] == 32
assert sorted(r["rope@2L"]["bpb"]) == sorted(r["alibi"]["bpb"]) and "copy_accuracy" not in r["rope@2L"]
assert "retrieval_accuracy" not in r["rope@2L"] and "retrieval_accuracy" in r["alibi"]
for x in r.values():
    assert x["step_peak_mib"] > 0 and x["train_seconds_per_mbyte"] > 0, x
' "$work/t/results.json" || { echo "--train-long: bad results"; exit 1; }
grep -q "| rope@2L | 64 |" "$work/t/report.md" || { echo "--train-long: no table in the report"; exit 1; }
if one --out "$work/e" --train-long rope-yarn 2> "$work/e.err"; then echo "--train-long rope-yarn accepted"; exit 1; fi
grep -qF -- "--train-long = rope-yarn; expected a scheme trained as itself" "$work/e.err" || { cat "$work/e.err"; exit 1; }

# A relative --out (gnuplot runs inside it): the plots land there.
(cd "$work" && "$posenc" study --quick --schemes alibi --corpus "$work/corpus.txt" --out relative > /dev/null 2>&1)
[ -s "$work/relative/bpb.png" ] || { echo "relative --out: no plot"; exit 1; }

# A scheme the study knows only from the registry (posenc schemes), and the content-based ones
# (Forgetting Attention, stick-breaking attention, CoPE): trained and evaluated alike.
"$posenc" study --quick --schemes sandwich,fox,stickbreaking,cope --corpus "$work/corpus.txt" --out "$work/s" > "$work/s.log" 2>&1 ||
  { cat "$work/s.log"; exit 1; }
"$python" -c '
import json, math, sys
for scheme in ("sandwich", "fox", "stickbreaking", "cope"):
    r = json.load(open(sys.argv[1]))["results"][scheme]
    values = [v for kind in ("bpb", "bpb_sliding") for v in r[kind].values()]
    assert values and all(math.isfinite(v) and v > 0 for v in values), (scheme, values)
' "$work/s/results.json" || { echo "sandwich, fox, stickbreaking, cope: bad numbers"; exit 1; }
for scheme in sandwich fox stickbreaking cope; do
  grep -q "| $scheme |" "$work/s.log" || { echo "$scheme: no results table"; cat "$work/s.log"; exit 1; }
done

# Errors.
if "$posenc" study --quick --corpus "$work/missing.txt" --out "$work/e" 2> "$work/e.err"; then exit 1; fi
grep -q "missing.txt; expected an existing file or Brown Corpus directory" "$work/e.err" || { cat "$work/e.err"; exit 1; }
if "$posenc" study --quick --schemes rope,sideways --corpus "$work/corpus.txt" --out "$work/e" 2> "$work/e.err"; then exit 1; fi
grep -q "sideways; expected one of" "$work/e.err" || { cat "$work/e.err"; exit 1; }
echo "study pipeline: ok"
