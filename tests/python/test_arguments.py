"""Python argument mistakes: each is a TypeError or ValueError saying what was
expected, raised before any C call, never a crash, a ctypes internal or a
value wrapped into a huge unsigned number; and the library's own bounds
(arena capacity, device names) as Python sees them."""

import gc
import inspect
import mmap
import unittest
import weakref

import epmem
from epmem import core

MiB = 1 << 20
U64_MAX = (1 << 64) - 1


class Buf(bytearray):
    """A bytearray that can be weakly referenced (to see when it is freed)."""


class BufferLengths(unittest.TestCase):
    """A buffer and a length given together are checked against each other."""

    def setUp(self):
        self.dev = epmem.Device()
        self.s = self.dev.stream()

    def tearDown(self):
        self.s.close()
        self.dev.close()

    def test_register_weight_longer_than_its_buffer_is_refused(self):
        with epmem.Residency(self.dev, 8 * MiB) as r:
            for n in (1 << 30, 4 * MiB, 17):
                with self.assertRaises(ValueError) as cm:
                    r.register_weight(bytearray(16), n)
                self.assertIn(f"nbytes {n} exceeds the 16 bytes of host (bytearray)", str(cm.exception))
            self.assertEqual(r.stats()["registered_weights"], 0)
            # Exactly the buffer, or less of it, is fine; nbytes defaults to all of it.
            w = r.register_weight(bytearray(b"\x07" * 16), 16)
            w2 = r.register_weight(bytearray(b"\x08" * 4096))
            p = r.acquire_host(w2)
            out = bytearray(4096)
            self.dev.memcpy_dtoh(out, p)
            self.assertEqual(bytes(out), b"\x08" * 4096)
            r.release_host(w2)
            r.unregister_weight(w)

    def test_register_host_range_and_copy_engine_check_lengths(self):
        buf = bytearray(MiB)
        with epmem.Residency(self.dev, 8 * MiB) as r:
            with self.assertRaises(ValueError):
                r.register_host_range(buf, 2 * MiB)
        with epmem.StagingPool(self.dev) as pool, epmem.CopyEngine(pool, fill_threads=1) as eng, \
                self.dev.alloc(MiB) as dst:
            with self.assertRaises(ValueError):
                eng.register(buf, MiB + 1)
            with self.assertRaises(ValueError):
                eng.htod(dst, buf, MiB + 4096)
            with self.assertRaises(ValueError) as cm:
                eng.htod(dst, bytearray(2 * MiB))  # more than the DeviceMemory holds
            self.assertIn("exceeds the 1048576 bytes of dst (DeviceMemory)", str(cm.exception))

    def test_copies_check_both_sides(self):
        with self.dev.alloc(4096) as mem:
            with self.assertRaises(ValueError):
                self.dev.memcpy_htod(mem, bytes(16), 4096)
            with self.assertRaises(ValueError):
                self.dev.memcpy_dtoh(bytearray(16), mem, 4096)
            with self.assertRaises(ValueError):
                self.dev.memcpy_htod(mem, bytes(8192))
            with self.assertRaises(ValueError):
                self.dev.memcpy_htod_async(mem, bytearray(64), 128, self.s)
            with self.assertRaises(ValueError):
                self.dev.memcpy_dtoh_async(bytearray(64), mem, 128, self.s)
            with self.assertRaises(TypeError) as cm:
                self.dev.memcpy_dtoh(bytes(4096), mem)  # immutable destination
            self.assertIn("writable", str(cm.exception))
            with self.assertRaises(TypeError):
                self.dev.memcpy_htod(mem, 0x1000)  # a raw address needs nbytes
            data = bytes(range(256)) * 16
            self.dev.memcpy_htod(mem, data)
            back = bytearray(4096)
            self.dev.memcpy_dtoh(back, mem)
            self.assertEqual(bytes(back), data)
        with self.assertRaises(ValueError) as cm:
            self.dev.memcpy_htod(mem, bytes(16))  # closed memory
        self.assertIn("closed", str(cm.exception))

    def test_a_registered_buffer_is_kept_alive_and_pinned(self):
        r = epmem.Residency(self.dev, 8 * MiB)
        buf = Buf(b"\x5a" * MiB)
        ref = weakref.ref(buf)
        w = r.register_weight(buf)
        with self.assertRaises(BufferError):
            buf.extend(b"x")  # would move the registered bytes
        del buf
        gc.collect()
        self.assertTrue(ref() is not None, "the registered buffer was collected")
        p = r.acquire_host(w)
        out = bytearray(MiB)
        self.dev.memcpy_dtoh(out, p)
        self.assertEqual(bytes(out), b"\x5a" * MiB)
        r.release_host(w)
        r.unregister_weight(w)
        gc.collect()
        self.assertTrue(ref() is None, "the buffer outlived its registration")
        kept = bytearray(4096)
        r.unregister_weight(r.register_weight(kept))
        kept.extend(b"x")  # unregistered: free to move again
        m = mmap.mmap(-1, MiB)
        rid = r.register_host_range(m)
        with self.assertRaises(BufferError):
            m.close()
        r.unregister_host_range(rid)
        m.close()
        # Closing the manager lets go of whatever is still registered.
        buf2 = Buf(4096)
        ref2 = weakref.ref(buf2)
        r.register_weight(buf2)
        del buf2
        r.close()
        gc.collect()
        self.assertTrue(ref2() is None, "closing the manager kept its buffer")


