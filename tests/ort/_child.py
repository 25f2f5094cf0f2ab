"""What the ORT test scripts share: each runs an ORT session in a child
process of its own (a session that crashes, or an EP library loaded once per
process, cannot spoil the next case), and reads the EP's release line."""

import json
import os
import re
import subprocess
import sys


def run_child(script, args, log_level=None, timeout=600):
    """Run `python SCRIPT --child ARGS...` with EPM_LOG=LOG_LEVEL (unset when
    None). The child prints its result as JSON on a line starting "RESULT ".
    Returns (result, the child's stdout + stderr); a child that exits non-zero
    or prints no result fails the calling test with its log."""
    env = dict(os.environ)
    env.pop("EPM_LOG", None)
    if log_level:
        env["EPM_LOG"] = log_level
    r = subprocess.run([sys.executable, os.path.abspath(script), "--child", *args],
                       env=env, capture_output=True, text=True, timeout=timeout)
    log = r.stdout + r.stderr
    if r.returncode != 0:
        raise AssertionError(f"child {args[0] if args else ''} exited {r.returncode}:\n{log[-4000:]}")
    m = re.search(r"^RESULT (.*)$", r.stdout, re.M)
    assert m, log[-4000:]
    return json.loads(m.group(1)), log


def release_stats(log):
    """The EP's release line ("weight streaming released: k=v ..."): its key=value pairs."""
    m = re.search(r"weight streaming released: (.*)", log)
    assert m, "no release line in:\n" + log[-4000:]
    return {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", m.group(1))}
