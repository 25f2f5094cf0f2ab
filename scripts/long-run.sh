#!/usr/bin/env bash
# Long runs: driver allocations stay flat, the ledger does not
# drift, and every acquired weight is bit-exact, over
#   (a) 10,000 decode steps of examples-c/offload_decode.c (a device checksum
#       of every acquired layer, compared with the host's), run after a
#       100-step run so the driver-allocation counts of the two can be compared;
#   (b) tools/src/bin/kv_churn: 20,000 prefix-sharing requests (commit_shared_prefix,
#       copy-on-write, append, destroy, prefix rotation), checking the ledger
#       against the live granules and the driver counts at checkpoints.
# Each prints a one-line verdict; the script exits non-zero if either fails.
#
#   on the H200 (after scripts/gpu-pack.sh, .carry carried; ~1-2 min):
#       EPM_DEVICE=cuda scripts/long-run.sh
#   here, on the host device (seconds):
#       scripts/long-run.sh --quick
#
# Uses prebuilt binaries: target/release/ (cargo build --release --workspace) when present,
# else .carry/bin/kv_churn and .carry/lib/libepmem.so (scripts/gpu-pack.sh). The demo is compiled
# with gcc against that library. Logs go to $OUT (default /tmp/epmem-long).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/epmem-long}
mkdir -p "$OUT"
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1

# A fresh build beats a carried one (the GPU machine has only .carry/).
if [ -f target/release/libepmem.so ]; then LIB=$ROOT/target/release; else LIB=$ROOT/.carry/lib; fi
if [ -x target/release/kv_churn ]; then CHURN=$ROOT/target/release/kv_churn; else CHURN=$ROOT/.carry/bin/kv_churn; fi
[ -f "$LIB/libepmem.so" ] || { echo "long-run: no libepmem.so in .carry/lib or target/release" >&2; exit 2; }
# Programs linked with -lepmem need the SONAME link (a carried tree may have lost it).
[ -e "$LIB/libepmem.so.0" ] || ln -sf libepmem.so "$LIB/libepmem.so.0"
[ -x "$CHURN" ] || { echo "long-run: no kv_churn in .carry/bin or target/release" >&2; exit 2; }
export LD_LIBRARY_PATH=$LIB:${LD_LIBRARY_PATH:-}
echo "long-run: EPM_DEVICE=${EPM_DEVICE:-auto}, library $LIB, churn $CHURN, logs $OUT"

FAIL=0
VERDICTS=()

# ---- (a) the offload demo -------------------------------------------------
gcc -std=c11 -O2 -Iinclude examples-c/offload_decode.c -o "$OUT/offload_decode" -L"$LIB" -lepmem -lpthread -lm \
  || { echo "long-run: cannot compile the demo" >&2; exit 2; }
# The full run uses 4 MiB layers (192 MiB model, 96 MiB budget), so each of the
# 10,000 steps streams real copies; --quick keeps the demo's small default.
if [ $QUICK = 1 ]; then SHORT=10; LONG=200; SIZE=(); else SHORT=100; LONG=10000; SIZE=(--layer-kib 4096); fi
demo() { # demo STEPS: run, keep the log, print "acquires mismatches pinned_allocs arena_allocs"
  local log=$OUT/offload_decode_$1.log
  timeout 900 "$OUT/offload_decode" "${SIZE[@]}" --steps "$1" >"$log" 2>&1
  local rc=$?
  local acq mis pin arena
  acq=$(sed -n 's/^verified \([0-9]*\) acquires.*: \([0-9]*\) mismatches.*/\1/p' "$log")
  mis=$(sed -n 's/^verified \([0-9]*\) acquires.*: \([0-9]*\) mismatches.*/\2/p' "$log")
  pin=$(sed -n 's/.*pinned_alloc_calls \([0-9]*\).*/\1/p' "$log")
  arena=$(sed -n 's/.*arena: \([0-9]*\) driver allocs.*/\1/p' "$log")
  echo "$rc ${acq:-?} ${mis:-?} ${pin:-?} ${arena:-?}"
}
read -r rc1 acq1 mis1 pin1 arena1 <<<"$(demo $SHORT)"
t0=$SECONDS
read -r rc2 acq2 mis2 pin2 arena2 <<<"$(demo $LONG)"
secs=$((SECONDS - t0))
if [ "$rc1" = 0 ] && [ "$rc2" = 0 ] && [ "$mis2" = 0 ] && [ "$pin1" = "$pin2" ] && [ "$arena1" = "$arena2" ]; then
  V="offload_decode: PASS: $LONG steps in ${secs}s, $acq2 acquires checksummed on the device, 0 mismatches, driver allocations flat ($SHORT vs $LONG steps: pinned $pin1 = $pin2, arena $arena1 = $arena2)"
else
  V="offload_decode: FAIL: rc $rc1/$rc2, $LONG steps: $acq2 acquires, $mis2 mismatches; pinned allocs $pin1 -> $pin2, arena allocs $arena1 -> $arena2 (logs: $OUT/offload_decode_*.log)"
  FAIL=1
  tail -20 "$OUT/offload_decode_$LONG.log" >&2
fi
echo "$V"
VERDICTS+=("$V")

# ---- (b) the KV prefix-sharing churn ----------------------------------------
if [ $QUICK = 1 ]; then ARGS=(--quick); else ARGS=(); fi
timeout 900 "$CHURN" "${ARGS[@]}" >"$OUT/kv_churn.log" 2>&1
rc=$?
cat "$OUT/kv_churn.log"
V=$(grep -E '^kv_churn: (PASS|FAIL)' "$OUT/kv_churn.log" | tail -1)
[ -n "$V" ] || V="kv_churn: FAIL: exit $rc, no verdict (log: $OUT/kv_churn.log)"
[ $rc = 0 ] || FAIL=1
VERDICTS+=("$V")

echo "== long-run verdicts"
printf '%s\n' "${VERDICTS[@]}"
exit $FAIL
