#!/usr/bin/env bash
# Prove epmem on a CUDA GPU from binaries built elsewhere (the GPU machine has
# no Rust toolchain and no network).
#
#   here:   scripts/gpu-pack.sh                  # builds .carry/ (lib, test and bench binaries)
#   there:  scripts/gpu-check.sh [--bench] [--sanitize] [--only REGEX]
#
# It runs, with EPM_DEVICE=cuda: every Rust integration-test binary (the device
# conformance suite, staging, residency, kv, ...), the C tests in ffi-tests/
# (compiled there with gcc), the C examples, the Q1–Q5 probes (nvcc), the ONNX
# Runtime tests against the machine's onnxruntime, and with --bench the
# benchmarks. Logs go to $OUT (default /tmp/epmem-gpu); a table is printed last.
# STEP_TIMEOUT (seconds, default 900) bounds each step.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/epmem-gpu}
LOGS=$OUT/logs
mkdir -p "$LOGS"
BENCH=0
SANITIZE=0
ONLY=.
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) BENCH=1 ;;
    --sanitize) SANITIZE=1 ;;
    --only) ONLY=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
export EPM_DEVICE=${EPM_DEVICE:-cuda}
export LD_LIBRARY_PATH=$ROOT/.carry/lib:${LD_LIBRARY_PATH:-}
[ -f .carry/lib/libepmem.so ] || { echo "no .carry/lib/libepmem.so: run scripts/gpu-pack.sh first and carry .carry" >&2; exit 2; }
# Programs linked with -lepmem record its SONAME, libepmem.so.0 (a carried tree may have lost the link).
[ -e .carry/lib/libepmem.so.0 ] || ln -sf libepmem.so .carry/lib/libepmem.so.0

ROWS=()
FAILS=0
# step NAME SUMMARY_REGEX CMD...: run CMD, log to $LOGS/NAME.log, keep a row.
step() {
  local name=$1 pat=$2; shift 2
  echo "$name" | grep -Eq "$ONLY" || return 0
  local t0=$SECONDS rc
  echo "== $name: $*" >&2
  timeout "${STEP_TIMEOUT:-900}" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  local summary
  summary=$(grep -E "$pat" "$LOGS/$name.log" | tail -1 | cut -c1-90)
  if [ $rc -eq 0 ]; then ROWS+=("PASS|$name|$((SECONDS - t0))s|$summary")
  else ROWS+=("FAIL rc=$rc|$name|$((SECONDS - t0))s|$summary"); FAILS=$((FAILS + 1)); tail -30 "$LOGS/$name.log" >&2; fi
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader; nvcc --version | tail -1; python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__)'; } >"$LOGS/machine.txt" 2>&1
cat "$LOGS/machine.txt" >&2

