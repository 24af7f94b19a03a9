#!/usr/bin/env bash
# posenc study --kv-formats end to end on a tiny model: every format and key form evaluated at L
# and 4L, the numbers sane (finite, KL ≥ 0, q8_0 closer to the f32 cache than q4_0), Δ the
# difference from the f32 model's own bits per byte, and the study's other numbers unchanged by
# the option; a train-long baseline (trained at 2L) is scored at the study's L and 4L.
#   kv_cache.sh POSENC_BINARY WORK_DIR
set -euo pipefail
posenc="$1" work="$2"
python=/usr/bin/python3
rm -rf "$work" && mkdir -p "$work"
# Head size 32, ggml's block: every format applies.
run() {
  "$posenc" study --quick --schemes rope,alibi --train-long rope --width 64 --heads 2 --corpus /usr/share/common-licenses/GPL-3 "$@" \
    > "$work/run.log" 2>&1 || { cat "$work/run.log"; exit 1; }
}
run --out "$work/kv" --kv-formats q8_0,q4_0,fp8_e4m3
grep -q "| rope | q8_0 | pre_rope |" "$work/kv/report.md" || { echo "no KV-cache table in the report"; exit 1; }
run --out "$work/plain"
"$python" - "$work/kv/results.json" "$work/plain/results.json" <<'PY'
import json, math, sys
kv, plain = (json.load(open(p)) for p in sys.argv[1:3])
assert kv["settings"]["kv_formats"] == ["q8_0", "q4_0", "fp8_e4m3"], kv["settings"]
assert "kv_formats" not in plain["settings"], plain["settings"]
forms = {"rope": ["post_rope", "pre_rope"], "alibi": ["keys"], "rope@2L": ["post_rope", "pre_rope"]}
for scheme, keys in forms.items():
    r = kv["results"][scheme]
    for kind in ("bpb", "bpb_sliding", "copy_accuracy", "retrieval_accuracy"):
        if kind not in plain["results"][scheme]:
            continue  # the baseline has no synthetic tasks
        assert r[kind] == plain["results"][scheme][kind], (scheme, kind, "changed by --kv-formats")
    cache = r["runs"][0]["kv_cache"]
    assert sorted(cache) == ["fp8_e4m3", "q4_0", "q8_0"], cache.keys()
    for fmt, by_keys in cache.items():
        assert sorted(by_keys) == keys, (scheme, fmt, by_keys.keys())
        for form, at in by_keys.items():
            assert sorted(at, key=int) == ["32", "128"], (scheme, fmt, form, at.keys())
            for e, c in at.items():
                assert all(math.isfinite(c[k]) for k in ("bpb", "delta_bpb", "kl_bits")), (scheme, fmt, form, e, c)
                assert abs(c["bpb"] - c["delta_bpb"] - r["bpb"][e]) < 1e-12, (scheme, fmt, form, e, c)
                assert 0 <= c["kl_bits"] < 0.1, (scheme, fmt, form, e, c)
    for form in keys:
        for e in ("32", "128"):
            q8, q4 = cache["q8_0"][form][e]["kl_bits"], cache["q4_0"][form][e]["kl_bits"]
            assert q8 < q4, (scheme, form, e, q8, q4)
            assert abs(cache["q8_0"][form][e]["delta_bpb"]) < 0.01, (scheme, form, e, cache["q8_0"][form][e])
PY
echo "kv_cache.sh: passed"
