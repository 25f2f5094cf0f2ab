"""epmem as an ONNX Runtime plugin EP, driven from Python.

    EPMEM_LIB=/abs/path/libepmem.so python3 tests/ort/test_ort_plugin.py

Runs with the stdlib only (plus onnxruntime and numpy), because the GPU
machine has no pytest. EPM_DEVICE selects the device epmem reports
(cuda on a GPU machine, host in CI). Prints "N passed, N failed, N skipped".
"""

import os
import re
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import onnxruntime as ort

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = os.environ.get("EPMEM_LIB", "")
MODEL = os.path.join(HERE, "tiny_matmul_add.onnx")
EXPECT = os.environ.get("EPM_DEVICE", "auto").lower()
NVIDIA = 0x10DE
EPMEM_HOST_VENDOR = 0x0045504D
VERSION = tuple(int(p) for p in ort.__version__.split(".")[:2])
DEFAULT = ort.OrtDeviceMemoryType.DEFAULT
PINNED = ort.OrtDeviceMemoryType.HOST_ACCESSIBLE

_counter = [0]


def unique(stem):
    _counter[0] += 1
    return f"{stem}_{os.getpid()}_{_counter[0]}"


def devices_of(name):
    return [d for d in ort.get_ep_devices() if d.ep_name == name]


class Registered:
    """Register the library under a fresh name for the duration of a `with`."""

    def __init__(self, stem="epmem"):
        self.name = unique(stem)

    def __enter__(self):
        ort.register_execution_provider_library(self.name, LIB)
        return self

    def __exit__(self, *exc):
        ort.unregister_execution_provider_library(self.name)

    def device(self):
        devs = devices_of(self.name)
        assert devs, f"no OrtEpDevice for {self.name}"
        return devs[0]


def model_inputs():
    x = np.random.default_rng(7).standard_normal((2, 4)).astype(np.float32)
    w = np.array([[i - j for j in range(3)] for i in range(4)], dtype=np.float32)
    b = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    return x, x @ w + b


