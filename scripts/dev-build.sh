#!/usr/bin/env bash
# Incremental rebuild for development, after scripts/setup.sh has built once: Ninja in build/py, then the two
# libraries copied where the editable install loads them. Serialized with other heavy jobs on this machine
# through a lock file (2 cores: never two builds at once).
set -euo pipefail
cd "$(dirname "$0")/.."
lock=${SCORCH_HEAVY_LOCK:-/tmp/scorch-heavy.lock}
exec 9>"$lock"
if ! flock -n 9; then
  # Say who holds it: a caller that wrapped this script in `flock /tmp/scorch-heavy.lock` waits here forever.
  holders=$(fuser "$lock" 2>/dev/null | tr -s ' ' || true)
  # Held by one of our own ancestors (the script run under flock on this lock): waiting would never end.
  pid=$PPID
  while [ "${pid:-0}" -gt 1 ]; do
    if [[ " $holders " == *" $pid "* ]]; then
      echo "dev-build: $lock is held by process $pid, which started this script: it takes" \
           "the lock itself, do not run it under flock on that lock" >&2
      exit 2
    fi
    pid=$(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
  done
  echo "dev-build: waiting for $lock (open in processes:${holders:- unknown});" \
       "do not run this script under flock on that lock, it takes the lock itself" >&2
  flock 9
fi
export CCACHE_DIR=${CCACHE_DIR:-$PWD/build/ccache}
ninja -C build/py "$@"
# cmake --install rewrites the build tree's RPATH to the installed one ($ORIGIN), as the wheel has it.
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cmake --install build/py --prefix "$site" >/dev/null
