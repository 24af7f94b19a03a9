#!/usr/bin/env bash
# Same seed, same numbers on every host: a small study (posenc study --quick, every scheme) whose
# every number is committed in golden.json, compared bit for bit, on whatever host runs it; then
# again with MKL and oneDNN told to take other code paths, which must change nothing (the study
# keeps its arithmetic from them: study/linear.hpp, study/adamw.hpp, study/study.cpp).
#   golden.sh POSENC_BINARY SOURCE_DIR WORK_DIR [--update]
# --update rewrites golden.json from this host (then say in the commit which host made it).
set -euo pipefail
posenc="$1" src="$2" work="$3" update="${4:-}"
python=/usr/bin/python3
golden="$src/tests/study/golden.json"
# The corpus: the GPL's text as Debian's base-files installs it on every machine (real English,
# fixed, nothing downloaded); its digest is checked so that another copy fails by name.
corpus=/usr/share/common-licenses/GPL-3
digest=3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986
[ "$(sha256sum "$corpus" | cut -d' ' -f1)" = "$digest" ] || { echo "$corpus is not the text golden.json was made from"; exit 1; }
rm -rf "$work" && mkdir -p "$work"
schemes=sinusoidal,learned,rope,rope-ntk,rope-yarn,xpos,t5,alibi,kerple,fire,nope,sandwich,fox,stickbreaking,cope
run() { "$posenc" study --quick --schemes "$1" --corpus "$corpus" --out "$2" > "$2.log" 2>&1 || { cat "$2.log"; exit 1; }; }

# Every number of results.json but times and the corpus's path (compare.py drops those too).
numbers() {
  "$python" -c '
import json, sys
sys.path.insert(0, sys.argv[2])
from compare import strip
print(json.dumps(strip(json.load(open(sys.argv[1]))), indent=1, sort_keys=True))' "$1" "$src/tests/study"
}

run "$schemes" "$work/a"
numbers "$work/a/results.json" > "$work/a.json"
if [ "$update" = --update ]; then
  cp "$work/a.json" "$golden"
  echo "golden.sh: wrote $golden"
  exit 0
fi
"$python" "$src/tests/study/compare.py" --whole "$golden" "$work/a.json" || { echo "golden.sh: this host's numbers are not the committed ones"; exit 1; }

# MKL (BLAS and vector library) on its COMPATIBLE branch and oneDNN at AVX-512 (where the host has
# it): the same bits. Each scheme's numbers do not depend on which others run, so three suffice.
MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX512_CORE run rope,alibi,fox "$work/b"
"$python" "$src/tests/study/compare.py" "$work/a.json" "$work/b/results.json" ||
  { echo "golden.sh: MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX512_CORE changes the numbers"; exit 1; }
echo "golden.sh: every number as committed"
