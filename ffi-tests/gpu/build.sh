#!/usr/bin/env bash
# Build the Q1–Q5 probes with nvcc against include/epmem.h and libepmem.so.
#
#   ffi-tests/gpu/build.sh [OUTDIR]        (default target/gpu-probes)
#
# The library comes from $EPM_LIB_DIR, else .carry/lib (scripts/gpu-pack.sh),
# else target/release. Set NVCC_ARCH to override -arch=native. Run each
# binary on its own (one question per process): OUTDIR/q1_share_n8 ...
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-target/gpu-probes}
LIB=${EPM_LIB_DIR:-}
if [ -z "$LIB" ]; then
  if [ -f .carry/lib/libepmem.so ]; then LIB=.carry/lib; else LIB=target/release; fi
fi
[ -f "$LIB/libepmem.so" ] || { echo "error: no $LIB/libepmem.so (cargo build --release first)" >&2; exit 2; }
LIB=$(cd "$LIB" && pwd)
mkdir -p "$OUT"
n=0
for src in ffi-tests/gpu/q*.cu; do
  name=$(basename "$src" .cu)
  nvcc -O2 -std=c++17 ${NVCC_ARCH:--arch=native} -Iinclude -Iffi-tests/gpu -o "$OUT/$name" "$src" \
    -L"$LIB" -lepmem -lcuda -Xlinker -rpath -Xlinker "$LIB"
  n=$((n + 1))
done
echo "built $n probes in $OUT"
