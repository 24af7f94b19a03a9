#!/usr/bin/env bash
# The GPU check of posenc.flex (docs/flex.md): on a machine with a CUDA GPU, set up as the README
# does (the pinned torch from PyPI is a CUDA build), build the Python package, run
# python/tests/test_flex.py with the flex side on the GPU (POSENC_DEVICE=cuda; the fused kernel and
# the fp64 reference stay on the CPU), then bench/flex.py --device cuda, which prints a table.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$POSENC_ROOT"
command -v nvidia-smi > /dev/null && nvidia-smi -L
posenc_packages main
posenc_install_dependencies
posenc_python_env
"$POSENC_PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'posenc: torch sees no CUDA GPU')"
posenc_configure_release "$POSENC_ROOT/build-gpu" -DPOSENC_BUILD_TESTS=OFF -DPOSENC_BUILD_BENCH=OFF -DPOSENC_BUILD_STUDY=OFF
posenc_build "$POSENC_ROOT/build-gpu" posenc_python
export PYTHONPATH="$POSENC_ROOT/build-gpu/python"
POSENC_DEVICE=cuda "$POSENC_PYTHON" -m pytest -q -p no:cacheprovider python/tests/test_flex.py
"$POSENC_PYTHON" bench/flex.py --device cuda
