"""ORT's own CUDA EP running on epmem memory (onnxruntime-gpu, GPU machine only).

    EPMEM_LIB=/abs/libepmem.so MODEL=model.onnx D_MODEL=256 python3 tests/ort/gpu/test_cuda_ep.py

scripts/ort-gpu-test.sh runs it with onnxruntime-gpu first on PYTHONPATH and
the model from tests/ort/gpu/make_transformer.py. Prints
"ort-gpu-python: N passed, N failed, N skipped".
"""

import ctypes
import os
import sys
import threading
import unittest

import torch  # noqa: F401  first: it loads the CUDA 13 libraries onnxruntime-gpu links against
import numpy as np
import onnxruntime as ort

LIB = os.environ.get("EPMEM_LIB", "")
MODEL = os.environ.get("MODEL", "")
D = int(os.environ.get("D_MODEL", "256"))
CUDA = "CUDAExecutionProvider"
# (batch, seq): different sizes make every run allocate differently.
# The large ones keep kernels queued long enough for the two-stream test to bite.
SHAPES = [(1, 1), (1, 17), (2, 64), (4, 128), (8, 31), (3, 200), (16, 64), (1, 512), (16, 256), (7, 9),
          (32, 512), (64, 256)]
REG = "epmem"

_cuda = ctypes.CDLL("libcuda.so.1")
_cuda.cuInit(0)


def is_vmm(ptr):
    """True when `ptr` lies in a cuMemCreate/cuMemMap allocation (epmem's arenas), false for cudaMalloc memory."""
    h = ctypes.c_ulonglong(0)
    r = _cuda.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_void_p(ptr))
    if r == 0:
        _cuda.cuMemRelease(h)
    return r == 0


def x_for(shape, seed=0):
    b, t = shape
    return np.random.default_rng(1000 * b + t + seed).standard_normal((b, t, D)).astype(np.float32)


def session(env_allocators):
    so = ort.SessionOptions()
    if env_allocators:
        so.add_session_config_entry("session.use_env_allocators", "1")
    s = ort.InferenceSession(MODEL, sess_options=so, providers=[CUDA])
    assert s.get_providers()[0] == CUDA, s.get_providers()
    return s


def device_output_ptr(s, x):
    io = s.io_binding()
    io.bind_cpu_input("X", x)
    io.bind_output("Y", "cuda")
    s.run_with_iobinding(io)
    out = io.get_outputs()[0]
    return out.data_ptr(), out.numpy()


EXPECTED = {}