class PluginTests(unittest.TestCase):
    def test_library_path_is_absolute_and_exists(self):
        self.assertTrue(os.path.isabs(LIB) and os.path.isfile(LIB), f"EPMEM_LIB={LIB!r}")

    def test_registers_and_reports_its_device_honestly(self):
        with Registered() as r:
            devs = devices_of(r.name)
            self.assertGreaterEqual(len(devs), 1)
            for d in devs:
                self.assertEqual(d.ep_vendor, "epmem")
                meta = d.ep_metadata
                self.assertIn(meta.get("epmem.device"), ("cuda", "host"))
                self.assertTrue(meta.get("epmem.ordinal", "").isdigit(), meta)
                mi = d.memory_info(DEFAULT)
                pinned = d.memory_info(PINNED)
                self.assertIsNotNone(mi)
                self.assertIsNotNone(pinned)
                self.assertEqual(mi.device_mem_type, DEFAULT)
                self.assertEqual(pinned.device_mem_type, PINNED)
                if meta["epmem.device"] == "cuda":
                    self.assertEqual(mi.device_vendor_id, NVIDIA)
                    self.assertEqual(mi.device_id, int(meta["epmem.ordinal"]))
                    # A GPU hardware device (ORT's, matched by PCI bus id, or
                    # ours), except on 1.23, which cannot create one.
                    binding = meta.get("epmem.hardware_binding")
                    if binding in ("matched", "created"):
                        self.assertEqual(d.device.type, ort.OrtHardwareDeviceType.GPU)
                        self.assertEqual(d.device.vendor_id, NVIDIA)
                    else:
                        self.assertEqual(binding, "cpu-fallback")
                        self.assertLess(VERSION, (1, 24), "1.24+ can create a GPU hardware device")
                        self.assertEqual(d.device.type, ort.OrtHardwareDeviceType.CPU)
                else:
                    # Host memory is never labelled as a GPU's.
                    self.assertEqual(mi.device_vendor_id, EPMEM_HOST_VENDOR)
                    self.assertEqual(d.device.type, ort.OrtHardwareDeviceType.CPU)
            if EXPECT in ("cuda", "host"):
                self.assertEqual({d.ep_metadata["epmem.device"] for d in devs}, {EXPECT})

    def test_copy_host_device_host_is_bit_exact(self):
        with Registered() as r:
            mi = r.device().memory_info(DEFAULT)
            rng = np.random.default_rng(1234)
            # Random bit patterns (NaNs, denormals included): compared as bits.
            bits = rng.integers(0, 2**32, size=(257, 31), dtype=np.uint32)
            src = ort.OrtValue.ortvalue_from_numpy(bits.view(np.float32))
            if VERSION >= (1, 28):
                dev = ort.OrtValue.ortvalue_from_shape_and_type(bits.shape, np.float32, memory_info=mi)
            else:
                self.skipTest("allocating in a plugin EP's memory from Python needs onnxruntime 1.28+")
            dev2 = ort.OrtValue.ortvalue_from_shape_and_type(bits.shape, np.float32, memory_info=mi)
            back = ort.OrtValue.ortvalue_from_numpy(np.zeros_like(bits).view(np.float32))
            ort.copy_tensors([src], [dev], None)
            ort.copy_tensors([dev], [back], None)
            self.assertTrue(np.array_equal(back.numpy().view(np.uint32), bits))
            # device -> device, then back again
            back2 = ort.OrtValue.ortvalue_from_numpy(np.zeros_like(bits).view(np.float32))
            ort.copy_tensors([dev], [dev2], None)
            ort.copy_tensors([dev2], [back2], None)
            self.assertTrue(np.array_equal(back2.numpy().view(np.uint32), bits))

    def test_pinned_memory_round_trip(self):
        if VERSION < (1, 28):
            self.skipTest("needs onnxruntime 1.28+")
        with Registered() as r:
            d = r.device()
            pinned = ort.OrtValue.ortvalue_from_shape_and_type((4096,), np.uint8, memory_info=d.memory_info(PINNED))
            dev = ort.OrtValue.ortvalue_from_shape_and_type((4096,), np.uint8, memory_info=d.memory_info(DEFAULT))
            data = np.random.default_rng(5).integers(0, 256, 4096, dtype=np.uint8)
            out = ort.OrtValue.ortvalue_from_numpy(np.zeros(4096, np.uint8))
            ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(data)], [pinned], None)
            ort.copy_tensors([pinned], [dev], None)
            ort.copy_tensors([dev], [out], None)
            self.assertTrue(np.array_equal(out.numpy(), data))

    def test_session_runs_with_the_ep_added(self):
        with Registered() as r:
            so = ort.SessionOptions()
            so.add_provider_for_devices([r.device()], {})
            sess = ort.InferenceSession(MODEL, sess_options=so)
            x, want = model_inputs()
            (y,) = sess.run(None, {"X": x})
            np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
            del sess

    def test_session_reads_an_input_in_epmem_memory(self):
        if VERSION < (1, 28):
            self.skipTest("needs onnxruntime 1.28+")
        with Registered() as r:
            d = r.device()
            so = ort.SessionOptions()
            so.add_provider_for_devices([d], {})
            sess = ort.InferenceSession(MODEL, sess_options=so)
            x, want = model_inputs()
            xd = ort.OrtValue.ortvalue_from_shape_and_type(x.shape, np.float32, memory_info=d.memory_info(DEFAULT))
            ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(x)], [xd], None)
            io = sess.io_binding()
            io.bind_ortvalue_input("X", xd)
            io.bind_output("Y")
            sess.run_with_iobinding(io)
            np.testing.assert_allclose(io.copy_outputs_to_cpu()[0], want, rtol=1e-6, atol=1e-6)
            del io, sess, xd

    def test_unregister_removes_the_device_and_reregister_works(self):
        name = unique("epmem")
        ort.register_execution_provider_library(name, LIB)
        self.assertTrue(devices_of(name))
        ort.unregister_execution_provider_library(name)
        self.assertFalse(devices_of(name))
        ort.register_execution_provider_library(name, LIB)
        try:
            self.assertTrue(devices_of(name))
        finally:
            ort.unregister_execution_provider_library(name)
        with self.assertRaises(Exception):
            ort.unregister_execution_provider_library(name)

    def test_same_name_twice_is_refused_and_the_first_keeps_working(self):
        with Registered() as r:
            before = len(devices_of(r.name))
            with self.assertRaises(Exception):
                ort.register_execution_provider_library(r.name, LIB)
            self.assertGreaterEqual(before, 1)
            self.assertEqual(len(devices_of(r.name)), before)
            so = ort.SessionOptions()
            so.add_provider_for_devices([r.device()], {})
            x, want = model_inputs()
            np.testing.assert_allclose(ort.InferenceSession(MODEL, sess_options=so).run(None, {"X": x})[0], want, rtol=1e-6)

    def test_same_file_under_two_names_gives_independent_factories(self):
        with Registered("epmem_a") as a, Registered("epmem_b") as b:
            da, db = devices_of(a.name), devices_of(b.name)
            self.assertEqual(len(da), len(db))
            self.assertTrue(da)
        # Unregistering one leaves the other working. (ORT keys its env-level
        # shared allocators by memory device, which both names share, so only
        # per-session allocators are certain to survive: see docs/ORT.md.)
        with Registered("epmem_a") as a:
            b = Registered("epmem_b").__enter__()
            b.__exit__()
            self.assertTrue(devices_of(a.name))
            so = ort.SessionOptions()
            so.add_provider_for_devices([a.device()], {})
            x, want = model_inputs()
            np.testing.assert_allclose(ort.InferenceSession(MODEL, sess_options=so).run(None, {"X": x})[0], want, rtol=1e-6)

    def test_bad_path_is_a_clean_error(self):
        with self.assertRaises(Exception):
            ort.register_execution_provider_library(unique("epmem"), os.path.join(HERE, "no_such_libepmem.so"))

    def test_tensor_released_after_unregister(self):
        if VERSION < (1, 28):
            self.skipTest("needs onnxruntime 1.28+")
        r = Registered().__enter__()
        v = ort.OrtValue.ortvalue_from_shape_and_type((1024,), np.float32, memory_info=r.device().memory_info(DEFAULT))
        r.__exit__()
        del v  # frees through an allocator whose library was unregistered