class Sizes(unittest.TestCase):
    """Negative or non-integer sizes are refused in Python, before C sees them."""

    def setUp(self):
        self.dev = epmem.Device()

    def tearDown(self):
        self.dev.close()

    def test_negative_and_non_integer_sizes(self):
        for bad, exc in ((-1, ValueError), (1.5, TypeError), ("4096", TypeError), (None, TypeError),
                         (True, TypeError), (1 << 64, ValueError)):
            for call in (lambda: self.dev.alloc(bad), lambda: self.dev.alloc_raw(bad),
                         lambda: epmem.Arena.create_device(self.dev, bad),
                         lambda: epmem.Arena.create_pinned(self.dev, bad),
                         lambda: epmem.Residency(self.dev, bad), lambda: epmem.KvPool(self.dev, bad),
                         lambda: epmem.StagingPool(self.dev, max_bytes=bad),
                         lambda: epmem.kv_admissible(bad, 1, 1)):
                with self.assertRaises(exc, msg=f"{bad!r}") as cm:
                    call()
                self.assertNotIsInstance(cm.exception, epmem.EpmError)
        with self.assertRaises(ValueError) as cm:
            self.dev.alloc(-1)
        self.assertEqual(str(cm.exception), "nbytes must be >= 0, got -1")
        with self.assertRaises(ValueError) as cm:
            epmem.Residency(self.dev, -1)
        self.assertEqual(str(cm.exception), "budget_bytes must be >= 0, got -1")
        with epmem.Arena.create_device(self.dev, 64 * MiB) as a:
            with self.assertRaises(ValueError):
                a.alloc(-4096)
            with self.assertRaises(ValueError):
                a.alloc(4096, align=-1)
            with self.assertRaises(TypeError):
                a.block(2.0)

    def test_u32_arguments_are_range_checked(self):
        with epmem.Residency(self.dev, 8 * MiB) as r:
            for ids in ([-1], [1 << 32], [1.0], "ab", 3):
                with self.assertRaises((TypeError, ValueError), msg=repr(ids)):
                    r.declare_cycle(ids)
            with self.assertRaises(ValueError):
                r.acquire_host(1 << 32)
        with self.assertRaises(ValueError):
            epmem.kv_layout_token_major(4, 2, 64, -2)
        g = self.dev.info()["granularity"]
        layout = epmem.kv_layout_token_major(4, 2, 64, 2)
        with epmem.KvPool(self.dev, 16 * g) as pool:
            with self.assertRaises(ValueError) as cm:
                pool.seq_for_tokens(layout, 64, [1, 2, -3])
            self.assertIn("tokens[2] must be >= 0", str(cm.exception))
            with self.assertRaises(ValueError):
                pool.find_prefix(layout, [1 << 32])
        with self.dev.alloc(4096) as mem, self.dev.stream() as s:
            with self.assertRaises(ValueError):
                self.dev.memset_d8_async(mem, 256, 4096, s)

    def test_c_messages_name_the_argument_and_the_limit_in_bytes(self):
        limit = (1 << 40) - 256
        with self.assertRaises(epmem.InvalidArgument) as cm:
            epmem.Arena.create_device(self.dev, 1 << 41)
        self.assertIn(f"capacity_bytes {1 << 41} exceeds the limit of {limit} bytes", cm.exception.message)
        with self.assertRaises(epmem.InvalidArgument) as cm:
            epmem.Residency(self.dev, U64_MAX)
        self.assertIn(f"budget_bytes {U64_MAX}", cm.exception.message)
        self.assertIn(f"limit of {limit} bytes", cm.exception.message)