class CudaEpOnEpmem(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # The reference: ORT's CUDA EP on its own allocator, before epmem is registered.
        plain = session(False)
        for shape in SHAPES:
            for seed in (0, 1):
                EXPECTED[shape, seed] = plain.run(None, {"X": x_for(shape, seed)})[0]
        cls.plain_ptr_vmm = is_vmm(device_output_ptr(plain, x_for(SHAPES[2]))[0])
        del plain
        ort.register_execution_provider_library(REG, LIB)
        # A session without session.use_env_allocators, made with epmem
        # registered but before any test's session: onnxruntime's Python
        # binding keeps CUDA EP options it was given (gpu_external_alloc /
        # free) in process-wide state, so once
        # test_the_cuda_eps_external_allocator_options_take_epmem_memory ran,
        # later CUDA EP sessions in this process allocate through epmem
        # whatever their own options say.
        s = session(False)
        cls.no_entry_ptr, cls.no_entry_y = device_output_ptr(s, x_for(SHAPES[3]))
        cls.no_entry_vmm = is_vmm(cls.no_entry_ptr)
        del s

    @classmethod
    def tearDownClass(cls):
        # Sessions are gone (each test drops its own) before the library is unregistered.
        ort.unregister_execution_provider_library(REG)

    def test_the_check_for_epmem_memory_can_fail(self):
        self.assertFalse(self.plain_ptr_vmm, "ORT's own CUDA allocator gave a VMM pointer: is_vmm proves nothing")

    def test_outputs_are_bit_identical_and_live_in_epmem_memory(self):
        s = session(True)
        for shape in SHAPES:
            y = s.run(None, {"X": x_for(shape)})[0]
            self.assertTrue(np.array_equal(y, EXPECTED[shape, 0]), f"{shape}: max diff {np.abs(y - EXPECTED[shape, 0]).max()}")
        ptr, y = device_output_ptr(s, x_for(SHAPES[3]))
        self.assertTrue(is_vmm(ptr), f"output at {ptr:#x} is not epmem (VMM) memory")
        self.assertTrue(np.array_equal(y, EXPECTED[SHAPES[3], 0]))
        del s

    def test_without_the_config_entry_the_cuda_ep_keeps_its_own_allocator(self):
        # Run in setUpClass (see there): epmem registered, no session yet.
        self.assertFalse(self.no_entry_vmm, f"without session.use_env_allocators the CUDA EP should not use epmem "
                         f"(output at {self.no_entry_ptr:#x})")
        self.assertTrue(np.array_equal(self.no_entry_y, EXPECTED[SHAPES[3], 0]))

    def test_two_sessions_on_two_streams_churning_allocations(self):
        # Both sessions take the one env allocator (epmem's), each CUDA EP
        # runs on its own stream, and every run frees intermediates while
        # its kernels are still queued: without stream-ordered frees one
        # session's kernels overwrite the other's buffers.
        sessions = [session(True), session(True)]
        errors, runs = [], [0, 0]
        barrier = threading.Barrier(2)

        def churn(i):
            rng = np.random.default_rng(i)
            inputs = {(shape, seed): x_for(shape, seed) for shape in SHAPES for seed in (0, 1)}
            barrier.wait()
            for _ in range(80):
                shape = SHAPES[rng.integers(len(SHAPES))]
                seed = int(rng.integers(2))
                y = sessions[i].run(None, {"X": inputs[shape, seed]})[0]
                runs[i] += 1
                if not np.array_equal(y, EXPECTED[shape, seed]):
                    errors.append((i, shape, seed, float(np.abs(y - EXPECTED[shape, seed]).max())))

        threads = [threading.Thread(target=churn, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"  churn: {runs} runs, {len(errors)} wrong outputs", flush=True)
        self.assertEqual(runs, [80, 80])
        self.assertEqual(errors, [], f"outputs differ from the plain CUDA EP: {errors[:5]}")
        del sessions

    def test_the_cuda_eps_external_allocator_options_take_epmem_memory(self):
        # gpu_external_alloc / gpu_external_free / gpu_external_empty_cache:
        # the route for hosts that cannot set session.use_env_allocators.
        lib = ctypes.CDLL(LIB)
        addr = lambda f: str(ctypes.cast(getattr(lib, f), ctypes.c_void_p).value)
        opts = {"gpu_external_alloc": addr("epm_ort_external_alloc"),
                "gpu_external_free": addr("epm_ort_external_free"),
                "gpu_external_empty_cache": addr("epm_ort_external_empty_cache")}
        s = ort.InferenceSession(MODEL, providers=[(CUDA, opts)])
        for shape in SHAPES[:6]:
            y = s.run(None, {"X": x_for(shape)})[0]
            self.assertTrue(np.array_equal(y, EXPECTED[shape, 0]), shape)
        ptr, y = device_output_ptr(s, x_for(SHAPES[3]))
        self.assertTrue(is_vmm(ptr), f"output at {ptr:#x} is not epmem (VMM) memory")
        self.assertTrue(np.array_equal(y, EXPECTED[SHAPES[3], 0]))
        del s

    def test_a_session_with_epmems_ep_and_the_cuda_ep(self):
        dev = next(d for d in ort.get_ep_devices() if d.ep_name == REG)
        so = ort.SessionOptions()
        so.add_session_config_entry("session.use_env_allocators", "1")
        # Memory sharing only: streaming (which would compute the MatMuls
        # with epmem's own GEMM) is tested by tests/ort/test_ort_streaming.py.
        so.add_provider_for_devices([dev], {"stream_weights": "0"})
        so.add_provider(CUDA, {})
        s = ort.InferenceSession(MODEL, sess_options=so)
        self.assertIn(CUDA, s.get_providers())
        y = s.run(None, {"X": x_for(SHAPES[4])})[0]
        self.assertTrue(np.array_equal(y, EXPECTED[SHAPES[4], 0]))
        del s


def main():
    if not LIB or not MODEL:
        sys.exit("set EPMEM_LIB and MODEL")
    print(f"onnxruntime {ort.__version__} from {os.path.dirname(ort.__file__)}, providers {ort.get_available_providers()}", flush=True)
    res = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(CudaEpOnEpmem))
    failed = len(res.failures) + len(res.errors)
    skipped = len(res.skipped)
    print(f"ort-gpu-python: {res.testsRun - failed - skipped} passed, {failed} failed, {skipped} skipped", flush=True)
    sys.exit(1 if failed or res.testsRun == 0 else 0)


if __name__ == "__main__":
    main()
