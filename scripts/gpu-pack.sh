#!/usr/bin/env bash
# Build everything the GPU machine needs (it has no Rust toolchain) into .carry/:
#   .carry/lib/      libepmem.so (the default build, what `make install` ships)
#   .carry/lib-testing/ libepmem_testing.so (--features testing: the C tests and probes link it)
#   .carry/tests/    the Rust integration-test binaries (run there with EPM_DEVICE=cuda)
#   .carry/bin/      the benchmark binaries and kv_churn (scripts/long-run.sh)
# Then ship the tree with .carry/ carried, and run scripts/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry && mkdir -p .carry/lib .carry/lib-testing .carry/tests .carry/bin
# --workspace: the benches and kv_churn are the tools/ crate's; a workspace
# shares target/release/. (No dev-dependency is built here, so the library
# keeps its shipped features.)
cargo build --release --workspace --bins --lib
# The static library stays behind: nothing on the GPU machine links it, and it is large.
cp target/release/libepmem.so .carry/lib/
# Its SONAME: what a program linked against it there asks the loader for.
ln -sf libepmem.so .carry/lib/libepmem.so.0
make --no-print-directory build-testing
cp target/testing/release/libepmem_testing.so .carry/lib-testing/
for b in target/release/bench_* target/release/kv_churn; do
  [ -x "$b" ] && [ -f "$b" ] && cp "$b" .carry/bin/
done
# Integration tests only (tests/*.rs): the unit tests of the lib are host-only logic.
cargo test --release --lib --tests --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kind = m["target"]["kind"]
    # tests/*.rs, plus the lib unit tests (their GPU-only tests are #[ignore]d here).
    name = m["target"]["name"] if kind == ["test"] else ("epmem_lib" if m["profile"]["test"] and m["target"]["name"] == "epmem" else None)
    if name:
        shutil.copy(m["executable"], os.path.join(".carry/tests", name))
'
# The onnxruntime-genai model tests/ort/test_genai.py runs on CUDA (~8 MB): genai's
# builder needs torch, transformers and onnx_ir together, which the GPU machine
# lacks. Made where a builder python is here (GENAI_BUILD_PYTHON, else the venv
# scripts/ort-test.sh makes, .venv/genai-builder); scripts/ort-test.sh --no-install uses it.
gbp=${GENAI_BUILD_PYTHON:-.venv/genai-builder/bin/python}
if [ -x "$gbp" ]; then
  "$gbp" tests/ort/make_genai_model.py .carry/genai-model-cuda --ep cuda >.carry/genai-build.log 2>&1 ||
    { tail -20 .carry/genai-build.log; echo "gpu-pack: the genai model build failed" >&2; exit 1; }
  rm -f .carry/genai-build.log
else
  echo "gpu-pack: no $gbp (scripts/ort-test.sh makes it): no genai model carried; test_genai.py is then not run there"
fi
strip --strip-debug .carry/lib/libepmem.so .carry/lib-testing/libepmem_testing.so .carry/tests/* .carry/bin/* 2>/dev/null || true
du -sh .carry; ls .carry/*
