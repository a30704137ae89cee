#!/usr/bin/env bash
# Incremental rebuild for development, after scripts/setup.sh has built once: Ninja in build/py, then the two
# libraries copied where the editable install loads them. Serialized with other heavy jobs on this machine
# through a lock file (2 cores: never two builds at once).
set -euo pipefail
cd "$(dirname "$0")/.."
exec 9>/tmp/scorch-heavy.lock
flock 9
export CCACHE_DIR=${CCACHE_DIR:-$PWD/build/ccache}
ninja -C build/py "$@"
# cmake --install rewrites the build tree's RPATH to the installed one ($ORIGIN), as the wheel has it.
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cmake --install build/py --prefix "$site" >/dev/null
