"""Every fenced ```python block of docs/PYTHON.md, docs/KV.md and docs/ORT.md runs as
written, each in a fresh interpreter from the repository root, on the device
EPM_DEVICE names (host in CI), so a doc example cannot rot.

A block that cannot run here says so on the line before its fence:
`<!-- doc-test: needs onnxruntime -->` (run where onnxruntime is installed:
scripts/ort-test.sh runs this file in its venvs with EPMEM_DOC_TEST_ONLY=onnxruntime)
or `<!-- doc-test: needs cuda ... -->` (run with EPM_DEVICE=cuda on a GPU). Such a
block is reported as skipped with the reason, never as passed."""

import importlib.util
import os
import re
import subprocess
import sys
import unittest

import epmem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ("docs/PYTHON.md", "docs/KV.md", "docs/ORT.md")
MARK = re.compile(r"<!--\s*doc-test:\s*needs\s+(\w+)[^>]*-->")


def blocks(path):
    """(line of the fence, requirement or None, code) of each ```python block."""
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, need = i + 1, None
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            m = MARK.search(prev)
            if m:
                need = m.group(1)
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise AssertionError(f"{path}:{start}: unterminated ```python block")
            out.append((start, need, "\n".join(lines[i + 1:j]) + "\n"))
            i = j
        i += 1
    return out


def _has_cuda_ep():
    """onnxruntime imports here and has the CUDA EP (torch first: it loads CUDA 13's libraries)."""
    code = ("try:\n import torch\nexcept ImportError:\n pass\nimport onnxruntime as o, sys\n"
            "sys.exit(0 if 'CUDAExecutionProvider' in o.get_available_providers() else 1)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def _skip_reason(need):
    only = os.environ.get("EPMEM_DOC_TEST_ONLY")
    if only and need != only:
        return f"EPMEM_DOC_TEST_ONLY={only}: this block {'needs ' + need if need else 'needs no extra'} package"
    if need == "onnxruntime":
        if importlib.util.find_spec("onnxruntime") is None:
            return "needs onnxruntime, not installed here (scripts/ort-test.sh runs it in its venvs)"
    elif need == "cuda":
        if os.environ.get("EPM_DEVICE") != "cuda":
            return "needs CUDA (onnxruntime-gpu on a GPU): EPM_DEVICE is not cuda here"
        if not _has_cuda_ep():
            return "needs onnxruntime-gpu's CUDA EP: this onnxruntime has none (put the unpacked wheel first on PYTHONPATH)"
    elif need is not None:
        raise AssertionError(f"unknown doc-test requirement {need!r}")
    return None


class Docs(unittest.TestCase):
    def test_every_doc_has_its_blocks(self):
        # The extraction must find them: a regex that matched nothing would pass every doc.
        counts = {p: len(blocks(p)) for p in DOCS}
        self.assertGreaterEqual(counts["docs/PYTHON.md"], 6, counts)
        self.assertGreaterEqual(counts["docs/KV.md"], 1, counts)
        self.assertGreaterEqual(counts["docs/ORT.md"], 2, counts)
        marked = [(p, line, need) for p in DOCS for line, need, _ in blocks(p) if need]
        # ORT.md's weight-streaming and gpu_external_* examples need onnxruntime-gpu.
        self.assertLessEqual(len(marked), 5, f"keep blocks that cannot run on the host device rare: {marked}")


def _run(self, path, line, need, code):
    reason = _skip_reason(need)
    if reason:
        self.skipTest(reason)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(epmem.__file__)))
    env = dict(os.environ, PYTHONPATH=pkg + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    if p.returncode != 0:
        self.fail(f"{path}:{line}: the block exited {p.returncode}\n--- stdout\n{p.stdout[-3000:]}"
                  f"\n--- stderr\n{p.stderr[-3000:]}")


for _path in DOCS:
    for _line, _need, _code in blocks(_path):
        _name = f"test_{os.path.basename(_path).replace('.', '_')}_line_{_line}"
        setattr(Docs, _name, lambda self, a=(_path, _line, _need, _code): _run(self, *a))


if __name__ == "__main__":
    unittest.main()
