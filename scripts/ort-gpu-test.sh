#!/usr/bin/env bash
# ORT's own CUDA EP on epmem memory, against onnxruntime-gpu (GPU machine).
#
#   ORT_GPU_DIR=/path/to/unpacked/onnxruntime-gpu scripts/ort-gpu-test.sh [--probe]
#
# ORT_GPU_DIR holds the unpacked onnxruntime-gpu wheel (its onnxruntime/ package);
# it goes first on PYTHONPATH, before the preinstalled CPU wheel. torch is
# imported first everywhere so its CUDA 13 libraries are loaded. --probe only
# checks that onnxruntime-gpu with the CUDA EP is importable (exit 0) or not.
#
# Runs tests/ort/gpu/test_cuda_ep.py (Python) and tests/ort/gpu/ort_cuda_c_test.c
# (C, linked against that wheel's libonnxruntime) on a model from
# tests/ort/gpu/make_transformer.py; closing line "ort-gpu: N passed, N failed".
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
export EPM_DEVICE=${EPM_DEVICE:-cuda}
[ -n "${ORT_GPU_DIR:-}" ] && export PYTHONPATH=$ORT_GPU_DIR${PYTHONPATH:+:$PYTHONPATH}
PROBE='import torch, onnxruntime as o, os
assert "CUDAExecutionProvider" in o.get_available_providers(), o.get_available_providers()
print(os.path.join(os.path.dirname(o.__file__), "capi"), o.__version__)'
if ! probe=$("$PY" -c "$PROBE" 2>&1 | tail -1) || [ ! -d "${probe% *}" ]; then
  echo "onnxruntime-gpu is not importable (ORT_GPU_DIR=${ORT_GPU_DIR:-unset}): $probe"
  exit 1
fi
[ "${1:-}" = --probe ] && { echo "onnxruntime-gpu ${probe#* } at ${probe% *}"; exit 0; }
CAPI=${probe% *}

lib=${EPMEM_LIB:-}
for c in .carry/lib/libepmem.so target/release/libepmem.so; do
  [ -z "$lib" ] && [ -f "$c" ] && lib=$ROOT/$c
done
[ -n "$lib" ] || { echo "no libepmem.so (.carry/lib or target/release)"; exit 2; }
export EPMEM_LIB=$lib
WORK=$(mktemp -d "${TMPDIR:-/tmp}/epmem-ort-gpu.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
echo "== onnxruntime-gpu ${probe#* } ($CAPI), $EPMEM_LIB"

PASSED=0
FAILED=0
tally() {
  local line p f
  line=$(grep -Eo '[0-9]+ passed, [0-9]+ failed' "$1" | tail -1)
  if [ -z "$line" ]; then FAILED=$((FAILED + 1)); echo "  (no result line: counted as a failure)"; return; fi
  p=${line%% passed*}; f=${line#*passed, }; f=${f%% failed*}
  PASSED=$((PASSED + p)); FAILED=$((FAILED + f))
}

D=256
MODEL=$WORK/transformer.onnx
"$PY" tests/ort/gpu/make_transformer.py "$MODEL" --layers 2 --d-model $D --heads 4 --ffn 1024 || exit 2

MODEL=$MODEL D_MODEL=$D "$PY" -X faulthandler tests/ort/gpu/test_cuda_ep.py >"$WORK/py.log" 2>&1
cat "$WORK/py.log"; tally "$WORK/py.log"

so=$(ls "$CAPI"/libonnxruntime.so.1.* 2>/dev/null | head -1)
# ORT loads its provider libraries from the directory it was loaded from
# (the soname link here), so they are linked next to it.
mkdir -p "$WORK/lib" && ln -sf "$so" "$WORK/lib/libonnxruntime.so.1" &&
  for p in "$CAPI"/libonnxruntime_providers_*.so; do ln -sf "$p" "$WORK/lib/"; done
if gcc -std=c11 -O1 -g -Wall -Wextra -Werror tests/ort/gpu/ort_cuda_c_test.c -o "$WORK/ort_cuda_c_test" "$so" \
    -Wl,-rpath,"$WORK/lib" -lm >"$WORK/c.log" 2>&1; then
  # The CUDA EP's provider library and the CUDA 13 libraries torch brings.
  torchlib=$("$PY" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)
  nvlibs=$("$PY" -c 'import nvidia, os, glob; print(":".join(glob.glob(os.path.join(os.path.dirname(nvidia.__path__[0]), "nvidia", "*", "lib")) + glob.glob(os.path.join(nvidia.__path__[0], "cu*", "lib"))))' 2>/dev/null)
  LD_LIBRARY_PATH="$CAPI:${nvlibs:+$nvlibs:}${torchlib:+$torchlib:}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" \
    "$WORK/ort_cuda_c_test" "$EPMEM_LIB" "$MODEL" $D >>"$WORK/c.log" 2>&1
fi
cat "$WORK/c.log"; tally "$WORK/c.log"
echo "ort-gpu: $PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ] && [ "$PASSED" -gt 0 ]
