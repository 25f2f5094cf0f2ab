"""Run the Python tests (stdlib unittest; the GPU machine has no pytest).

    EPMEM_LIB=target/release/libepmem.so python3 tests/python/run.py [-v] [PATTERN]

Imports epmem from python/ in this tree unless EPMEM_USE_INSTALLED=1 (then the
installed wheel is tested). EPM_DEVICE picks the device (host here, cuda on the
GPU machine). The closing line is "python: N passed, N failed, N skipped".
"""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if os.environ.get("EPMEM_USE_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    verbosity = 2 if "-v" in sys.argv else 1
    loader = unittest.TestLoader()
    if args:
        loader.testNamePatterns = [f"*{a}*" for a in args]
    suite = loader.discover(HERE, pattern="test_*.py", top_level_dir=HERE)
    result = unittest.TextTestRunner(verbosity=verbosity, stream=sys.stdout).run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped
    print(f"python: {passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(1 if failed or result.testsRun == 0 else 0)


if __name__ == "__main__":
    main()
