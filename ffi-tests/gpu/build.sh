#!/usr/bin/env bash
# Build the Q1–Q6 probes with nvcc against include/epmem.h and libepmem.so.
#
#   ffi-tests/gpu/build.sh [OUTDIR]        (default target/gpu-probes)
#
# The probes use the test machinery (epm_checksum_host), so they link the
# testing build, libepmem_testing.so: from $EPM_LIB_DIR, else
# .carry/lib-testing (scripts/gpu-pack.sh), else target/testing/release
# (make build-testing). Set NVCC_ARCH to override -arch=native. Run each
# binary on its own (one question per process): OUTDIR/q1_share_n8 ...
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-target/gpu-probes}
LIB=${EPM_LIB_DIR:-}
if [ -z "$LIB" ]; then
  if [ -f .carry/lib-testing/libepmem_testing.so ]; then LIB=.carry/lib-testing; else LIB=target/testing/release; fi
fi
[ -f "$LIB/libepmem_testing.so" ] || { echo "error: no $LIB/libepmem_testing.so (make build-testing first)" >&2; exit 2; }
LIB=$(cd "$LIB" && pwd)
mkdir -p "$OUT"
n=0
for src in ffi-tests/gpu/q*.cu; do
  name=$(basename "$src" .cu)
  nvcc -O2 -std=c++17 ${NVCC_ARCH:--arch=native} -Iinclude -Iffi-tests/gpu -o "$OUT/$name" "$src" \
    -L"$LIB" -lepmem_testing -lcuda -Xlinker -rpath -Xlinker "$LIB"
  n=$((n + 1))
done
echo "built $n probes in $OUT"
