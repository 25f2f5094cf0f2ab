"""The test machinery of include/epmem_testing.h, from Python.

These functions exist only in the testing build of the library
(`make build-testing`: target/testing/release/libepmem_testing.so; on the GPU
machine .carry/lib-testing/libepmem_testing.so). Point EPMEM_LIB at it before
the first epmem call. With the release library every function here raises
`epmem.TestingUnavailable`, naming what is missing and where the testing build is.

    import epmem.testing as et
    if et.available():
        et.checksum_host(b"...")
"""

from ctypes import byref

from . import _lib as L
from . import core
from .errors import TestingUnavailable


def available():
    """True when the loaded library exports every epmem_testing.h function."""
    return L.lib().has_testing


def lib():
    """The loaded library, checked to be the testing build."""
    lib = L.lib()
    if not lib.has_testing:
        raise TestingUnavailable(
            f"{lib.path} is not the testing build of epmem (it lacks {', '.join(lib.testing_missing)}): "
            "build it with `make build-testing` and set EPMEM_LIB=target/testing/release/libepmem_testing.so "
            "(.carry/lib-testing/libepmem_testing.so on the GPU machine) before the first epmem call")
    return lib


def checksum_host(data, nbytes=None):
    """`epm_checksum_host`: the checksum `checksum_async` computes on the device."""
    p, keep = core.host_address(data)
    r = lib().epm_checksum_host(p, core.buffer_nbytes(data) if nbytes is None else nbytes)
    del keep
    return r


def checksum_async(device, ptr, nbytes, stream, out_dev_ptr):
    """`epm_device_checksum_async`: a u64 checksum of device bytes, written to `out_dev_ptr`."""
    lib().epm_device_checksum_async(device.handle, core._dptr(ptr), nbytes, stream.handle,
                                    core._dptr(out_dev_ptr))


def spin_async(device, micros, stream):
    """`epm_device_spin_async`: keep `stream` busy for about `micros` µs."""
    lib().epm_device_spin_async(device.handle, micros, stream.handle)


def panic_device(device):
    """`epm_testing_panic_device`: a panic inside epmem (the handle is poisoned after)."""
    lib().epm_testing_panic_device(device.handle)


def panic_residency(res):
    lib().epm_testing_panic_residency(res.handle)


def panic_kv_pool(pool):
    lib().epm_testing_panic_kv_pool(pool.handle)


class Gate(core.Handle):
    """`epm_device_hold_async`: `stream` is held (queued work waits) until open()."""

    destroy = "epm_gate_destroy"
    _what = "Gate"

    def __init__(self, device, stream):
        out = core._out_handle()
        lib().epm_device_hold_async(device.handle, stream.handle, byref(out))
        super().__init__(out.value, (device, stream))

    def open(self):
        L.lib().epm_gate_open(self.handle)


def hold_async(device, stream):
    return Gate(device, stream)