# 1. Rust integration tests (conformance suite first).
declare -A SEEN_TEST
for t in .carry/tests/device_conformance .carry/tests/*; do
  [ -x "$t" ] || continue
  n=$(basename "$t")
  case "$n" in
    # Source- and build-tree checks, not device checks.
    header | misuse_coverage | *_bench_smoke | compile_fail | unsafe_rule) continue ;;
    # The lib's unit tests: only the CUDA-specific ones, which are #[ignore]d without a GPU.
    epmem_lib) step rust-lib-cuda '^test result' "$t" device::cuda --include-ignored --skip fake_driver --test-threads=1; continue ;;
  esac
  [ "${SEEN_TEST[$n]:-}" ] && continue
  SEEN_TEST[$n]=1
  # --include-ignored: an integration test that applies only to a GPU is
  # #[ignore]d (reported as ignored on the host device) and runs here.
  step "rust-$n" '^test result' "$t" --include-ignored --test-threads=1
done

# 2. C tests, compiled here against the header and the carried library.
CFLAGS="-std=c11 -O2 -g -Wall -Wextra -Werror -Iinclude"
CBIN=/tmp/epmem-cbin; mkdir -p "$CBIN"
for c in ffi-tests/*.c; do
  [ -f "$c" ] || continue
  n=$(basename "$c" .c)
  # The C tests link the testing build (include/epmem_testing.h), a library of its own name.
  step "c-$n" 'passed|failed|PASS|FAIL' sh -c "gcc $CFLAGS '$c' -o '$CBIN/$n' -L.carry/lib-testing -lepmem_testing -lpthread && LD_LIBRARY_PATH='$ROOT/.carry/lib-testing':\$LD_LIBRARY_PATH '$CBIN/$n'"
done

# 2a. With --sanitize, the same C tests again under compute-sanitizer's memcheck
# (device-side invalid accesses, device allocations leaked at exit): any report
# fails the step. API-error reports are off: the misuse tests provoke failing
# driver calls on purpose (an allocation past the GPU's memory, a host pointer
# given as a device range) and check that each comes back as a status; with
# them on, the sanitizer reports exactly those two calls on the H200.
# The codec's C tests make no CUDA call; without --require-cuda-init no the
# sanitizer fails them for that ("terminated before first instrumented API call").
if [ $SANITIZE = 1 ] && command -v compute-sanitizer >/dev/null; then
  SAN_INIT=()
  compute-sanitizer --help 2>/dev/null | grep -q -- --require-cuda-init && SAN_INIT=(--require-cuda-init no)
  for c in ffi-tests/*.c; do
    n=$(basename "$c" .c)
    [ -x "$CBIN/$n" ] || continue
    step "san-$n" 'ERROR SUMMARY|passed|failed' env LD_LIBRARY_PATH="$ROOT/.carry/lib-testing:$LD_LIBRARY_PATH" \
      compute-sanitizer --tool memcheck --leak-check full --report-api-errors no "${SAN_INIT[@]}" --error-exitcode 99 "$CBIN/$n"
  done
fi

# 3. Examples (the offload demo runs on the GPU by default when there is one),
# at a size that means something on an H200: 48 x 64 MiB layers, half resident.
declare -A EXAMPLE_ARGS=([offload_decode]="--layer-kib 65536 --steps 16")
for c in examples-c/*.c; do
  [ -f "$c" ] || continue
  n=$(basename "$c" .c)
  step "example-$n" 'tok|GB/s|name|device' sh -c "gcc $CFLAGS '$c' -o '$CBIN/$n' -L.carry/lib -lepmem -lpthread -lm && '$CBIN/$n' ${EXAMPLE_ARGS[$n]:-}"
done

# 4. The Q1–Q6 probes (one question per binary: a poisoned context stays in its process).
if [ -x ffi-tests/gpu/build.sh ]; then
  step gpu-probes-build 'error|built' ffi-tests/gpu/build.sh "$OUT/probes"
  for p in "$OUT"/probes/q*; do
    [ -x "$p" ] && step "probe-$(basename "$p")" 'PASS|FAIL' "$p"
  done
fi

# 5. ONNX Runtime plugin EP against the machine's onnxruntime.
[ -x scripts/ort-test.sh ] && step ort 'passed|failed|PASS|FAIL' scripts/ort-test.sh --no-install

# 5a. The Python package: the wheel built from .carry/lib (no Rust needed), installed
# to a temp dir, and tests/python/ with EPM_DEVICE=cuda on the machine's python3/torch:
# the binding, epmem.torch (offload on CUDA, default and non-default streams, zero-copy
# tensors), the transformers Llama test (resident vs offload at 50%, greedy and
# generate()), and bench_torch.py --quick.
[ -x scripts/python-test.sh ] && step python 'passed|failed' env EPMEM_LIB="$ROOT/.carry/lib/libepmem.so" scripts/python-test.sh --no-install

# 5b. KV batch: batched SDPA over the batch view and CUDA graph replay through
# torch and the epmem package (tests/gpu/kv_batch_attention.py), when torch imports.
if python3 -c 'import torch' >/dev/null 2>&1; then
  step py-kv_batch_attention 'passed|failed' env PYTHONPATH="$ROOT/python" EPMEM_LIB="$ROOT/.carry/lib/libepmem.so" python3 tests/gpu/kv_batch_attention.py
  [ $BENCH = 1 ] && step py-bench_kv_batch 'target|ratio' env PYTHONPATH="$ROOT/python" EPMEM_LIB="$ROOT/.carry/lib/libepmem.so" python3 scripts/bench_kv_batch.py --json "$OUT/bench_kv_batch.json"
fi

# 5c. ORT's own CUDA EP on epmem memory: needs onnxruntime-gpu (unpacked in
# $ORT_GPU_DIR, put first on PYTHONPATH by the script); with --bench also the
# allocator benchmark against ORT's BFC arena.
if [ -x scripts/ort-gpu-test.sh ] && echo ort-gpu | grep -Eq "$ONLY"; then
  if probe=$(scripts/ort-gpu-test.sh --probe 2>&1); then
    step ort-gpu 'passed|failed|PASS|FAIL' scripts/ort-gpu-test.sh
    [ $BENCH = 1 ] && step bench-ort 'TARGET|FLOOR|bit-identical' env PYTHONPATH="${ORT_GPU_DIR:+$ORT_GPU_DIR:}${PYTHONPATH:-}" \
      python3 scripts/bench_ort.py --out "$OUT/bench_ort"
  else
    echo "== ort-gpu: not run: $probe" >&2
    echo "ort-gpu: not run ($probe)" >"$OUT/ort-gpu-not-run.txt"
  fi
fi

# 6. Benchmarks.
if [ $BENCH = 1 ]; then
  for b in .carry/bin/bench_*; do
    [ -x "$b" ] || continue
    n=$(basename "$b")
    step "$n" 'target|TARGET|peak' "$b" --json "$OUT/$n.json"
  done
  # The end-to-end PyTorch benchmark (docs/PYTHON.md): JSON, table and PNG in $OUT.
  [ -f scripts/bench_torch.py ] && step bench_torch 'tokens identical|TOKENS DIFFER' \
    env EPMEM_LIB="$ROOT/.carry/lib/libepmem.so" python3 scripts/bench_torch.py --json "$OUT/bench_torch.json"
  # Prefix sharing inside a transformers Llama (docs/KV.md, worked example): 8 requests
  # sharing a 1,040-token system prompt; tokens vs DynamicCache, bytes, capacity, tok/s.
  [ -f scripts/bench_kvcache.py ] && step bench_kvcache 'tokens identical|TOKENS DIFFER' \
    env EPMEM_LIB="$ROOT/.carry/lib/libepmem.so" PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" \
    python3 scripts/bench_kvcache.py --json "$OUT/bench_kvcache.json"
  # epmem as PyTorch's allocator against PyTorch's, with and without expandable
  # segments (docs/ALLOCATOR.md): tok/s, reserved/requested, driver calls, tokens.
  [ -f scripts/bench_torch_alloc.py ] && step bench_torch_alloc 'Targets|error' \
    env EPMEM_LIB="$ROOT/.carry/lib/libepmem.so" PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" \
    python3 scripts/bench_torch_alloc.py --out-json "$OUT/bench_torch_alloc.json" --out-md "$OUT/bench_torch_alloc.md"
fi

# The two-device tests (rust-multi_device, c-test_multi_device) and
# bench_multi pass without running on a one-GPU machine; say so in the summary.
SKIPS=()
for f in "$LOGS"/*.log; do
  l=$(grep -m1 -E 'skipped: 1 device|not run: 1 GPU' "$f" 2>/dev/null) && SKIPS+=("$(basename "$f" .log): ${l:0:90}")
done

# One archive of the logs: only a few files come back from a GPU machine.
tar -C "$OUT" -czf "$OUT/logs.tgz" logs 2>/dev/null && rm -rf "$LOGS"
{
  echo
  echo "| result | step | time | last summary line |"
  echo "|---|---|---|---|"
  for r in "${ROWS[@]}"; do echo "| ${r//|/ | } |"; done
  echo
  echo "$(( ${#ROWS[@]} - FAILS )) passed, $FAILS failed"
  for k in "${SKIPS[@]}"; do echo "not run on this machine (1 GPU): $k"; done
} | tee "$OUT/summary.md"
[ $FAILS -eq 0 ]
