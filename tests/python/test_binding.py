"""The ctypes binding against include/epmem.h and the library it loads."""

import ctypes
import gc
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest
import weakref

import epmem
from epmem import _lib as L

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER = os.path.join(ROOT, "include", "epmem.h")
TESTING_HEADER = os.path.join(ROOT, "include", "epmem_testing.h")
CC = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
MiB = 1 << 20
TESTING = epmem.testing.available()


def header_text(path=HEADER):
    with open(path) as f:
        return f.read()


def header_functions(path=HEADER):
    """Names of every epm_* function the header declares (comments stripped)."""
    text = re.sub(r"/\*.*?\*/", "", header_text(path), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return set(re.findall(r"\b(epm_\w+)\s*\(", text)) - set(re.findall(r"#define\s+(epm_\w+)", text))


def header_prototypes(path=HEADER):
    """{name: (return type, [argument types])} of every epm_* prototype, as C text."""
    text = re.sub(r"/\*.*?\*/", "", header_text(path), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out = {}
    for ret, name, args in re.findall(r"([\w \*]+?)\b(epm_\w+)\s*\(([^)]*)\)\s*;", text):
        params = [] if args.strip() == "void" else [a.strip() for a in args.split(",")]
        # Drop each parameter's name: the last identifier (every parameter is named).
        out[name] = (" ".join(ret.split()), [re.sub(r"\s*\b\w+$", "", " ".join(p.split())) for p in params])
    return out


def header_typedefs(path=HEADER):
    """Scalar typedefs (`typedef uint64_t EpmDevicePtr;`) and opaque handle
    structs (`typedef struct EpmDevice EpmDevice;`) of a header."""
    text = header_text(path)
    scalars = dict((new, old) for old, new in re.findall(r"typedef\s+(\w+)\s+(\w+)\s*;", text))
    opaque = set(re.findall(r"typedef\s+struct\s+(\w+)\s+\w+", text))
    return scalars, opaque


_C_SCALARS = {"uint8_t": ctypes.c_uint8, "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64,
              "size_t": ctypes.c_size_t, "ptrdiff_t": ctypes.c_ssize_t, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
              "bool": ctypes.c_bool, "EpmStatus": ctypes.c_int, "EpmLogCallback": L.EpmLogCallback}


def ctypes_of(decl, typedefs):
    """The ctypes type a C parameter/return type must be bound as; KeyError
    for a type this mapping does not know (extend it, never skip)."""
    scalars, opaque = typedefs
    d = re.sub(r"\bconst\b", "", decl).replace("*", " * ")
    stars = d.count("*")
    base = " ".join(d.replace("*", " ").split())
    base = re.sub(r"^(struct|enum) ", "", base)
    while base in scalars:
        base = scalars[base]
    structs = {s.__name__: s for s in L.STRUCTS}
    if base == "void":
        t = {0: None, 1: ctypes.c_void_p, 2: ctypes.POINTER(ctypes.c_void_p)}[stars]
        return t
    if base == "char" and stars == 1:
        return ctypes.c_char_p
    if base in opaque and base not in structs:  # a handle: void* in, void** out
        return {1: ctypes.c_void_p, 2: ctypes.POINTER(ctypes.c_void_p)}[stars]
    t = structs[base] if base in structs else _C_SCALARS[base]
    for _ in range(stars):
        t = ctypes.POINTER(t)
    return t


def signature_mismatches(functions, path=HEADER):
    """Every difference between `functions` ((name, restype, argtypes) as in
    _lib.FUNCTIONS) and the header's prototypes, as readable strings."""
    protos, typedefs = header_prototypes(path), header_typedefs(path)
    if path != HEADER:  # the testing header uses the main header's types
        main = header_typedefs(HEADER)
        typedefs = ({**main[0], **typedefs[0]}, main[1] | typedefs[1])
    bad = []
    for name, restype, argtypes in functions:
        if name not in protos:
            bad.append(f"{name}: not declared in {os.path.basename(path)}")
            continue
        ret, params = protos[name]
        want_ret = L.STATUS if re.sub(r"^enum ", "", ret) == "EpmStatus" else ctypes_of(ret, typedefs)
        if restype is not want_ret:
            bad.append(f"{name}: returns {ret} (bind {want_ret}), bound as {restype}")
        if len(params) != len(argtypes):
            bad.append(f"{name}: {len(params)} parameters ({', '.join(params)}), bound with {len(argtypes)}")
            continue
        for i, (c, py) in enumerate(zip(params, argtypes)):
            want = ctypes_of(c, typedefs)
            if py is not want:
                bad.append(f"{name}: parameter {i + 1} is {c} (bind {want.__name__}), bound as {py.__name__}")
    return bad


def header_statuses(path=HEADER):
    """{value: name} of enum EpmStatus."""
    body = re.search(r"enum EpmStatus\s*\{(.*?)\}", re.sub(r"/\*.*?\*/", "", header_text(path), flags=re.S), re.S)
    return {int(v): n for n, v in re.findall(r"(EPM_STATUS_\w+)\s*=\s*(\d+)", body.group(1))}


class HeaderAgreement(unittest.TestCase):
    def test_every_header_function_has_a_binding(self):
        declared = header_functions()
        bound = {name for name, _, _ in L.FUNCTIONS}
        self.assertGreater(len(declared), 50, "the header parse found too few functions")
        self.assertEqual(sorted(declared - bound), [], "functions in include/epmem.h with no line in _lib.FUNCTIONS")
        self.assertEqual(sorted(bound - declared), [], "bindings of functions the header does not declare")

    def test_every_binding_has_the_header_signature(self):
        """Argument and return types of every FUNCTIONS and TESTING_FUNCTIONS
        line against its prototype (a u64 bound as a u32 fails here)."""
        self.assertGreater(len(header_prototypes()), 50, "the prototype parse found too few functions")
        self.assertEqual(set(header_prototypes()), header_functions(), "the prototype parse missed functions")
        self.assertEqual(signature_mismatches(L.FUNCTIONS), [])
        self.assertEqual(signature_mismatches(L.TESTING_FUNCTIONS, TESTING_HEADER), [])

    def test_the_signature_check_sees_a_narrowed_argument(self):
        # The two declarations once narrowed to u32 without a test noticing.
        def narrowed(fns):
            out = []
            for name, ret, args in fns:
                if name == "epm_kv_pool_create":
                    args = [args[0], ctypes.c_uint32, args[2]]
                elif name == "epm_residency_prefetch":
                    args = [args[0], args[1], ctypes.c_uint32, args[3]]
                elif name == "epm_version":
                    ret = ctypes.c_uint64
                out.append((name, ret, args))
            return out
        bad = signature_mismatches(narrowed(L.FUNCTIONS))
        self.assertEqual(len(bad), 3, bad)
        self.assertTrue(any(b.startswith("epm_kv_pool_create: parameter 2 is uint64_t") for b in bad), bad)
        self.assertTrue(any(b.startswith("epm_residency_prefetch: parameter 3 is size_t") for b in bad), bad)
        self.assertTrue(any(b.startswith("epm_version: returns uint32_t") for b in bad), bad)

    def test_status_exceptions_are_exactly_the_header_statuses(self):
        want = {v: n for v, n in header_statuses().items() if v != 0}
        self.assertGreaterEqual(len(want), 15, "the enum EpmStatus parse found too few values")
        self.assertEqual(header_statuses()[0], "EPM_STATUS_OK")
        self.assertEqual(L.EPM_STATUS_OK, 0)
        got = {c.status: "EPM_STATUS_" + re.sub(r"(?<!^)([A-Z])", r"_\1", c.__name__).upper()
               for c in epmem.errors.BY_STATUS.values()}
        self.assertEqual(got, want, "errors.py classes vs enum EpmStatus (value: name)")
        for status, cls in epmem.errors.BY_STATUS.items():
            self.assertEqual(cls.status, status)
            self.assertIs(getattr(epmem.errors, cls.__name__), cls)

    def test_every_testing_header_function_has_an_optional_binding(self):
        declared = header_functions(TESTING_HEADER)
        bound = {name for name, _, _ in L.TESTING_FUNCTIONS}
        self.assertGreaterEqual(len(declared), 5, "the testing header parse found too few functions")
        self.assertEqual(sorted(declared - bound), [],
                         "functions in include/epmem_testing.h with no line in _lib.TESTING_FUNCTIONS")
        self.assertEqual(sorted(bound - declared), [], "testing bindings the testing header does not declare")
        self.assertEqual(bound & {n for n, _, _ in L.FUNCTIONS}, set(), "a function bound as both")
        # Its only struct is the opaque EpmGate: no layout to check.
        self.assertEqual(re.findall(r"typedef struct (Epm\w+) \{", header_text(TESTING_HEADER)), [])

    def test_every_header_struct_is_declared(self):
        text = header_text()
        declared = set(re.findall(r"typedef struct (Epm\w+) \{", text))
        self.assertEqual(declared, {s.__name__ for s in L.STRUCTS})

    def test_struct_layouts_are_read_from_the_header_the_tests_check(self):
        with open(L.header_path()) as f:
            self.assertEqual(f.read(), header_text(), f"{L.header_path()} is not {HEADER}")
        self.assertEqual(set(L.HEADER_STRUCTS), {s.__name__ for s in L.STRUCTS})
        # A class written out by hand (EpmCompressedWeight, for its typed
        # options pointer) has exactly the header's fields too.
        for s in L.STRUCTS:
            want = [(n, ctypes.sizeof(t)) for n, t in L.HEADER_STRUCTS[s.__name__]]
            self.assertEqual([(n, ctypes.sizeof(t)) for n, t in s._fields_], want, s.__name__)

    def test_the_struct_parser_reads_every_field_or_refuses(self):
        ok = L.parse_structs("#define EPM_N 4\ntypedef struct EpmA {\n  /**\n   * doc; with a semicolon\n   */\n"
                             "  size_t size;\n  enum EpmK k;\n  char name[EPM_N];\n  uint8_t b[3];\n  double x;\n} EpmA;\n")
        self.assertEqual([(n, ctypes.sizeof(t)) for n, t in ok["EpmA"]],
                         [("size", 8), ("k", 4), ("name", 4), ("b", 3), ("x", 8)])
        for bad, why in (("int8_t x;", "no ctypes equivalent"), ("char n[EPM_M];", "not a #define"),
                         ("void (*f)(void);", "cannot read field")):
            with self.assertRaisesRegex(ValueError, why):
                L.parse_structs("typedef struct EpmB {\n  size_t size;\n  " + bad + "\n} EpmB;\n")

    def test_every_header_constant_is_declared(self):
        text = re.sub(r"/\*.*?\*/", "", header_text(), flags=re.S)
        defines = set(re.findall(r"#define\s+(EPM_\w+)\s+\S", text))
        enum_values = dict(re.findall(r"^\s*(EPM_\w+)\s*=\s*(\d+)\s*,", text, re.M))
        statuses = {n for n in enum_values if n.startswith("EPM_STATUS_") and n != "EPM_STATUS_OK"}
        others = set(enum_values) - statuses
        self.assertGreater(len(defines), 10)
        self.assertEqual(sorted((defines | others) - set(L.CONSTANTS)), [],
                         "constants in include/epmem.h missing from _lib.py")
        by_value = {c.status: c for c in epmem.errors.BY_STATUS.values()}
        for name in statuses:
            self.assertIn(int(enum_values[name]), by_value, f"{name} has no exception class in errors.py")

    def test_the_loaded_library_exports_every_binding(self):
        self.assertEqual(epmem.lib().missing, [])
        # The testing functions come all together (testing build) or not at all.
        self.assertIn(sorted(epmem.lib().testing_missing), ([], sorted(n for n, _, _ in L.TESTING_FUNCTIONS)))

    def test_versions_agree(self):
        self.assertEqual(epmem.version(), L.EPM_VERSION)
        v = L.EPM_VERSION
        self.assertEqual(epmem.version_string(), f"{v >> 16}.{(v >> 8) & 0xFF}.{v & 0xFF}")

    @unittest.skipIf(CC is None, "no C compiler")
    def test_struct_sizes_offsets_and_constants_match_the_header(self):
        """Compile a C program generated from the ctypes declarations and compare
        every sizeof/offsetof (and every constant) with what Python computes."""
        lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "epmem.h"', "int main(void) {"]
        expect = []
        for s in L.STRUCTS:
            n = s.__name__
            lines.append(f'  printf("{n} %zu %zu\\n", sizeof({n}), _Alignof({n}));')
            expect.append(f"{n} {ctypes.sizeof(s)} {ctypes.alignment(s)}")
            for fname, ftype in s._fields_:
                lines.append(f'  printf("{n}.{fname} %zu %zu\\n", offsetof({n}, {fname}), sizeof((({n} *)0)->{fname}));')
                expect.append(f"{n}.{fname} {getattr(s, fname).offset} {ctypes.sizeof(ftype)}")
        for c in L.CONSTANTS:
            lines.append(f'  printf("{c} %lld\\n", (long long)({c}));')
            expect.append(f"{c} {getattr(L, c)}")
        for t, py in (("EpmDevicePtr", L.EpmDevicePtr), ("EpmWeightId", L.EpmWeightId),
                      ("EpmHostRangeId", L.EpmHostRangeId), ("enum EpmStatus", ctypes.c_int)):
            lines.append(f'  printf("sizeof {t} %zu\\n", sizeof({t}));')
            expect.append(f"sizeof {t} {ctypes.sizeof(py)}")
        lines += ["  return 0;", "}"]
        with tempfile.TemporaryDirectory() as d:
            src, exe = os.path.join(d, "layout.c"), os.path.join(d, "layout")
            with open(src, "w") as f:
                f.write("\n".join(lines) + "\n")
            subprocess.run([CC, "-std=c11", "-Wall", "-Werror", "-I", os.path.dirname(HEADER), src, "-o", exe],
                           check=True, capture_output=True)
            got = subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split("\n")
        mismatches = [(e, g) for e, g in zip(expect, got) if e != g]
        self.assertEqual(len(got) - 1, len(expect))
        self.assertEqual(mismatches, [], "ctypes declaration vs header (python, C)")

    def test_status_classes_match_status_names(self):
        for status, cls in epmem.errors.BY_STATUS.items():
            name = epmem.status_name(status)
            self.assertTrue(name.startswith("EPM_STATUS_"), name)
            # InvalidArgument <-> EPM_STATUS_INVALID_ARGUMENT
            self.assertEqual(re.sub(r"(?<!^)([A-Z])", r"_\1", cls.__name__).upper(), name[len("EPM_STATUS_"):])
        self.assertEqual(epmem.status_name(12345), "EPM_STATUS_UNKNOWN")


class Errors(unittest.TestCase):
    def setUp(self):
        self.dev = epmem.Device()

    def tearDown(self):
        self.dev.close()

    def test_non_ok_status_raises_with_name_and_message(self):
        with epmem.Arena.create_device(self.dev, 64 * MiB) as a:
            with self.assertRaises(epmem.InvalidArgument) as cm:
                a.free(0x1234)
        e = cm.exception
        self.assertIsInstance(e, epmem.EpmError)
        self.assertEqual(e.status, 1)
        self.assertEqual(e.name, "EPM_STATUS_INVALID_ARGUMENT")
        self.assertEqual(e.function, "epm_arena_free")
        self.assertIn("0x1234", e.message)
        self.assertIn(e.message, str(e))

    def test_null_out_pointer_from_raw_call(self):
        with self.assertRaises(epmem.NullPointer) as cm:
            epmem.lib().epm_device_open(0, None)
        self.assertTrue(cm.exception.message)

    def test_bad_config_fields_are_type_errors_and_bad_values_epm_errors(self):
        with self.assertRaises(TypeError):
            epmem.Residency(self.dev, MiB, no_such_field=1)
        with self.assertRaises(epmem.EpmError):
            epmem.Residency(self.dev, 0)
        with self.assertRaises(epmem.InvalidConfig):
            epmem.Device("gpu-of-the-future")

    def test_read_only_host_buffers_are_refused(self):
        ro = memoryview(b"abcd" * 1024).toreadonly()
        with self.assertRaises(TypeError):
            epmem.core.host_address(ro)
        with self.assertRaises(TypeError):
            epmem.Residency(self.dev, MiB).register_weight(ro, 4096)

    @unittest.skipUnless(TESTING, "needs the testing library (EPMEM_LIB=.../libepmem_testing.so)")
    def test_host_buffers(self):
        ro = memoryview(b"abcd" * 1024).toreadonly()
        with self.assertRaises(TypeError):
            epmem.checksum_host(ro)
        data = bytearray(b"\x01\x00\x00\x00" * 4)
        # w[i] * (2i + 1) summed over 4 words of 1: 1 + 3 + 5 + 7
        self.assertEqual(epmem.checksum_host(data), 16)
        self.assertEqual(epmem.checksum_host(bytes(data)), 16)
        self.assertEqual(epmem.checksum_host(mmap.mmap(-1, 4096)), 0)
        arr = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
        self.assertEqual(epmem.checksum_host(arr), 16)
        self.assertEqual(epmem.checksum_host(ctypes.addressof(arr), 16), 16)

    def test_closed_handle_is_a_clean_error(self):
        s = self.dev.stream()
        s.close()
        s.close()  # twice is fine
        self.assertTrue(s.closed)
        with self.assertRaises(epmem.InvalidHandle):
            s.synchronize()

    def test_message_is_per_thread(self):
        seen = {}

        def worker():
            try:
                epmem.lib().epm_kv_admissible(1, 1, 1, None)
            except epmem.NullPointer as e:
                seen["msg"] = e.message

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        self.assertTrue(seen.get("msg"))


class Objects(unittest.TestCase):
    def setUp(self):
        self.dev = epmem.Device()

    def tearDown(self):
        self.dev.close()

    def test_device_info(self):
        info = self.dev.info()
        self.assertIn(info["kind"], ("cuda", "host"))
        want = os.environ.get("EPM_DEVICE", "auto")
        if want in ("cuda", "host"):
            self.assertEqual(info["kind"], want)
        self.assertGreater(info["granularity"], 0)
        free, total = self.dev.mem_info()
        self.assertTrue(0 < free <= total)

    @unittest.skipUnless(TESTING, "needs the testing library (EPMEM_LIB=.../libepmem_testing.so)")
    def test_copies_round_trip_and_checksum_agrees(self):
        data = bytes(range(256)) * 1024
        with self.dev.alloc(len(data)) as mem, self.dev.stream() as s:
            self.dev.memcpy_htod(mem, data)
            back = bytearray(len(data))
            self.dev.memcpy_dtoh(back, mem)
            self.assertEqual(bytes(back), data)
            sums = self.dev.alloc(8)
            self.dev.checksum_async(mem, len(data), s, sums)
            self.dev.memset_d8_async(mem, 7, 4096, s)
            s.synchronize()
            out = bytearray(8)
            self.dev.memcpy_dtoh(out, sums)
            self.assertEqual(int.from_bytes(out, "little"), epmem.checksum_host(data))
            self.dev.memcpy_dtoh(back, mem)
            self.assertEqual(bytes(back[:4096]), b"\x07" * 4096)
            self.assertEqual(bytes(back[4096:]), data[4096:])

    def test_events_time_and_order_streams(self):
        with self.dev.stream() as a, self.dev.stream() as b:
            t0, t1 = self.dev.event(timing=True), self.dev.event(timing=True)
            mem = self.dev.alloc(64 * MiB)
            t0.record(a)
            if TESTING:
                self.dev.spin_async(2000, a)
            else:
                self.dev.memset_d8_async(mem, 1, 64 * MiB, a)
            t1.record(a)
            b.wait_event(t1)
            b.synchronize()
            self.assertTrue(t1.query())
            self.assertGreater(t0.elapsed_ms(t1), 0.5 if TESTING else 0.0)
            mem.close()

    def test_arena_alloc_free_stats(self):
        with epmem.Arena.create_device(self.dev, 64 * MiB) as a:
            x = a.alloc(MiB)
            st = a.stats()
            self.assertEqual(st["live_allocations"], 1)
            self.assertGreaterEqual(st["in_use_bytes"], MiB)
            a.free(x)
            self.assertEqual(a.stats()["live_allocations"], 0)
            self.assertGreaterEqual(a.trim(), 0)
            with self.assertRaises(epmem.OutOfBudget):
                a.alloc(128 * MiB)

    def test_residency_acquire_release_gives_the_bytes(self):
        weights = [bytes([i]) * (MiB // 2) for i in range(6)]
        with epmem.Residency(self.dev, 2 * MiB, coalesce_below_bytes=0) as r, self.dev.stream() as s:
            ids = [r.register_weight(w, len(w)) for w in weights]
            r.declare_cycle(ids)
            for _step in range(3):
                for i, w in zip(ids, weights):
                    p = r.acquire(i, s)
                    out = bytearray(len(w))
                    s.synchronize()
                    self.dev.memcpy_dtoh(out, p)
                    self.assertEqual(bytes(out), w)
                    r.release(i, s)
            r.synchronize()
            st = r.stats()
            self.assertEqual(st["acquires"], 18)
            self.assertEqual(st["registered_weights"], 6)
            self.assertLessEqual(st["peak_resident_bytes"], 2 * MiB)
            with self.assertRaises(epmem.OutOfBudget):
                r.register_weight(b"x" * (3 * MiB), 3 * MiB)
            with self.assertRaises(epmem.InvalidState):
                r.release(ids[0], s)
            r.unregister_weight(ids[0])

    def test_residency_acquire_host_reads_back_without_a_stream_sync(self):
        weights = [bytes([i + 1]) * (MiB // 2) for i in range(6)]
        with epmem.Residency(self.dev, 2 * MiB, coalesce_below_bytes=0) as r:
            ids = [r.register_weight(w, len(w)) for w in weights]
            for _step in range(2):
                for i, w in zip(ids, weights):
                    p = r.acquire_host(i)
                    out = bytearray(len(w))
                    self.dev.memcpy_dtoh(out, p)  # synchronous: the page-in has completed
                    self.assertEqual(bytes(out), w)
                    r.release_host(i)
            self.assertEqual(r.stats()["acquires"], 12)
            self.assertLessEqual(r.stats()["peak_resident_bytes"], 2 * MiB)
            with self.assertRaises(epmem.InvalidState):
                r.release_host(ids[0])
            with self.assertRaises(epmem.InvalidArgument):
                r.acquire_host(12345)

    def test_residency_register_compressed_writes_either_format_and_reads_back(self):
        import random
        import struct
        from epmem import codec
        rng = random.Random(3)
        raw = b"".join(struct.pack("<f", rng.gauss(0, 0.02))[2:] for _ in range(MiB // 2))  # 1 MiB of bf16
        with epmem.Residency(self.dev, 4 * MiB) as r:
            got = {}
            for opts in ({}, {"format_version": 1}, {"k2": 4}):
                wid, info = r.register_compressed(raw, "bf16", min_bytes=0, **opts)
                self.assertTrue(info.coded, info)
                got[tuple(opts.items())] = (info.format_version, info.k2, info.encoded_bytes)
                p = r.acquire_host(wid)
                out = bytearray(len(raw))
                self.dev.memcpy_dtoh(out, p)
                self.assertEqual(bytes(out), raw, opts)
                r.release_host(wid)
            v2, v1, k24 = got[()], got[(("format_version", 1),)], got[(("k2", 4),)]
            self.assertEqual((v2[0], v1[0], v1[1], k24[:2]), (2, 1, 0, (2, 4)), got)
            self.assertLess(v2[2], v1[2], got)  # the default (v2) is the smaller buffer
            with self.assertRaises(epmem.InvalidArgument):
                r.register_compressed(raw, "bf16", min_bytes=0, format_version=1, k2=3)

    def test_residency_host_range_and_prefetch(self):
        buf = mmap.mmap(-1, 4 * MiB)
        buf[:] = b"\x05" * (4 * MiB)
        with epmem.Residency(self.dev, 4 * MiB) as r, self.dev.stream() as s:
            rid = r.register_host_range(buf, len(buf))
            w = r.register_weight(buf, MiB)
            self.assertEqual(r.prefetch([w]), 1)
            p = r.acquire(w, s)
            s.synchronize()
            out = bytearray(16)
            self.dev.memcpy_dtoh(out, p)
            self.assertEqual(bytes(out), b"\x05" * 16)
            r.release(w, s)
            r.synchronize()
            self.assertEqual(r.stats()["bypassed_page_ins"], 1)
            r.unregister_host_range(rid)
            with self.assertRaises(epmem.InvalidArgument):
                r.unregister_host_range(rid)

    def test_copy_engine_and_staging_pool(self):
        src = bytes(range(256)) * 8192
        with epmem.StagingPool(self.dev) as pool, epmem.CopyEngine(pool, slots=2) as eng, \
                self.dev.alloc(len(src)) as dst, self.dev.stream() as s:
            f = eng.htod(dst, src, stream=s)
            f.wait()
            self.assertTrue(f.query())
            f.stream_wait(s)
            f.close()
            eng.htod(dst, src, fence=False)
            eng.synchronize()
            back = bytearray(len(src))
            self.dev.memcpy_dtoh(back, dst)
            self.assertEqual(bytes(back), src)
            st = eng.stats()
            self.assertEqual(st["copies"], 2)
            self.assertEqual(st["htod_bytes"], 2 * len(src))
            self.assertGreaterEqual(pool.stats()["retained_buffers"], 1)
            pool.trim()
            reg_buf = mmap.mmap(-1, MiB)
            with eng.register(reg_buf, MiB):
                eng.htod(dst, reg_buf, MiB).wait()
            with self.assertRaises(epmem.InvalidArgument):
                epmem.CopyEngine(pool, flags=0x80)

    def test_kv_sequences_prefixes_and_costs(self):
        layout = epmem.kv_layout_token_major(4, 2, 64, 2)
        self.assertEqual(layout.token_stride, 4 * 2 * 2 * 64 * 2)
        g = self.dev.info()["granularity"]
        with epmem.KvPool(self.dev, 64 * g) as arena, self.dev.stream() as s:
            toks = list(range(100))
            seq, shared = arena.seq_for_tokens(layout, 1024, toks)
            self.assertEqual(shared, 0)
            seq.prepare_append(100, s)
            info = seq.info()
            self.assertEqual(info["len_tokens"], 100)
            self.assertEqual(info["head_dim"], 64)
            self.assertEqual(info["layout"]["head_dim"], 64)  # the pre-flat name still works
            self.assertEqual(info["token_stride"], layout.token_stride)
            pre = seq.pin(64, s)
            self.assertTrue(pre.info()["pinned"])
            self.assertEqual(arena.find_prefix(layout, toks), 64)
            seq2, shared2 = arena.seq_for_tokens(layout, 1024, toks)
            self.assertEqual(shared2, 64)
            seq3 = pre.commit(64, 512)
            self.assertEqual(seq3.info()["len_tokens"], 64)
            seq3.declare_tokens([1, 2, 3])
            cost = arena.request_cost(layout, 64, 1024)
            self.assertGreater(cost["unshared_bytes"], 0)
            st = arena.stats()
            self.assertEqual(st["sequences"], 3)
            self.assertGreaterEqual(st["hash_hits"], 1)
            adm = epmem.kv_admissible(100, 10, 10)
            self.assertEqual(adm["with_sharing"], 9)
            pre.unpin()
            for x in (seq3, seq2, seq):
                x.close()
            self.assertEqual(arena.stats()["sequences"], 0)

    def test_children_keep_parents_alive(self):
        dev = epmem.Device()
        dev_ref = weakref.ref(dev)
        s = dev.stream()
        a = epmem.Arena.create_device(dev, 32 * MiB)
        del dev
        gc.collect()
        # The stream and the arena hold the Device: not collected, not destroyed.
        self.assertIsNotNone(dev_ref(), "the Device was collected while its stream and arena live")
        self.assertFalse(dev_ref().closed, "the Device was destroyed while its stream and arena live")
        s.synchronize()
        x = a.alloc(4096)
        a.free(x)
        a.close()
        gc.collect()
        self.assertIsNotNone(dev_ref(), "the stream alone must still hold the Device")
        s.close()
        del s, a
        gc.collect()
        # With no child left, nothing holds the Device: collected and destroyed.
        self.assertIsNone(dev_ref(), "the Device outlived its last child")

    def test_native_stream_wrapping(self):
        if self.dev.is_cuda:
            with self.dev.stream() as s:
                native = s.native()
                self.assertNotEqual(native, 0)
                with epmem.Stream.wrap_native(self.dev, native) as w:
                    self.assertEqual(w.native(), native)
                    w.synchronize()
        else:
            with self.assertRaises(epmem.Unsupported):
                epmem.Stream.wrap_native(self.dev, 0x1000)
        with self.assertRaises(epmem.NullPointer):
            epmem.Stream.wrap_native(self.dev, 0)

    def test_log_callback_receives_records(self):
        got = []
        epmem.set_log_callback(lambda level, msg: got.append((level, msg)), epmem.EPM_LOG_LEVEL_TRACE)
        try:
            epmem.Device("auto").close()  # "auto" logs its choice at info level
        finally:
            epmem.set_log_callback(None, epmem.EPM_LOG_LEVEL_WARN)
        self.assertTrue(got, "no log record reached the callback")
        self.assertTrue(all(isinstance(m, str) and 0 < lv <= 5 for lv, m in got))
        with self.assertRaises(epmem.InvalidArgument):
            epmem.set_log_callback(None, 99)

    def test_destructors_at_interpreter_exit_are_safe(self):
        code = ("import epmem, mmap\n"
                "d = epmem.Device(); s = d.stream(); a = epmem.Arena.create_device(d, 1 << 26)\n"
                "r = epmem.Residency(d, 1 << 22); b = mmap.mmap(-1, 1 << 20)\n"
                "w = r.register_weight(b, 1 << 20); r.acquire(w, s)\n"
                "k = epmem.KvPool(d, 16 * d.info()['granularity'])\n"
                "epmem.set_log_callback(lambda l, m: None, epmem.EPM_LOG_LEVEL_TRACE)\n"
                "ev = d.event(); ev.record(s)\n"
                "print('ok')\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.strip(), "ok")
        self.assertNotIn("Traceback", p.stderr)

    def test_onnxruntime_registers_the_packaged_library(self):
        try:
            import onnxruntime as ort
        except ImportError:
            self.skipTest("onnxruntime is not installed")
        name = f"epmem_pkg_{os.getpid()}"
        ort.register_execution_provider_library(name, epmem.get_library_path())
        try:
            devs = [d for d in ort.get_ep_devices() if d.ep_name == name]
            self.assertTrue(devs, "no OrtEpDevice from the packaged library")
            self.assertEqual(devs[0].ep_vendor, "epmem")
            self.assertEqual(devs[0].ep_metadata.get("epmem.device"), self.dev.kind)
        finally:
            ort.unregister_execution_provider_library(name)

    def test_library_path(self):
        path = epmem.get_library_path()
        self.assertTrue(os.path.isabs(path))
        self.assertTrue(os.path.isfile(path))
        self.assertEqual(path, epmem.lib().path)
        if os.environ.get("EPMEM_USE_INSTALLED") == "1" and not os.environ.get("EPMEM_LIB"):
            # The wheel's own copy, next to the installed package (not this tree's python/).
            self.assertEqual(path, os.path.join(os.path.dirname(epmem.__file__), "lib", "libepmem.so"))
            self.assertFalse(epmem.__file__.startswith(os.path.join(ROOT, "python")))


if __name__ == "__main__":
    unittest.main()


class TestingLibrary(unittest.TestCase):
    """include/epmem_testing.h through epmem.testing: usable with the testing
    build, a clear TestingUnavailable with the release one."""

    def setUp(self):
        self.dev = epmem.Device()

    def tearDown(self):
        self.dev.close()

    @unittest.skipIf(TESTING, "the loaded library is the testing build")
    def test_release_library_refuses_with_a_clear_error(self):
        with self.dev.stream() as s:
            for call in (lambda: epmem.checksum_host(b"abcd"), lambda: epmem.testing.checksum_host(b"abcd"),
                         lambda: self.dev.spin_async(10, s), lambda: epmem.testing.hold_async(self.dev, s)):
                with self.assertRaises(epmem.TestingUnavailable) as cm:
                    call()
                self.assertIn("build-testing", str(cm.exception))
                self.assertIn("epm_checksum_host", str(cm.exception))
        self.assertFalse(hasattr(epmem.lib(), "epm_gate_open"))

    @unittest.skipUnless(TESTING, "needs the testing library (EPMEM_LIB=.../libepmem_testing.so)")
    def test_gate_holds_a_stream_until_opened(self):
        with self.dev.stream() as s:
            gate = epmem.testing.hold_async(self.dev, s)
            ev = self.dev.event()
            ev.record(s)
            self.assertFalse(ev.query())
            gate.open()
            ev.synchronize()
            self.assertTrue(ev.query())
            gate.close()

    @unittest.skipUnless(TESTING, "needs the testing library (EPMEM_LIB=.../libepmem_testing.so)")
    def test_panic_poisons_the_handle(self):
        d = epmem.Device()
        with self.assertRaises(epmem.Panic):
            epmem.testing.panic_device(d)
        with self.assertRaises(epmem.InvalidState) as cm:
            d.synchronize()
        self.assertIn("poisoned", cm.exception.message)
        d.close()  # destroy still works on a poisoned handle
        self.dev.synchronize()  # other handles are unaffected
