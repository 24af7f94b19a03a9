#!/usr/bin/env bash
# The wheel that the README's `pip wheel` line made (in readme.sh), installed as a user would: into
# a fresh virtual environment that has the same torch and no posenc, with pip offline. Its metadata
# must require the torch it was built for, and the README's Python examples must run from another
# directory without PYTHONPATH.
#   wheel.sh PYTHON SOURCE_DIR WHEEL_DIR WORK_DIR
set -euo pipefail
python="$1" src="$2" wheels="$3" work="$4"
rm -rf "$work" && mkdir -p "$work"
shopt -s nullglob
found=("$wheels"/posenc-*.whl)
[ ${#found[@]} -eq 1 ] || { echo "expected one posenc wheel in $wheels; found ${#found[@]}: ${found[*]}"; exit 1; }
wheel="${found[0]}"
echo "wheel: $(basename "$wheel")"

# The fresh environment sees the set-up's torch (and numpy) through a .pth file rather than a second
# copy of the same few GB of wheels; posenc is not importable in it until the wheel is installed.
# Without a pip and setuptools of its own, whose older versions would shadow those torch requires,
# it takes the wheel through the set-up's pip (--python).
"$python" -m venv --without-pip "$work/env"
env_python="$work/env/bin/python"
purelib='import sysconfig; print(sysconfig.get_path("purelib"))'
echo "$("$python" -c "$purelib")" > "$("$env_python" -c "$purelib")/setup-torch.pth"
if env -u PYTHONPATH "$env_python" -c "import posenc" 2> /dev/null; then
  echo "posenc is importable in the fresh environment before its wheel is installed"
  exit 1
fi
env -u PYTHONPATH "$python" -m pip --python "$env_python" install --no-index --disable-pip-version-check --quiet "$wheel"

# The wheel pins the torch it was built against (its ABI): torch==major.minor.*.
torch_mm="$("$python" -c 'import torch; print(".".join(torch.__version__.split("+")[0].split(".")[:2]))')"
requires="$(env -u PYTHONPATH "$env_python" -c 'import importlib.metadata as m; print(m.requires("posenc"))')"
[ "$requires" = "['torch==$torch_mm.*']" ] || { echo "the wheel requires $requires; expected ['torch==$torch_mm.*']"; exit 1; }
# The extension inside carries no path into the environment that built it.
"$python" -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("posenc/libposenc_torch.so"))' \
  "$wheel" > "$work/libposenc_torch.so"
if readelf -d "$work/libposenc_torch.so" | grep -E 'R(UN)?PATH' | grep -q "$(dirname "$(dirname "$python")")"; then
  echo "libposenc_torch.so has an RPATH into the build's environment: $(readelf -d "$work/libposenc_torch.so" | grep PATH)"
  exit 1
fi

"$python" "$src/tests/readme/run_snippets.py" installed "$src" "$env_python" "$work/elsewhere"
echo "the wheel installs and runs: $requires"
