"""Exceptions for epmem's status codes: one class per status, all EpmError.

Each carries `.status` (the integer), `.name` (from `epm_status_name`),
`.message` (from `epm_last_error_message()` right after the failing call) and
`.function` (the C function that failed).
"""


class EpmError(Exception):
    status = None

    def __init__(self, status, name, message, function=""):
        self.status = status
        self.name = name
        self.message = message
        self.function = function
        where = f"{function}: " if function else ""
        super().__init__(f"{where}{name}: {message}" if message else f"{where}{name}")


def _cls(class_name, status):
    return type(class_name, (EpmError,), {"status": status, "__doc__": f"EPM status {status}."})


InvalidArgument = _cls("InvalidArgument", 1)
NullPointer = _cls("NullPointer", 2)
InvalidHandle = _cls("InvalidHandle", 3)
InvalidState = _cls("InvalidState", 4)
Unsupported = _cls("Unsupported", 5)
NotReady = _cls("NotReady", 6)
InvalidConfig = _cls("InvalidConfig", 7)
OutOfHostMemory = _cls("OutOfHostMemory", 100)
OutOfDeviceMemory = _cls("OutOfDeviceMemory", 101)
OutOfBudget = _cls("OutOfBudget", 102)
AllInUse = _cls("AllInUse", 103)
DeviceUnavailable = _cls("DeviceUnavailable", 200)
CudaError = _cls("CudaError", 201)
AccessDenied = _cls("AccessDenied", 202)
ContextLost = _cls("ContextLost", 203)
OsError = _cls("OsError", 204)
Internal = _cls("Internal", 900)
Panic = _cls("Panic", 901)

BY_STATUS = {c.status: c for c in (
    InvalidArgument, NullPointer, InvalidHandle, InvalidState, Unsupported, NotReady, InvalidConfig,
    OutOfHostMemory, OutOfDeviceMemory, OutOfBudget, AllInUse, DeviceUnavailable, CudaError,
    AccessDenied, ContextLost, OsError, Internal, Panic)}


def from_status(status, name, message, function=""):
    """The exception for `status` (a plain EpmError for a code this binding does not know)."""
    return BY_STATUS.get(status, EpmError)(status, name, message, function)



class TestingUnavailable(RuntimeError):
    """A function of include/epmem_testing.h was called, and the loaded
    library is the release build, which does not export it."""


__all__ = ["EpmError", "TestingUnavailable", "from_status"] + [c.__name__ for c in BY_STATUS.values()]
