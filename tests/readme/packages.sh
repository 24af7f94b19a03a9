#!/usr/bin/env bash
# tests/readme/packages.sh SOURCE_DIR: the README's list of Debian packages is the one the set-up
# scripts install (scripts/common.sh), for each of the two commands.
set -euo pipefail
source "$1/scripts/common.sh"
line="$(grep -m1 '^Debian packages:' "$1/README.md")" || { echo "README: no line 'Debian packages:'" >&2; exit 1; }
# `name`s between two markers of the line, sorted.
names() { sed -n "s/.*$1\(.*\)$2.*/\1/p" <<< "$line" | grep -o '`[^`]*`' | tr -d '`' | sort | tr '\n' ' '; }
sorted() { printf '%s\n' "$@" | sort | tr '\n' ' '; }
status=0
posenc_packages main
[ "$(names 'both commands install' '; the test command adds')" = "$(sorted "${POSENC_PACKAGES[@]}")" ] ||
  { echo "README's packages of both commands differ from scripts/common.sh: ${POSENC_PACKAGES[*]}" >&2; status=1; }
[ "$(names 'the test command adds' '')" = "$(sorted "${POSENC_TEST_PACKAGES[@]}")" ] ||
  { echo "README's packages of the test command differ from scripts/common.sh: ${POSENC_TEST_PACKAGES[*]}" >&2; status=1; }
exit "$status"
