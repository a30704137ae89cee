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
dest=$(.venv/bin/python -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('scorch_backend._C').origin))")
for lib in build/py/libscorch_ops.so build/py/_C.*.so; do
  if ! cmp -s "$lib" "$dest/$(basename "$lib")"; then
    cp "$lib" "$dest/.tmp.$$" && mv "$dest/.tmp.$$" "$dest/$(basename "$lib")"
  fi
done