class ArenaBound(unittest.TestCase):
    def test_capacity_bytes_is_the_bound_from_python(self):
        with epmem.Device() as dev:
            for pinned in (False, True):
                with epmem.Arena(dev, 8 * MiB, pinned=pinned) as a:
                    for n in (16 * MiB, 12 * MiB):
                        with self.assertRaises(epmem.OutOfBudget, msg=f"{n} bytes, pinned={pinned}"):
                            a.alloc(n)
                    x, y = a.alloc(6 * MiB), a.alloc(2 * MiB)
                    with self.assertRaises(epmem.OutOfBudget):
                        a.alloc(256)
                    st = a.stats()
                    self.assertEqual(st["in_use_bytes"], 8 * MiB)
                    self.assertLessEqual(st["committed_bytes"], 8 * MiB)
                    a.free(x)
                    a.free(y)


class ArgumentTypes(unittest.TestCase):
    """Wrong objects get a TypeError naming what was expected."""

    def setUp(self):
        self.dev = epmem.Device()
        self.s = self.dev.stream()

    def tearDown(self):
        self.s.close()
        self.dev.close()

    def test_device_select_must_be_a_name(self):
        with self.assertRaises(TypeError) as cm:
            epmem.Device(3)
        self.assertIn("select must be 'auto', 'cuda', 'host' or None, got int 3", str(cm.exception))
        self.assertIn("Device(ordinal=3)", str(cm.exception))
        for bad in ("gpu", "cpu", "", " host"):
            with self.assertRaises(epmem.InvalidConfig, msg=repr(bad)) as cm:
                epmem.Device(bad)
            self.assertIn("is not one of", cm.exception.message)
        epmem.Device("HOST").close()
        with self.assertRaises(ValueError):
            epmem.Device("host", -1)

    def test_residency_acquire_checks_weight_and_stream(self):
        with epmem.Residency(self.dev, 8 * MiB) as r:
            w = r.register_weight(bytearray(4096))
            with self.assertRaises(TypeError) as cm:
                r.acquire(w, None)
            self.assertEqual(str(cm.exception), "stream must be an epmem.Stream, got None")
            with self.assertRaises(TypeError) as cm:
                r.acquire("w", self.s)
            self.assertEqual(str(cm.exception), "weight must be an int, got str 'w'")
            with self.assertRaises(TypeError):
                r.acquire(w, self.dev)  # a Device is not a Stream
            with self.assertRaises(TypeError):
                r.release(w, 0)
            p = r.acquire(w, self.s)
            self.assertNotEqual(p, 0)
            r.release(w, self.s)

    def test_free_accepts_what_alloc_returns(self):
        mem = self.dev.alloc(4096)
        self.dev.free(mem)
        self.assertTrue(mem.closed)
        self.dev.free(mem)  # already closed: as close(), a no-op
        raw = self.dev.alloc_raw(4096)
        self.dev.free(raw)
        with epmem.Device() as other:
            theirs = other.alloc(4096)
            with self.assertRaises(ValueError):
                self.dev.free(theirs)
            theirs.close()
        with self.assertRaises(TypeError):
            self.dev.free("0x1000")
        with epmem.Arena.create_device(self.dev, 64 * MiB) as a:
            b = a.block(4096)
            a.free(b)
            self.assertTrue(b.closed)
            a.free(a.alloc(4096))

    def test_every_handle_argument_is_type_checked(self):
        layout = epmem.kv_layout_token_major(4, 2, 64, 2)
        g = self.dev.info()["granularity"]
        ev = self.dev.event()
        with epmem.KvPool(self.dev, 16 * g) as pool:
            calls = [
                lambda: ev.record(None), lambda: ev.record(ev), lambda: self.s.wait_event(self.s),
                lambda: ev.elapsed_ms(None), lambda: epmem.Event(self.dev, timing="yes"),
                lambda: epmem.Stream(None), lambda: epmem.Arena.create_device("dev", MiB),
                lambda: epmem.Residency(None, MiB), lambda: epmem.CopyEngine(self.dev),
                lambda: pool.seq(None, 64), lambda: pool.seq(layout.__dict__, 64),
                lambda: pool.batch(layout, 64, 2).take_shared_slot(None, 0, self.s),
                lambda: epmem.KvPool(pool, g), lambda: epmem.set_log_callback("print"),
                lambda: self.dev.memcpy_htod("dst", b"x"), lambda: self.dev.memcpy_htod(0x1000, object()),
            ]
            for i, call in enumerate(calls):
                with self.assertRaises(TypeError, msg=f"call {i}") as cm:
                    call()
                self.assertNotIn("wrong type", str(cm.exception), f"call {i}")  # ctypes' own words
                self.assertIn("must be", str(cm.exception), f"call {i}")
        ev.close()


