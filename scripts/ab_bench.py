#!/usr/bin/python3
"""Old against new: runs two posenc binaries on the same bench cases, alternating (old, new, then
new, old, ...), and prints the median over the repetitions of each one's ratio to the machine's
limit measured in the same run, and the median of the repetitions' new/old. On a shared, noisy
host only ratios measured side by side mean anything (docs/performance.md).

  /usr/bin/python3 scripts/ab_bench.py OLD/posenc NEW/posenc [--reps 4] [--only attention|rope|bias]

The cases: attention forward, backward (2048 tokens, 8 heads of 128, causal) and decode (32768
keys, 32 query heads over 8 KV heads) for none, rope, alibi, t5, shaw and xl; rope over a 32768 x
32/8 x 128 batch; bias materialisation and backward of ALiBi and T5 (2048 positions, 8 heads).
"""
import argparse
import json
import statistics
import subprocess

PREFILL = "--seq 2048 --heads 8 --kv-heads 8 --head-dim 128 --causal"
DECODE = "--seq 32768 --heads 32 --kv-heads 8 --head-dim 128 --causal"


def cases(only):
    out = []
    if only in (None, "attention"):
        for scheme in ["none", "rope", "alibi", "t5", "shaw", "xl", "stickbreaking", "cope"]:
            for p in ["forward", "backward", "decode"]:
                out.append(f"attention --scheme {scheme} --pass {p} " + (DECODE if p == "decode" else PREFILL))
    if only in (None, "rope"):
        out.append("rope -n 32768 -d 128 --heads 32 --kv-heads 8")
    if only in (None, "bias"):
        for scheme in ["alibi", "t5"]:
            for p in ["forward", "backward"]:
                out.append(f"bias --scheme {scheme} --pass {p} -n 2048 --heads 8")
    return out


def ratio(binary, case):
    cmd = [binary, "bench"] + case.split() + ["-t", "2", "--rounds", "1", "--format", "json"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {run.returncode}\n{run.stderr}")
    try:
        result = json.loads(run.stdout)
        return result["ratio"], result["limit_name"]
    except (ValueError, KeyError) as e:
        raise SystemExit(f"{' '.join(cmd)}: not a bench result ({e})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--reps", type=int, default=4, help="repetitions (even: each binary runs first as often)")
    parser.add_argument("--only", choices=["attention", "rope", "bias"])
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps = {args.reps}; expected >= 1")
    for case in cases(args.only):
        ratios = {"old": [], "new": []}
        limits = set()
        for rep in range(args.reps):
            order = [("old", args.old), ("new", args.new)]
            for name, binary in order if rep % 2 == 0 else reversed(order):
                r, limit = ratio(binary, case)
                ratios[name].append(r)
                limits.add(limit)
        if len(limits) != 1:
            raise SystemExit(f"{case}: the binaries judge it against different limits {sorted(limits)}")
        old, new = statistics.median(ratios["old"]), statistics.median(ratios["new"])
        paired = statistics.median(n / o for n, o in zip(ratios["new"], ratios["old"]))
        print(f"{case:88s} of {limits.pop():7s} old {old:.3f} new {new:.3f} new/old {paired:.3f}   "
              f"old {[round(x, 3) for x in ratios['old']]} new {[round(x, 3) for x in ratios['new']]}", flush=True)


if __name__ == "__main__":
    main()
