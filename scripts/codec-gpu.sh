#!/usr/bin/env bash
# The GPU checks and figures for the weight codec, on the GPU machine.
#
#   here:   scripts/gpu-pack.sh            (builds .carry/: the test binaries and bench_codec)
#   there:  scripts/codec-gpu.sh [bench_codec args, e.g. --mib 512]
#           scripts/codec-gpu.sh --variants [bench_codec args]
#
# (a) scripts/build-ptx.sh --check: the committed src/device/cuda/codec.ptx is
#     exactly what this machine's nvcc makes of codec.cu;
# (b) the decode conformance checks on CUDA, each in its own process (every
#     bf16/fp16 bit pattern at k=1..4, weight-like tensors of odd lengths,
#     guard bytes behind the destination, bad arguments refused), and the
#     CUDA device's own decode test;
# (c) bench_codec: every bit pattern and the three distributions of 256 MiB
#     bf16 and fp16 bit-exact through the kernel, its output GB/s (events,
#     median) beside a D2D copy, compressed/raw ratios, encoder GB/s on this
#     host's cores. JSON in $OUT/bench_codec.json.
#
# --variants, for a changed codec.cu whose PTX is not committed yet:
# (a') scripts/build-ptx.sh writes codec.ptx from codec.cu (copied to
#     $OUT/codec.ptx, to be committed) instead of checking it;
# (b), (c) as above, run by the binaries' embedded (committed) PTX, with
#     bench_codec --dump writing every case to $DUMP;
# (d) scripts/codec-kernel-bench.cu, built here with nvcc, loads the PTX of
#     each variant (v1: scripts/codec-kernel-v1.cu, the baseline; new: the
#     codec.ptx just built; new-min8 and new-min4: codec.cu with
#     __launch_bounds__ minimum blocks per SM; new-x1: codec.cu with one
#     16-value slice per thread, 256-thread blocks), checks each bit-exact on
#     every dumped case (all bit patterns, the distributions) and prints its
#     GB/s.
# Exit status: the number of failed steps.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/epmem-codec}
mkdir -p "$OUT"
export EPM_DEVICE=${EPM_DEVICE:-cuda}
[ -d .carry/tests ] || { echo "codec-gpu: no .carry/: run scripts/gpu-pack.sh first and carry .carry" >&2; exit 2; }
fails=0
step() {
  echo "== $*"
  "$@" 2>&1 | tee -a "$OUT/codec-gpu.log" | tail -40
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "FAILED (rc=$rc): $*"; fails=$((fails + 1)); }
}
# A test filter that matches nothing passes with "0 passed": require exactly one.
one_test() {
  "$@" 2>&1 | tee /dev/stderr | grep '^test result: ok. 1 passed' >/dev/null
}
variants=0
[ "${1:-}" = "--variants" ] && { variants=1; shift; }
if [ $variants = 1 ]; then
  step scripts/build-ptx.sh
  cp src/device/cuda/codec.ptx "$OUT/codec.ptx"
else
  step scripts/build-ptx.sh --check
fi
for t in decode_is_bit_exact decode_bad_arguments_are_refused; do
  step one_test .carry/tests/device_conformance --exact "$t"
done
step one_test .carry/tests/epmem_lib --include-ignored --exact \
  device::cuda::tests::gpu_decode_kernel_is_bit_exact_and_refuses_bad_arguments
if [ $variants = 1 ]; then
  DUMP=${DUMP:-/tmp/epmem-codec-dump}
  BUILD=$(mktemp -d)
  rm -rf "$DUMP"
  step .carry/bin/bench_codec --json "$OUT/bench_codec.json" --dump "$DUMP" "$@"
  NVCC=${NVCC:-nvcc}
  ptx() { "$NVCC" -ptx -arch="${PTX_ARCH:-compute_75}" -O3 -std=c++17 -o "$@"; }
  stubs=$(dirname "$(command -v "$NVCC")")/../lib64/stubs
  step ptx "$BUILD/v1.ptx" scripts/codec-kernel-v1.cu
  step ptx "$BUILD/new-min8.ptx" -DEPM_MIN_BLOCKS=8 src/device/cuda/codec.cu
  step ptx "$BUILD/new-min4.ptx" -DEPM_MIN_BLOCKS=4 src/device/cuda/codec.cu
  step ptx "$BUILD/new-x1.ptx" -DEPM_SLICES=1 src/device/cuda/codec.cu
  step "$NVCC" -O2 -std=c++17 -o "$BUILD/codec-kernel-bench" scripts/codec-kernel-bench.cu -L"$stubs" -lcuda
  step "$BUILD/codec-kernel-bench" "$DUMP" 9 v1="$BUILD/v1.ptx" new=src/device/cuda/codec.ptx@128 \
    new-min8="$BUILD/new-min8.ptx" new-min4="$BUILD/new-min4.ptx" new-x1="$BUILD/new-x1.ptx@256"
  rm -rf "$DUMP" "$BUILD"
else
  step .carry/bin/bench_codec --json "$OUT/bench_codec.json" "$@"
fi
echo "codec-gpu: $fails step(s) failed; log $OUT/codec-gpu.log"
exit $fails
