#!/usr/bin/env bash
# Incremental rebuild for development, after scripts/setup.sh has built once: Ninja in build/py, then the two
# libraries copied where the editable install loads them. Serialized with other heavy jobs on this machine
# through a lock file (2 cores: never two builds at once).
set -euo pipefail
cd "$(dirname "$0")/.."
exec 9>/tmp/scorch-heavy.lock
if ! flock -n 9; then
  # Say who holds it: a caller that wrapped this script in `flock /tmp/scorch-heavy.lock` waits here forever.
  holders=$(fuser /tmp/scorch-heavy.lock 2>/dev/null | tr -s ' ' || true)
  echo "dev-build: waiting for /tmp/scorch-heavy.lock (open in processes:${holders:- unknown});" \
       "do not run this script under flock on that lock, it takes the lock itself" >&2
  flock 9
fi
export CCACHE_DIR=${CCACHE_DIR:-$PWD/build/ccache}
ninja -C build/py "$@"
# cmake --install rewrites the build tree's RPATH to the installed one ($ORIGIN), as the wheel has it.
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cmake --install build/py --prefix "$site" >/dev/null
