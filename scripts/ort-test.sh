#!/usr/bin/env bash
# Test epmem as an ONNX Runtime plugin EP against real onnxruntime wheels.
#
#   scripts/ort-test.sh               # CI: a venv per version from PyPI, then the tests
#   scripts/ort-test.sh --no-install  # GPU machine: the onnxruntime already in python3
#
# Environment:
#   ORT_VERSIONS  versions to test, "latest" = newest on PyPI (default: "latest 1.23.2")
#   EPM_DEVICE    the device epmem reports (auto|cuda|host; default auto)
#   EPMEM_LIB     the library to load (default: target/release, else .carry/lib,
#                 else target/debug libepmem.so, built with cargo if missing)
#   PYTHON        interpreter for venvs / --no-install (default python3)
#   ORT_VENV_DIR  where the per-version venvs live (default .venv/, reused across runs)
#   GENAI_VERSION onnxruntime-genai to test with every version 1.31+ (default 0.18.0;
#                 installed --no-deps into that version's venv)
#   GENAI_BUILD_PYTHON  the python that runs genai's model builder (torch,
#                 transformers, onnx, onnx_ir, onnxruntime_genai); default: a venv
#                 .venv/genai-builder over scripts/torch-venv.sh's .venv/torch, or
#                 with --no-install python3
#   ORT_FAKE_CUDA 1 (default without --no-install): also run every version with
#                 EPM_DEVICE=cuda against src/device/cuda/fake_libcuda.c, so the
#                 GPU labelling (GPU memory infos, created or CPU-bound hardware
#                 devices) is exercised with no GPU. Skipped where a real libcuda is.
#
# For each version it runs tests/ort/test_ort_plugin.py (Python),
# tests/ort/test_ort_streaming.py (the EP streaming weights; needs the onnx
# package), tests/ort/ort_c_test.c (C, linked against that wheel's libonnxruntime) and the
# onnxruntime snippets of the docs (tests/python/test_docs.py, 1.28+),
# tests/ort/test_genai.py (epmem's EP inside onnxruntime-genai, 1.31+; with
# --no-install where onnxruntime_genai imports), then prints one closing line "ort: N passed, N failed".
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
INSTALL=1
for a in "$@"; do
  case "$a" in
    --no-install) INSTALL=0 ;;
    *) echo "unknown argument $a" >&2; exit 2 ;;
  esac
done

lib=${EPMEM_LIB:-}
if [ -z "$lib" ]; then
  for c in target/release/libepmem.so .carry/lib/libepmem.so target/debug/libepmem.so; do
    [ -f "$c" ] && { lib=$c; break; }
  done
fi
if [ -z "$lib" ]; then
  command -v cargo >/dev/null || { echo "no libepmem.so and no cargo to build it" >&2; exit 2; }
  cargo build --lib >&2 || exit 2
  lib=target/debug/libepmem.so
