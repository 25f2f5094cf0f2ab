#!/usr/bin/env bash
# Build everything the GPU machine needs (it has no Rust toolchain) into .carry/:
#   .carry/lib/      libepmem.so, libepmem.a
#   .carry/tests/    the Rust integration-test binaries (run there with EPM_DEVICE=cuda)
#   .carry/bin/      the benchmark binaries
# Then ship the tree with .carry/ carried, and run scripts/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry && mkdir -p .carry/lib .carry/tests .carry/bin
cargo build --release --bins --lib
cp target/release/libepmem.so target/release/libepmem.a .carry/lib/
for b in target/release/bench_*; do
  [ -x "$b" ] && [ -f "$b" ] && cp "$b" .carry/bin/
done
# Integration tests only (tests/*.rs): the unit tests of the lib are host-only logic.
cargo test --release --tests --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"] and m["target"]["kind"] != ["lib"]:
        shutil.copy(m["executable"], os.path.join(".carry/tests", m["target"]["name"]))
'
strip --strip-debug .carry/lib/libepmem.so .carry/tests/* .carry/bin/* 2>/dev/null || true
du -sh .carry; ls .carry/*
