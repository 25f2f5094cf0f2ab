"""epmem.allocator (the stream-ordered arena) and epmem.torch_allocator
(PyTorch's pluggable allocator). The arena runs on any device; what needs a
CUDA PyTorch runs tests/gpu/torch_allocator.py in fresh processes and is
skipped, with the reason, where PyTorch has no CUDA (the CPU wheel in CI)."""

import ctypes
import os
import subprocess
import sys
import unittest

try:
    import torch
except ImportError:  # the tests that need it skip themselves
    torch = None

import epmem
import epmem.testing
from epmem import _lib as L
from epmem.allocator import OrderedArena

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20


def cuda_torch():
    return torch is not None and torch.cuda.is_available()


class OrderedArenaTest(unittest.TestCase):
    def setUp(self):
        self.dev = epmem.Device()

    def tearDown(self):
        self.dev.close()

    def test_alloc_free_stats(self):
        with OrderedArena(self.dev, 64 * MiB) as a:
            s = epmem.Stream(self.dev)
            p = a.alloc(MiB, s)
            q = a.alloc(4096)
            self.assertNotEqual(p, q)
            st = a.stats()
            self.assertEqual((st["live_allocations"], st["live_bytes"], st["stream_allocs"]), (2, MiB + 4096, 1))
            a.free(p, s)
            a.free(q)
            with self.assertRaises(epmem.InvalidArgument) as e:
                a.free(q)
            self.assertIn("not a live allocation", str(e.exception))
            with self.assertRaises(epmem.InvalidArgument):
                a.alloc(0, s)
            s.synchronize()
            st = a.stats()
            self.assertEqual((st["live_allocations"], st["stream_frees"]), (0, 1))
            self.assertGreater(a.trim(), 0)
            self.assertEqual(a.stats()["committed_bytes"], 0)
            s.close()

    def test_a_block_freed_on_a_held_stream_is_not_handed_to_another(self):
        if not epmem.testing.available():
            self.skipTest("needs the testing build of the library (epm_device_hold_async): "
                          "EPMEM_LIB=target/testing/release/libepmem_testing.so")
        with OrderedArena(self.dev, 64 * MiB) as a:
            sa, sb = epmem.Stream(self.dev), epmem.Stream(self.dev)
            p = a.alloc(MiB, sa)
            try:
                gate = epmem.testing.hold_async(self.dev, sa)
            except epmem.Unsupported as e:
                self.skipTest(f"this device cannot hold a stream: {e}")
            ev = epmem.Event(self.dev)
            ev.record(sa)
            a.free(p, sa)
            q = a.alloc(MiB, sb)
            r = a.alloc(MiB, sa)
            self.assertFalse(ev.query(), "the held stream ran: the checks proved nothing")
            self.assertTrue(q + MiB <= p or q >= p + MiB, "another stream got a block its owner's work still uses")
            self.assertEqual(r, p, "the freeing stream reuses its block at once")
            gate.open()
            sa.synchronize()
            a.free(r, sa)
            a.free(q, sb)
            sb.synchronize()
            self.assertEqual(a.stats()["same_stream_reuses"], 1)
            gate.close()
            ev.close()
            sa.close()
            sb.close()


class TorchFunctionsTest(unittest.TestCase):
    """The C functions PyTorch loads, called through ctypes: bad input is
    NULL / a message, never a crash (no device needed for these cases)."""

    def test_bad_input_returns_null_and_says_why(self):
        lib = epmem.lib()
        self.assertIsNone(lib.epm_torch_alloc(-1, 0, None))
        self.assertIn(b"negative", lib.epm_last_error_message())
        self.assertIsNone(lib.epm_torch_alloc(64, -3, None))
        self.assertIn(b"device -3", lib.epm_last_error_message())
        x = ctypes.c_uint64(5)
        lib.epm_torch_free(ctypes.addressof(x), 8, 63, None)
        self.assertIn(b"device 63", lib.epm_last_error_message())
        self.assertEqual(x.value, 5)
        s = L.new(L.EpmOrderedArenaStats)
        with self.assertRaises(epmem.InvalidState):
            lib.epm_torch_get_stats(63, ctypes.byref(s))
        with self.assertRaises(epmem.InvalidArgument):
            lib.epm_torch_trim(-7, None)


@unittest.skipIf(torch is None, "torch is not installed")
class UseAsAllocatorTest(unittest.TestCase):
    def test_without_cuda_it_refuses_with_a_reason(self):
        if torch.cuda.is_available():
            self.skipTest("PyTorch has CUDA here: the refusal is for CPU builds")
        import epmem.torch_allocator as eta
        with self.assertRaises(RuntimeError) as e:
            eta.use_as_allocator()
        self.assertIn("no CUDA", str(e.exception))
        self.assertFalse(eta.is_installed())

    def test_on_cuda_generation_streams_and_the_too_late_error(self):
        if not cuda_torch():
            self.skipTest(f"PyTorch {torch.__version__} has no CUDA: tests/gpu/torch_allocator.py "
                          "runs on the GPU machine")
        env = dict(os.environ)
        env.pop("EPM_DEVICE", None)
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "torch_allocator.py"), "all"],
                           capture_output=True, text=True, timeout=1800, env=env)
        self.assertEqual(p.returncode, 0, p.stdout[-4000:] + p.stderr[-4000:])
        self.assertIn("torch_allocator: PASS", p.stdout)


if __name__ == "__main__":
    unittest.main()