class Lifetimes(unittest.TestCase):
    def test_handles_are_finalized_with_weakref_finalize(self):
        for cls in (core.Resource, core.Handle, epmem.Device, epmem.DeviceMemory, epmem.KvBatch):
            self.assertFalse(hasattr(cls, "__del__"), cls.__name__)
        dev = epmem.Device()
        a = epmem.Arena.create_device(dev, 32 * MiB)
        fin = a._finalizer
        self.assertIsInstance(fin, weakref.finalize)
        ref = weakref.ref(a)
        del a
        gc.collect()
        self.assertIsNone(ref(), "the arena object is kept alive (a finalizer that refers to it?)")
        self.assertFalse(fin.alive, "the arena was not destroyed when collected")
        m = dev.alloc(4096)
        mfin = m._finalizer
        del m
        self.assertFalse(mfin.alive)
        dev.close()

    def test_closing_twice_and_destroy_errors(self):
        dev = epmem.Device()
        s = dev.stream()
        s.close()
        s.close()
        with self.assertRaises(epmem.InvalidHandle):
            s.synchronize()
        dev.close()


class PublicApiTypeHints(unittest.TestCase):
    def test_public_functions_and_methods_are_annotated(self):
        missing = []
        for name in dir(epmem):
            obj = getattr(epmem, name)
            if getattr(obj, "__module__", None) != "epmem.core" or name.startswith("_"):
                continue
            members = [(name, obj)] if inspect.isfunction(obj) else [
                (f"{name}.{m}", f) for m, f in vars(obj).items()
                if (inspect.isfunction(f) or isinstance(f, classmethod)) and (not m.startswith("_") or m == "__init__")]
            for qual, f in members:
                f = f.__func__ if isinstance(f, classmethod) else f
                sig = inspect.signature(f)
                for p in list(sig.parameters.values())[1 if qual.count(".") else 0:]:
                    if p.annotation is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) \
                            and not p.name.startswith("_"):
                        missing.append(f"{qual}({p.name})")
                if sig.return_annotation is inspect.Signature.empty and not qual.endswith("__init__"):
                    missing.append(f"{qual} -> ?")
        self.assertEqual(missing, [])


if __name__ == "__main__":
    unittest.main()
