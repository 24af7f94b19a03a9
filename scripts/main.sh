#!/usr/bin/env bash
# The main job: install what is missing, build the posenc command, run the tour of the encodings.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
posenc_install_dependencies
posenc_build "$POSENC_ROOT/build" posenc_cli -DCMAKE_BUILD_TYPE=Release
exec "$POSENC_ROOT/build/posenc" tour