# Registers the library in a fresh process at a given ORT log severity.
_LOG_CHILD = """
import sys, onnxruntime as ort
ort.set_default_logger_severity(int(sys.argv[2]))
ort.register_execution_provider_library("epmem_log", sys.argv[1])
ort.unregister_execution_provider_library("epmem_log")
"""
# What ORT's own logger prints for a record at INFO: "... [I:onnxruntime:<logid>, <where>] <message>".
_ORT_INFO_LINE = re.compile(r"\[I:onnxruntime:[^\]]*\].*epmem: ONNX Runtime API 1\.\d+: registering")


def _register_logged(severity, epm_log=None):
    env = dict(os.environ)
    env.pop("EPM_LOG", None)
    if epm_log is not None:
        env["EPM_LOG"] = epm_log
    r = subprocess.run([sys.executable, "-c", _LOG_CHILD, LIB, str(severity)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


class LoggingTests(unittest.TestCase):
    """epmem's records reach ORT's logger; EPM_LOG still works under ORT."""

    def test_records_go_to_orts_logger_at_its_severity(self):
        out = _register_logged(1)  # ORT at INFO
        self.assertRegex(out, _ORT_INFO_LINE)
        self.assertNotIn("[epmem ", out, "without EPM_LOG nothing goes to epmem's own stderr sink")

    def test_orts_severity_filters_epmem_records(self):
        out = _register_logged(3)  # ORT at ERROR
        self.assertNotRegex(out, _ORT_INFO_LINE)
        self.assertNotIn("registering", out)

    def test_epm_log_works_under_ort(self):
        out = _register_logged(3, epm_log="info")
        self.assertRegex(out, r"\[epmem INFO [^\]]*\] epmem: ONNX Runtime API 1\.\d+: registering")

    def test_the_footprint_line_reports_the_live_peak_bench_ort_reads(self):
        # scripts/bench_ort.py reads epmem's floor from this line (Python has
        # no AllocatorGetStats): 3 tensors of 1 MiB live at once, then freed.
        if VERSION < (1, 28):
            self.skipTest("needs onnxruntime 1.28+ (OrtValue in a plugin's memory_info)")
        child = """
import sys, numpy as np, onnxruntime as ort
ort.set_default_logger_severity(1)
ort.register_execution_provider_library("epmem_fp", sys.argv[1])
d = [e for e in ort.get_ep_devices() if e.ep_name == "epmem_fp"][0]
mi = d.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
vs = [ort.OrtValue.ortvalue_from_shape_and_type((1 << 18,), np.float32, memory_info=mi) for _ in range(3)]
del vs
one = ort.OrtValue.ortvalue_from_shape_and_type((1 << 18,), np.float32, memory_info=mi)
del one
ort.unregister_execution_provider_library("epmem_fp")
"""
        env = dict(os.environ)
        env.pop("EPM_LOG", None)
        r = subprocess.run([sys.executable, "-c", child, LIB], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
        import bench_ort

        log = os.path.join(tempfile.mkdtemp(), "fp.log")
        with open(log, "w") as f:
            f.write(r.stdout + r.stderr)
        fp = bench_ort.epmem_footprint(log)
        self.assertIsNotNone(fp, r.stdout + r.stderr)
        self.assertEqual(fp["when"], "release")
        self.assertEqual(fp["peak_live_bytes"], 3 << 20, fp)
        self.assertEqual(fp["num_allocs"], 4, fp)
        self.assertGreaterEqual(fp["peak_committed_bytes"], 3 << 20, fp)


def main():
    if not LIB:
        sys.exit("set EPMEM_LIB to the absolute path of libepmem.so")
    print(f"onnxruntime {ort.__version__}, EPM_DEVICE={EXPECT}, library {LIB}", flush=True)
    load = unittest.defaultTestLoader.loadTestsFromTestCase
    res = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(
        unittest.TestSuite([load(PluginTests), load(LoggingTests)]))
    failed = len(res.failures) + len(res.errors)
    skipped = len(res.skipped)
    passed = res.testsRun - failed - skipped
    print(f"ort-python: {passed} passed, {failed} failed, {skipped} skipped", flush=True)
    sys.exit(1 if failed or res.testsRun == 0 else 0)


if __name__ == "__main__":
    main()
