#!/usr/bin/env bash
# The sanitizer run (docs/cache.md): the core and the C++ tests built with -fsanitize=address,undefined in
# build/asan (SCORCH_SANITIZE=ON, no torch), then ctest with SCORCH_SANITIZE=1 so the kernels the JIT compiles
# are sanitized too. Then a fuzz subset through Python with the ASan runtime preloaded: there the generated
# kernels are sanitized, the installed op library is not (see docs/cache.md). Any ASan or UBSan report fails
# the run.
#
#   scripts/sanitize.sh               # C++ tests, then SCORCH_FUZZ_CASES (default 100) fuzz cases per kind
#   scripts/sanitize.sh --cpp-only    # C++ tests only
#
# Serialized with other heavy jobs on this machine through /tmp/scorch-heavy.lock, like dev-build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 9>/tmp/scorch-heavy.lock
flock 9

export CCACHE_DIR=${CCACHE_DIR:-$PWD/build/ccache}
export SCORCH_SANITIZE=1
# A kernel cache of its own: sanitized kernels have keys of their own anyway, this keeps the run self-contained.
export SCORCH_CACHE_DIR=${SCORCH_SANITIZE_CACHE_DIR:-$PWD/build/asan/kernel-cache}
# UBSan only prints by default; make every report fatal, with a stack.
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1}

cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSCORCH_SANITIZE=ON \
  -DSCORCH_BUILD_TORCH=OFF -DSCORCH_BUILD_TESTS=ON >/dev/null
ninja -C build/asan
echo "== ctest under AddressSanitizer + UBSan (SCORCH_SANITIZE=1: kernels sanitized too)"
ctest --test-dir build/asan --output-on-failure -j1

if [[ "${1:-}" == "--cpp-only" ]]; then exit 0; fi

# Python: preload the ASan runtime (it must come first) so sanitized kernels can be loaded into the
# interpreter, and libstdc++ after it: the interpreter does not link libstdc++, and ASan, finding no
# __cxa_throw to intercept at start-up, would abort at the first C++ exception. Leaks are not checked there
# (CPython and torch keep memory until exit by design). --capture=sys leaves file descriptor 2 alone, so a
# sanitizer report is printed, not swallowed by pytest's capture when the process halts.
cxx=${CXX:-c++}
libasan=$($cxx -print-file-name=libasan.so)
libstdcxx=$($cxx -print-file-name=libstdc++.so)
[[ -f "$libasan" && -f "$libstdcxx" ]] || { echo "no libasan.so / libstdc++.so from $cxx: cannot run the Python part" >&2; exit 1; }
echo "== fuzz subset through Python with LD_PRELOAD=$libasan $libstdcxx"
LD_PRELOAD="$libasan $libstdcxx" ASAN_OPTIONS=halt_on_error=1:detect_leaks=0 \
  SCORCH_FUZZ_CASES=${SCORCH_FUZZ_CASES:-100} \
  .venv/bin/python -m pytest tests/python/test_fuzz.py -q -x -p no:cacheprovider --capture=sys