fi
case "$lib" in /*) ;; *) lib=$ROOT/$lib ;; esac
export EPMEM_LIB=$lib
CC=${CC:-$(command -v gcc || command -v cc)}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/epmem-ort.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

GENAI_VERSION=${GENAI_VERSION:-0.18.0}
PASSED=0
FAILED=0
# tally LOG: add the "N passed, N failed" of a suite's log to the totals.
tally() {
  local line p f
  line=$(grep -Eo '[0-9]+ passed, [0-9]+ failed' "$1" | tail -1)
  if [ -z "$line" ]; then FAILED=$((FAILED + 1)); echo "  (no result line: counted as a failure)"; return; fi
  p=${line%% passed*}; f=${line#*passed, }; f=${f%% failed*}
  PASSED=$((PASSED + p)); FAILED=$((FAILED + f))
}

# genai_build_python: the python that runs genai's builder (made once).
genai_build_python() {
  if [ -n "${GENAI_BUILD_PYTHON:-}" ]; then echo "$GENAI_BUILD_PYTHON"; return; fi
  if [ $INSTALL = 0 ]; then echo "$PY"; return; fi
  local tv=${EPMEM_TORCH_VENV:-$ROOT/.venv/torch} bv=${ORT_VENV_DIR:-$ROOT/.venv}/genai-builder
  PYTHON=$PY scripts/torch-venv.sh "$tv" >&2 || return 1
  if ! "$bv/bin/python" -c "import torch, transformers, onnx, onnx_ir, importlib.util as u, sys; sys.exit(u.find_spec('onnxruntime_genai') is None)" 2>/dev/null; then
    # torch and transformers come from the torch venv (a .pth file), the
    # builder's own needs are installed here (~70 MB).
    { rm -rf "$bv" && "$PY" -m venv "$bv" &&
      "$tv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
        "$("$bv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/epmem-torch-venv.pth" &&
      "$bv/bin/python" -m pip install -q --disable-pip-version-check onnx onnx_ir "onnxruntime-genai==$GENAI_VERSION" >&2; } ||
      { echo "cannot make $bv for genai's model builder" >&2; return 1; }
  fi
  echo "$bv/bin/python"
}

# run_genai PYTHON LABEL: tests/ort/test_genai.py against PYTHON's onnxruntime
# and onnxruntime_genai, on a model genai's builder makes (once per EP kind:
# cuda where this onnxruntime has the CUDA EP, else cpu).
run_genai() {
  local py=$1 label=$2 out=$WORK/genai-$2.log ep model bpy
  ep=$("$py" -c 'import onnxruntime as o; print("cuda" if "CUDAExecutionProvider" in o.get_available_providers() else "cpu")')
  model=$WORK/genai-model-$ep
  # The GPU machine cannot run the builder (no onnx_ir): scripts/gpu-pack.sh carries the model.
  if [ $INSTALL = 0 ] && [ -f "$ROOT/.carry/genai-model-$ep/weights.json" ]; then
    model=$ROOT/.carry/genai-model-$ep
  elif [ $INSTALL = 0 ] && ! "$(genai_build_python)" -c 'import torch, transformers, onnx, onnx_ir' 2>/dev/null; then
    echo "  onnxruntime-genai: not run (no .carry/genai-model-$ep from scripts/gpu-pack.sh, and no torch+transformers+onnx+onnx_ir here to build it)"
    return
  fi
  if [ ! -f "$model/weights.json" ]; then
    if ! bpy=$(genai_build_python) || ! "$bpy" tests/ort/make_genai_model.py "$model" --ep "$ep" >"$WORK/genai-build.log" 2>&1; then
      tail -30 "$WORK/genai-build.log" 2>/dev/null
      echo "ort-genai: could not build the genai model: 0 passed, 1 failed" | tee "$out"; tally "$out"; return
    fi
  fi
  EPMEM_GENAI_MODEL=$model "$py" tests/ort/test_genai.py >"$out" 2>&1
  cat "$out"; tally "$out"
}

# ort_at_least PYTHON MAJOR MINOR: whether PYTHON's onnxruntime is at least that.
ort_at_least() {
  "$1" -c "import onnxruntime as o, sys; sys.exit(tuple(map(int, o.__version__.split('.')[:2])) < ($2, $3))"
}

# run_suites PYTHON LABEL: the Python and C tests against PYTHON's onnxruntime.
run_suites() {
  local py=$1 label=$2 capi so out
  echo "== onnxruntime $label ($py), EPM_DEVICE=${EPM_DEVICE:-auto}${FAKE:+ (fake libcuda)}, $EPMEM_LIB"
  # The committed model must be what the generator makes (when onnx is there).
  if "$py" -c 'import onnx' 2>/dev/null; then
    "$py" tests/ort/make_model.py "$WORK/model.onnx" && cmp -s "$WORK/model.onnx" tests/ort/tiny_matmul_add.onnx ||
      echo "  note: tests/ort/tiny_matmul_add.onnx differs from what make_model.py writes with this onnx"
  fi
  out=$WORK/py-$label.log
  LD_LIBRARY_PATH="${FAKE:+$FAKE:}${LD_LIBRARY_PATH:-}" "$py" tests/ort/test_ort_plugin.py >"$out" 2>&1
  cat "$out"; tally "$out"

  # Weight streaming (claim -> own -> stream -> compute) on models the onnx
  # package builds; on the fake libcuda only the clean no-cuBLAS error.
  out=$WORK/stream-$label.log
  if "$py" -c 'import onnx' 2>/dev/null; then
    EPMEM_FAKE_CUDA=${FAKE:+1} LD_LIBRARY_PATH="${FAKE:+$FAKE:}${LD_LIBRARY_PATH:-}" \
      "$py" tests/ort/test_ort_streaming.py >"$out" 2>&1
  else
    echo "ort-stream: the onnx package is missing for $py (pip install onnx): 0 passed, 1 failed" >"$out"
  fi
  cat "$out"; tally "$out"

  # The H200 benchmark's smoke run: the tiny Llama-shaped model with a KV
  # cache, epmem at 25-100% budgets, 32 greedy tokens identical to the CPU EP's.
  if [ -z "$FAKE" ] && "$py" -c 'import onnx' 2>/dev/null; then
    out=$WORK/bench-$label.log
    "$py" scripts/bench_ort_stream.py --size tiny --out "$WORK/bench-$label" >"$out" 2>&1
    grep -E '^(TARGET|bench-ort-stream:)' "$out" || tail -20 "$out"; tally "$out"
  fi

  # epmem's EP inside onnxruntime-genai (0.18 needs onnxruntime 1.31+). In CI
  # every such version has it installed (a missing one fails the test); with
  # --no-install it runs where python3 has onnxruntime_genai.
  if [ -z "$FAKE" ]; then
    if ! ort_at_least "$py" 1 31; then
      echo "  onnxruntime-genai: not run with onnxruntime $label (onnxruntime-genai $GENAI_VERSION needs 1.31+)"
    elif [ $INSTALL = 0 ] && ! "$py" -c $'try:\n import torch\nexcept ImportError:\n pass\nimport onnxruntime_genai' 2>/dev/null; then
      echo "  onnxruntime-genai: not run ($py has no onnxruntime_genai; pip install onnxruntime-genai(-cuda)==$GENAI_VERSION)"
    else
      run_genai "$py" "$label"
    fi
  fi

  # The docs' onnxruntime snippets (tests/python/test_docs.py; the others run in
  # scripts/python-test.sh), where their API is there (1.28+), once per version.
  if [ -z "${FAKE:-}" ]; then
    out=$WORK/docs-$label.log
    if "$py" -c 'import onnxruntime as o, sys; sys.exit(tuple(map(int, o.__version__.split(".")[:2])) < (1, 28))'; then
      EPMEM_DOC_TEST_ONLY=onnxruntime "$py" tests/python/run.py test_docs >"$out" 2>&1
      cat "$out"; tally "$out"
    else
      echo "  docs' onnxruntime snippets: not run with onnxruntime $label (they need 1.28+)"
    fi
  fi

  capi=$("$py" -c 'import onnxruntime, os; print(os.path.join(os.path.dirname(onnxruntime.__file__), "capi"))')
  so=$(ls "$capi"/libonnxruntime.so.1.* 2>/dev/null | head -1)
  out=$WORK/c-$label.log
  if [ -z "$so" ] || [ -z "$CC" ]; then
    echo "no libonnxruntime.so.1.* in $capi or no C compiler" | tee "$out"; FAILED=$((FAILED + 1)); return
  fi
  # The wheel has only libonnxruntime.so.1.x.y; the soname is libonnxruntime.so.1.
  mkdir -p "$WORK/lib-$label" && ln -sf "$so" "$WORK/lib-$label/libonnxruntime.so.1"
  if "$CC" -std=c11 -pthread -O1 -g -Wall -Wextra -Werror tests/ort/ort_c_test.c -o "$WORK/ort_c_test-$label" "$so" \
      -Wl,-rpath,"$WORK/lib-$label" >"$out" 2>&1; then
    # ORT 1.23 dlopens libonnxruntime_providers_shared.so from the library path.
    LD_LIBRARY_PATH="${FAKE:+$FAKE:}$capi:${LD_LIBRARY_PATH:-}" "$WORK/ort_c_test-$label" "$EPMEM_LIB" >>"$out" 2>&1
  fi
  cat "$out"; tally "$out"
}

# A fake libcuda (device memory is host memory) for the GPU-labelled pass.
FAKE=
fake_ok=0
if [ $INSTALL = 1 ] && [ "${ORT_FAKE_CUDA:-1}" = 1 ] && [ -f src/device/cuda/fake_libcuda.c ] &&
    ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; then
  mkdir -p "$WORK/fakecuda" &&
    "$CC" -shared -fPIC -O1 -o "$WORK/fakecuda/libcuda.so" src/device/cuda/fake_libcuda.c && fake_ok=1
fi

if [ $INSTALL = 0 ]; then
  v=$("$PY" -c 'import onnxruntime; print(onnxruntime.__version__)') || { echo "$PY has no onnxruntime" >&2; exit 2; }
  run_suites "$PY" "$v"
else
  for want in ${ORT_VERSIONS:-latest 1.23.2}; do
    venv=${ORT_VENV_DIR:-$ROOT/.venv}/ort-$want
    if [ ! -x "$venv/bin/python" ]; then
      "$PY" -m venv "$venv" || { echo "cannot make a venv at $venv" >&2; FAILED=$((FAILED + 1)); continue; }
    fi
    spec=onnxruntime
    [ "$want" = latest ] && pip_flags=(--upgrade) || { spec="onnxruntime==$want"; pip_flags=(); }
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "${pip_flags[@]}" "$spec" numpy onnx >"$WORK/pip.log" 2>&1; then
      cat "$WORK/pip.log"; echo "pip could not install $spec" >&2; FAILED=$((FAILED + 1)); continue
    fi
    v=$("$venv/bin/python" -c 'import onnxruntime; print(onnxruntime.__version__)')
    # onnxruntime-genai where it can run (1.31+), without its dependencies so the
    # onnxruntime under test stays the one installed above. A failed install
    # shows up as test_genai.py's failure (genai does not import).
    if ort_at_least "$venv/bin/python" 1 31 &&
        ! "$venv/bin/python" -c "import onnxruntime_genai as g, sys; sys.exit(g.__version__ != '$GENAI_VERSION')" 2>/dev/null; then
      "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "onnxruntime-genai==$GENAI_VERSION" >"$WORK/pip.log" 2>&1 ||
        { cat "$WORK/pip.log"; echo "pip could not install onnxruntime-genai==$GENAI_VERSION" >&2; }
    fi
    run_suites "$venv/bin/python" "$v"
    if [ $fake_ok = 1 ]; then
      FAKE=$WORK/fakecuda EPM_DEVICE=cuda run_suites "$venv/bin/python" "$v-fakecuda"
      FAKE=
    fi
  done
fi
echo "ort: $PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ] && [ "$PASSED" -gt 0 ]
