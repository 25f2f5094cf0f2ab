#!/usr/bin/env bash
# Compile the CUDA C kernels to the PTX committed beside them (JIT-loaded by
# the driver at first use, so building epmem needs no CUDA toolkit):
#   src/device/cuda/codec.cu -> src/device/cuda/codec.ptx
#
#   scripts/build-ptx.sh            write the .ptx files
#   scripts/build-ptx.sh --check    compile to a temporary file and diff against
#                                   the committed .ptx (exit 1 on a difference)
#
# NVCC (default: nvcc on PATH) must be the toolkit matching the oldest driver
# the PTX must load on: a driver JIT-compiles PTX of its own ISA version or
# older, and each nvcc writes its own version. The committed PTX is made with
# nvcc 13.0 (PTX ISA 9.0) for the H200 machine's driver 580 (CUDA 13.0).
#
# Target compute_75: the lowest nvcc 13 still compiles for (it dropped
# sm_50–72); the kernel needs nothing newer (shuffles, 16-byte loads), and the
# driver JIT-compiles it for the GPU at hand (sm_90 on an H200).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
ARCH=${PTX_ARCH:-compute_75}
check=0
[ "${1:-}" = "--check" ] && check=1
status=0
for cu in src/device/cuda/codec.cu; do
  ptx=${cu%.cu}.ptx
  out=$ptx
  [ $check = 1 ] && out=$(mktemp --suffix=.ptx)
  # -lineinfo off and no -G: the PTX must not embed paths or debug sections
  # that differ between machines.
  "$NVCC" -ptx -arch="$ARCH" -O3 -std=c++17 -o "$out" "$cu"
  if [ $check = 1 ]; then
    if diff -u "$ptx" "$out" >/dev/null; then
      echo "build-ptx: $ptx matches what $("$NVCC" --version | tail -1) makes of $cu"
    else
      echo "build-ptx: $ptx DIFFERS from what $("$NVCC" --version | tail -1) makes of $cu:" >&2
      diff -u "$ptx" "$out" | head -40 >&2 || true
      status=1
    fi
    rm -f "$out"
  else
    echo "build-ptx: wrote $ptx ($(grep -m1 '^\.version' "$ptx"), $(grep -m1 '^\.target' "$ptx"))"
  fi
done
exit $status
