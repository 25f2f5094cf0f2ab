#!/usr/bin/env bash
# Make (once) the venv with torch, numpy and transformers 5.17.0 (the GPU
# machine's version) from PyPI that scripts/python-test.sh runs in and
# scripts/ort-test.sh builds its onnxruntime-genai model with.
#
#   scripts/torch-venv.sh [VENV]   # default $EPMEM_TORCH_VENV, else .venv/torch
#
# Environment: PYTHON (the interpreter the venv is made from; default python3).
# Exits non-zero with a message when it cannot.
set -u
cd "$(dirname "$0")/.."
venv=${1:-${EPMEM_TORCH_VENV:-$PWD/.venv/torch}}
PY=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$PY" -m venv "$venv" || { echo "torch-venv: cannot make a venv at $venv" >&2; exit 2; }
fi
if ! "$venv/bin/python" -c 'import torch, numpy' 2>/dev/null; then
  t0=$SECONDS
  # torch from PyPI is the CUDA build: ~5.7 GB installed, and pip holds its
  # ~3 GB of wheels in a temp dir until it is done (peak ~9 GB). --no-cache-dir
  # keeps pip from keeping those wheels under ~/.cache/pip afterwards too.
  echo "torch-venv: installing torch and numpy from PyPI into $venv (once; ~2-3 min, ~5.7 GB; $(df -Ph "$venv" | awk 'NR==2 {print $4}') free there)"
  "$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check torch numpy ||
    { echo "torch-venv: pip could not install torch ($(df -Ph "$venv" | awk 'NR==2 {print $4}') free under $venv)" >&2; exit 2; }
  echo "torch-venv: torch installed in $((SECONDS - t0)) s"
fi
# transformers, the GPU machine's version, for tests/python/test_kvcache.py and
# test_transformers.py (tiny Llama models from a config) and
# tests/ort/make_genai_model.py: pure Python, ~15 MB of wheels with its deps
# (tokenizers, safetensors, huggingface_hub), ~160 MB installed.
if ! "$venv/bin/python" -c 'import transformers' 2>/dev/null; then
  echo "torch-venv: installing transformers 5.17.0 from PyPI into $venv (once)"
  "$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check "transformers==5.17.0" ||
    { echo "torch-venv: pip could not install transformers" >&2; exit 2; }
fi
