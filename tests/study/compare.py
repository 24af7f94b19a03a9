#!/usr/bin/env python3
"""Compares two `posenc study` results.json files number by number, bit for bit.

    compare.py [--whole] WANT.json GOT.json

Times and the corpus's path are left out (they are the host's). By default each (scheme, seed)
run the two files have in common is compared, so that a main job's seed-1 run can be checked
against the committed docs/study/results.json of three seeds; --whole compares everything else
too and needs the same schemes, seeds and settings in both. Prints how many numbers matched and
the first that differs; exits 1 then.
"""
import json
import sys


def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if "seconds" not in k and k != "corpus"}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x


def walk(a, b, path, out):
    """Appends (path, a, b) for every leaf where a and b differ; returns the leaves compared."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            out.append((path + " keys", sorted(a), sorted(b)))
            return 1
        return sum(walk(a[k], b[k], f"{path}.{k}", out) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append((path + " length", len(a), len(b)))
            return 1
        return sum(walk(x, y, f"{path}[{i}]", out) for i, (x, y) in enumerate(zip(a, b)))
    # Exact: JSON numbers read back as the doubles that were written; bool is not int here.
    if type(a) is not type(b) or a != b:
        out.append((path, a, b))
    return 1


def pairs(want, got, whole):
    """(label, want part, got part) to compare: the whole files, or per (scheme, seed) runs."""
    runs = all("runs" in r for d in (want, got) for r in d["results"].values())
    if whole or not runs:
        yield "results.json", want, got
        return
    seed_w, seed_g = want["settings"]["seed"], got["settings"]["seed"]
    for scheme in sorted(set(want["results"]) & set(got["results"])):
        rw, rg = want["results"][scheme]["runs"], got["results"][scheme]["runs"]
        for i, run in enumerate(rw):
            j = seed_w + i - seed_g
            if 0 <= j < len(rg):
                yield f"{scheme} seed {seed_w + i}", run, rg[j]


def main():
    args = sys.argv[1:]
    whole = args[:1] == ["--whole"]
    if whole:
        args = args[1:]
    if len(args) != 2:
        sys.exit(__doc__)
    want, got = (strip(json.load(open(p))) for p in args)
    compared, diffs, parts = 0, [], 0
    for label, a, b in pairs(want, got, whole):
        parts += 1
        compared += walk(a, b, label, diffs)
    if parts == 0:
        sys.exit("compare.py: the files have no scheme and seed in common")
    if diffs:
        path, a, b = diffs[0]
        print(f"compare.py: {len(diffs)} of {compared} numbers differ; first: {path}: {a!r} against {b!r}")
        sys.exit(1)
    print(f"compare.py: {compared} numbers in {parts} part(s), every one the same bits")


if __name__ == "__main__":
    main()
