#!/usr/bin/env bash
# Formats the tree's C++ with .clang-format (Debian 12's clang-format 14: another version may
# format differently). --check changes nothing and fails, listing the files, if any is unformatted.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.h')
else  # an unpacked archive
  mapfile -t files < <(find bench cli fuzz include perf src study tests torch -name '*.cpp' -o -name '*.hpp' -o -name '*.h' | sort)
fi
if [ "${1:-}" = "--check" ]; then
  bad=()
  for f in "${files[@]}"; do
    clang-format-14 --dry-run -Werror "$f" > /dev/null 2>&1 || bad+=("$f")
  done
  if [ ${#bad[@]} -gt 0 ]; then
    echo "posenc: not formatted (run bash scripts/format.sh): ${bad[*]}" >&2
    exit 1
  fi
  echo "posenc: all ${#files[@]} C++ files formatted"
else
  clang-format-14 -i "${files[@]}"
fi
