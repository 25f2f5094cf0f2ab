#!/usr/bin/env bash
# Why does one offload cell decode slower than its floor on this machine? A
# diagnostic for docs/BENCHMARKS.md's "Small at 75% decodes at one of two
# speeds", in one GPU call (about 3 minutes for small at 75%).
#
#   here:   cargo build --release --lib, carried as .carry/lib/libepmem.so (scripts/gpu-pack.sh)
#   there:  scripts/offload-diag.sh [SHAPE] [PCT]        # default: small 75
#
# It runs, on torch's default stream, with the carried library:
#   1. scripts/probe_prefetch_depth.py: the defaults, prefetch depth 4 and
#      staged sources, each also timed with 2 and 5 ms of GPU spin added to
#      every step (a step the host bounds keeps its time; one the GPU bounds
#      grows by the pad), and offload's host time per acquire/release;
#   2. scripts/probe_offload_trace.py --trace --cuda-only: a trace of the GPU's
#      streams alone (copies, decodes, torch's kernels) and its analysis by
#      scripts/trace_offload.py.
# Everything goes to $OUT (default /tmp/epmem-diag) as three files: diag.log,
# depth.json and trace.tgz (the trace, gzipped, with the probe's JSON).
set -u
cd "$(dirname "$0")/.."
SHAPE=${1:-small}
PCT=${2:-75}
OUT=${OUT:-/tmp/epmem-diag}
mkdir -p "$OUT"
[ -f .carry/lib/libepmem.so ] || { echo "offload-diag: no .carry/lib/libepmem.so (scripts/gpu-pack.sh)" >&2; exit 2; }
export EPMEM_LIB=$PWD/.carry/lib/libepmem.so EPM_DEVICE=cuda LD_LIBRARY_PATH=$PWD/.carry/lib:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/diag.log
TR=$(mktemp -d)
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"
  date -u
} >"$LOG" 2>&1
rc=0
echo "== probe_prefetch_depth $SHAPE $PCT" >>"$LOG"
timeout "${STEP_TIMEOUT:-240}" python3 scripts/probe_prefetch_depth.py --shape "$SHAPE" --pcts "$PCT" \
  --depths 0,4 --sources registered,staged --pad-us 2000,5000 --json "$OUT/depth.json" >>"$LOG" 2>&1 || rc=1
echo "== probe_offload_trace $SHAPE $PCT --cuda-only" >>"$LOG"
timeout "${STEP_TIMEOUT:-240}" python3 scripts/probe_offload_trace.py "$SHAPE" "$PCT" --out "$TR" --trace --cuda-only \
  >>"$LOG" 2>&1 || rc=1
if [ -f "$TR/trace-$SHAPE-$PCT.json" ]; then
  python3 scripts/trace_offload.py "$TR/trace-$SHAPE-$PCT.json" >>"$LOG" 2>&1 || rc=1
  gzip -1 "$TR/trace-$SHAPE-$PCT.json"
fi
tar czf "$OUT/trace.tgz" -C "$TR" . && rm -rf "$TR"
echo "offload-diag: rc=$rc" >>"$LOG"
cat "$LOG"
exit $rc
