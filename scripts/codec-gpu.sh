#!/usr/bin/env bash
# Issue 29's GPU checks and figures for the weight codec, on the GPU machine.
#
#   here:   scripts/gpu-pack.sh            (builds .carry/: the test binaries and bench_codec)
#   there:  scripts/codec-gpu.sh [bench_codec args, e.g. --mib 512]
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
step scripts/build-ptx.sh --check
for t in decode_is_bit_exact decode_bad_arguments_are_refused; do
  step one_test .carry/tests/device_conformance --exact "$t"
done
step one_test .carry/tests/epmem_lib --include-ignored --exact \
  device::cuda::tests::gpu_decode_kernel_is_bit_exact_and_refuses_bad_arguments
step .carry/bin/bench_codec --json "$OUT/bench_codec.json" "$@"
echo "codec-gpu: $fails step(s) failed; log $OUT/codec-gpu.log"
exit $fails
