#!/usr/bin/env bash
# The Python package's tests (tests/python/) against the built wheel, installed.
#
#   scripts/python-test.sh               # CI: venv .venv/torch (torch, numpy, transformers from PyPI, kept
#                                        # across runs), `pip wheel .`, install it, run the tests; then
#                                        # epmem.kvcache's tests again with the newest transformers
#   scripts/python-test.sh --no-install  # GPU machine: python3 as it is (its torch); the wheel
#                                        # is built from .carry/lib/libepmem.so by scripts/build_wheel.py
#                                        # (no Rust and no PyPI there)
#
# Environment: EPM_DEVICE (host in CI, cuda on the GPU machine), PYTHON (default
# python3), EPMEM_LIB (the library to bundle; default target/release, else .carry/lib),
# EPMEM_TORCH_VENV (default .venv/torch). Closing line: "python: N passed, N failed, N skipped".
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
INSTALL=1
for a in "$@"; do
  case "$a" in
    --no-install) INSTALL=0 ;;
    *) echo "unknown argument $a" >&2; exit 2 ;;
  esac
done
lib=${EPMEM_LIB:-}
if [ -z "$lib" ]; then
  for c in target/release/libepmem.so .carry/lib/libepmem.so; do
    [ -f "$c" ] && { lib=$c; break; }
  done
fi
[ -n "$lib" ] && [ -f "$lib" ] || { echo "python-test: no libepmem.so (cargo build --release, or carry .carry/lib)" >&2; exit 2; }

if [ $INSTALL = 1 ]; then
  venv=${EPMEM_TORCH_VENV:-$ROOT/.venv/torch}
  PYTHON=$PY scripts/torch-venv.sh "$venv" || exit 2
  PY=$venv/bin/python
  # The newest transformers too, for epmem.kvcache (it must hand its Cache over the
  # way each supports: `cache=` from 5.24, `past_key_values=` before): a second venv
  # that sees the first's packages through a .pth file, so only transformers (and
  # whatever newer dependency it needs) is installed there, ~15 MB, once.
  TF_NEWEST=5.24.0
  tfvenv=$venv-transformers-$TF_NEWEST
  if ! "$tfvenv/bin/python" -c "import transformers, sys; sys.exit(transformers.__version__ != '$TF_NEWEST')" 2>/dev/null; then
    echo "python-test: installing transformers $TF_NEWEST from PyPI into $tfvenv (once)"
    { rm -rf "$tfvenv" && "$PY" -m venv "$tfvenv" &&
      "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
        "$("$tfvenv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/epmem-torch-venv.pth" &&
      "$tfvenv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check "transformers==$TF_NEWEST"; } ||
      { echo "python-test: could not make $tfvenv with transformers $TF_NEWEST" >&2; exit 2; }
  fi
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/epmem-py.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [ $INSTALL = 1 ]; then
  # The standard build (pyproject.toml: setuptools-rust runs cargo, installed
  # from PyPI into pip's isolated build environment), as `pip wheel .` does it.
  "$PY" -m pip wheel -q --no-deps --disable-pip-version-check -w "$WORK/wheels" "$ROOT" >"$WORK/build.log" 2>&1 ||
    { tail -40 "$WORK/build.log"; echo "python-test: pip wheel . failed" >&2; exit 2; }
  whl=$(ls "$WORK"/wheels/epmem-*.whl) || { echo "python-test: pip wheel . made no epmem wheel" >&2; exit 2; }
else
  # No Rust here: bundle the library already built (.carry/lib) the minimal way.
  whl=$("$PY" scripts/build_wheel.py --lib "$lib" --out "$WORK/wheels" | tail -1) || { echo "python-test: wheel build failed" >&2; exit 2; }
fi
echo "python-test: $(basename "$whl") ($(du -k "$whl" | cut -f1) KiB), $("$PY" -c 'import sys; print(sys.version.split()[0])'), torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none), EPM_DEVICE=${EPM_DEVICE:-auto}"
# Install the wheel where only these tests see it (no network, no deps).
if ! "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-index --target "$WORK/site" "$whl" 2>"$WORK/pip.log"; then
  echo "python-test: pip cannot install here ($(tail -1 "$WORK/pip.log")); unpacking the wheel instead"
  "$PY" -m zipfile -e "$whl" "$WORK/site" || exit 2
fi
[ -f "$WORK/site/epmem/lib/libepmem.so" ] || { echo "python-test: the wheel has no epmem/lib/libepmem.so" >&2; exit 1; }
env -u EPMEM_LIB EPMEM_USE_INSTALLED=1 PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" "$PY" tests/python/run.py
rc=$?
if [ $INSTALL = 1 ]; then
  echo "python-test: epmem.kvcache again with transformers $TF_NEWEST (FutureWarning is an error)"
  env -u EPMEM_LIB EPMEM_USE_INSTALLED=1 PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" \
    "$tfvenv/bin/python" -W error::FutureWarning tests/python/run.py test_kvcache. test_kvcache_cache_kwarg. \
    test_kv_namespace. || rc=1
fi
# include/epmem_testing.h's functions exist only in the testing build: the
# binding tests run once more against it (the package loads EPMEM_LIB
# instead of the bundled library), where one is built or carried.
tlib=${EPMEM_TESTING_LIB:-}
if [ -z "$tlib" ]; then
  for c in target/testing/release/libepmem_testing.so .carry/lib-testing/libepmem_testing.so; do
    [ -f "$c" ] && { tlib=$c; break; }
  done
fi
if [ -n "$tlib" ] && [ -f "$tlib" ]; then
  echo "python-test: test_binding and the ordered arena's gate test again against the testing library $tlib"
  case "$tlib" in /*) ;; *) tlib=$ROOT/$tlib ;; esac
  EPMEM_LIB="$tlib" EPMEM_USE_INSTALLED=1 PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" tests/python/run.py test_binding. test_torch_allocator.OrderedArenaTest || rc=1
else
  echo "python-test: no testing library (make build-testing): epmem_testing.h tests skipped"
fi
exit $rc
