#!/usr/bin/env bash
# Every epmem benchmark, side by side, in one run on a GPU machine.
#
#   here:   scripts/gpu-pack.sh            # builds .carry/bin/bench_* (no Rust on the GPU machine)
#   there:  scripts/bench.sh [--repeat 2] [--quick]
#
# Each bench binary measures ours, the baselines it is judged against and the physical
# peak in the same process, and reports medians after a warm-up. This script
# merges their JSON into $OUT/results.json (date, GPU, driver, command), renders
# $OUT/report/BENCHMARKS.md and PNG plots (matplotlib), and with --repeat 2 runs
# everything twice and measures the run-to-run noise the comparator uses
# ($OUT/noise.json). Compare two runs with scripts/bench_compare.py.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/epmem-bench}
REPEAT=1
QUICK=
while [ $# -gt 0 ]; do
  case "$1" in
    --repeat) REPEAT=$2; shift ;;
    --quick) QUICK=--quick ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
BIN=.carry/bin
[ -d "$BIN" ] || BIN=target/release   # after `cargo build --release --workspace`
export LD_LIBRARY_PATH=$PWD/.carry/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT/raw"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
CMD="scripts/bench.sh${QUICK:+ $QUICK}${REPEAT:+ --repeat $REPEAT}"
rc=0
for r in $(seq 1 "$REPEAT"); do
  files=()
  for b in "$BIN"/bench_*; do
    [ -x "$b" ] || continue
    n=$(basename "$b")
    echo "== run $r: $n" >&2
    if ! timeout 600 "$b" $QUICK --json "$OUT/raw/$n-$r.json" >"$OUT/raw/$n-$r.md" 2>"$OUT/raw/$n-$r.err"; then
      echo "$n failed (run $r):" >&2; tail -20 "$OUT/raw/$n-$r.err" >&2; rc=1; continue
    fi
    cat "$OUT/raw/$n-$r.md"
    files+=("$OUT/raw/$n-$r.json")
  done
  python3 - "$OUT/results-$r.json" "${GPU:-none}" "${DRIVER:-none}" "$CMD" "${files[@]}" <<'PY'
import json, sys, datetime
out, gpu, driver, cmd, *files = sys.argv[1:]
benches = [json.load(open(f)) for f in files]
kind = benches[0].get("kind", "?") if benches else "?"
json.dump({"schema": "epmem-bench-run/1", "date": datetime.date.today().isoformat(), "gpu": gpu,
           "driver": driver, "kind": kind, "command": cmd, "benches": benches}, open(out, "w"), indent=1)
PY
done
cp "$OUT/results-1.json" "$OUT/results.json"
mkdir -p "$OUT/report/img"
python3 scripts/bench_report.py "$OUT/results.json" --md "$OUT/report/BENCHMARKS.md" --img-dir "$OUT/report/img" --img-prefix img/
if [ "$REPEAT" -ge 2 ]; then
  python3 scripts/bench_compare.py --measure-noise "$OUT/results-1.json" "$OUT/results-2.json" -o "$OUT/noise.json"
  python3 scripts/bench_compare.py "$OUT/results-1.json" "$OUT/results-2.json" --noise "$OUT/noise.json" >"$OUT/report/self-compare.txt" || true
fi
# Only a few files come back from a GPU machine: results.json plus one archive
# (the report, its plots, every raw output, each repeat's results, the noise).
tar -C "$OUT" -czf "$OUT/report.tgz" report raw $(cd "$OUT" && ls results-*.json noise.json 2>/dev/null)
rm -rf "$OUT/report" "$OUT/raw" "$OUT"/results-*.json "$OUT/noise.json"
exit $rc
