#!/usr/bin/env bash
# The layers of docs/architecture.md and what each may include and name, checked on the source
# tree: bash tests/layers.sh [ROOT]. Prints every breach (file, what it includes or names, what
# its layer allows) and exits 1 if there is one. Comments are not code: // to the end of a line
# is dropped before names are looked for.
set -u
shopt -s nullglob globstar
cd "${1:-$(dirname "$0")/..}" || exit 2
breaches=0
breach() {
  echo "layers: $1"
  breaches=$((breaches + 1))
}

# The quoted includes of a file, one per line.
includes() { sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$1"; }

# Every quoted include of the files must match (`only`) or must not match (`never`) the extended
# regex `pattern`.
check_includes() {
  local layer=$1 rule=$2 pattern=$3 f inc
  shift 3
  for f in "$@"; do
    while IFS= read -r inc; do
      if [[ $rule == only && ! $inc =~ $pattern ]]; then
        breach "$f ($layer) includes \"$inc\"; its layer allows only $pattern"
      elif [[ $rule == never && $inc =~ $pattern ]]; then
        breach "$f ($layer) includes \"$inc\"; its layer must not include $pattern"
      fi
    done < <(includes "$f")
  done
}

# No code line of the files (comments dropped) may match `forbidden` (an extended regex).
never_names() {
  local layer=$1 forbidden=$2 f hit
  shift 2
  for f in "$@"; do
    while IFS= read -r hit; do
      breach "$f:${hit%%:*} ($layer) names ${hit#*:}; its layer must not name $forbidden"
    done < <(sed 's@//.*$@@' "$f" | grep -noE "$forbidden")
  done
}

public=(include/posenc/*.hpp torch/include/posenc/torch/*.hpp)
kernels=(src/kernels/**/*.cpp src/kernels/**/*.hpp src/kernels/**/*.h)
engine=(src/attention/*.cpp src/attention/*.hpp)
references=(src/ref/*.cpp src/ref/*.hpp)
front_ends=(cli/*.cpp cli/*.hpp study/*.cpp study/*.hpp perf/*.cpp perf/*.hpp bench/*.cpp torch/*.cpp torch/*.hpp
  fuzz/*.cpp fuzz/*.hpp)
schemes='ShawTerm|XlTerm|ForgetGate|AttentionSinks|FireParams|TupeParams|AlibiParams|T5BiasParams|KerpleParams|SandwichBias'

if ((${#public[@]} == 0 || ${#kernels[@]} == 0 || ${#engine[@]} == 0 || ${#references[@]} == 0)); then
  echo "layers: no sources under $(pwd); expected the repository's root"
  exit 2
fi

# 1. The public headers: the standard library and each other; no engine type (an extension
#    interface they declare can be implemented outside the library).
check_includes "public header" only '^posenc/' "${public[@]}"
never_names "public header" 'detail::[A-Za-z_]+' "${public[@]}"
# 2. The kernels: Highway's per-target code over plain arrays, knowing no scheme and no plan.
check_includes "kernel" only '^(kernels/|hwy/|posenc/(dtype|error|quantized)\.hpp$)' "${kernels[@]}"
# 3. The engine: no scheme by name; it reaches them through the registry's families, the fused
#    forms found by type (src/schemes/fused_terms.cpp) and the transforms' overloads.
check_includes "engine" never '^schemes/|^posenc/(relative|forgetting|sinks|sandwich|cope|stickbreaking|floater)\.hpp$' \
  "${engine[@]}"
never_names "engine" "\\b($schemes)\\b" "${engine[@]}"
# 4. The fp64 references: independent of every fast path.
check_includes "reference" never '^(kernels|attention|schemes)/' "${references[@]}"
# 5. The front ends (torch ops, CLI, study, benchmarks, fuzzers): the public headers and their own.
check_includes "front end" never '^\.\.|(^|/)src/|^(internal\.hpp|attention/|kernels/|ref/|schemes/)' "${front_ends[@]}"

if ((breaches > 0)); then
  echo "layers: $breaches breaches (docs/architecture.md says what each layer may include)"
  exit 1
fi
echo "layers: ${#public[@]} public headers, ${#kernels[@]} kernel, ${#engine[@]} engine, ${#references[@]} reference and ${#front_ends[@]} front-end files keep to their layers"
