#!/usr/bin/env bash
# One entry point for a fresh machine or a warm one:
#   scripts/setup.sh quickstart   install what is missing, build, run examples/quickstart.py
#   scripts/setup.sh test         install what is missing, build with the C++ tests, run ctest then pytest
# Every step is skipped or incremental when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
what=${1:-quickstart}
shift || true

log() { printf '\033[1m[scorch]\033[0m %s\n' "$*"; }

# 1. System packages (Debian): compiler, CMake, Ninja, GoogleTest, fmt, ccache.
apt_pkgs=(g++ cmake ninja-build libgtest-dev libfmt-dev ccache python3-venv)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The virtual environment, refreshed when requirements-dev.txt changes.
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$py" -m venv .venv
fi
stamp=.venv/.scorch-requirements
if ! cmp -s requirements-dev.txt "$stamp"; then
  log "installing Python packages (torch==2.13.0, numpy, scipy, pytest, scikit-build-core)"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  cp requirements-dev.txt "$stamp"
fi
# The test extra's interop libraries (pyproject.toml [test]): torch_geometric without its optional compiled
# extensions (it declares no torch dependency, so pip leaves torch alone), STen without its declared
# dependencies (it imports only torch, numpy and scipy; its list would pull transformers, notebook, ...).
# transformers: the Hugging Face BERT of the TorchScript rewriting tests (it declares no torch dependency).
if [ "$what" = test ] && ! .venv/bin/python -c "import torch_geometric, sten, transformers" >/dev/null 2>&1; then
  log "installing the test extras (torch_geometric, transformers, sten)"
  .venv/bin/python -m pip install -q torch_geometric transformers && .venv/bin/python -m pip install -q --no-deps sten
fi

# 3. Build and install the package in editable form (incremental: CMake + Ninja + ccache in build/py).
export SCORCH_BUILD_TESTS=ON
export CCACHE_DIR=${CCACHE_DIR:-$root/build/ccache}
if [ ! -f build/py/build.ninja ] || [ -n "$(find csrc tests/cpp CMakeLists.txt pyproject.toml -newer build/py/.scorch-installed 2>/dev/null | head -1)" ] \
   || [ ! -f build/py/.scorch-installed ]; then
  log "building"
  .venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .
  touch build/py/.scorch-installed
fi

case "$what" in
  quickstart)
    log "running examples/quickstart.py"
    .venv/bin/python examples/quickstart.py "$@"
    ;;
  test)
    log "C++ tests (ctest)"
    ctest --test-dir build/py --output-on-failure -j2
    log "Python tests (pytest)"
    .venv/bin/python -m pytest tests/python -q "$@"
    ;;
  *)
    echo "usage: scripts/setup.sh quickstart|test [args]" >&2
    exit 2
    ;;
esac
