"""epmem: GPU memory machinery for LLM inference (weight residency, VMM arenas,
KV-cache prefix sharing), from Python.

    import epmem
    epmem.get_library_path()          # the bundled libepmem.so (EPMEM_LIB overrides)
    with epmem.Device() as dev:       # EPM_DEVICE=auto|cuda|host picks the kind
        print(dev.info())

The binding is ctypes over the C API (include/epmem.h): no compiled extension.
`epmem.torch` offloads a PyTorch model's weights through a residency manager and
wraps epmem memory (arenas, KV sequences, KV batches) as tensors.
See docs/PYTHON.md.
"""

from . import _lib
from ._lib import (  # noqa: F401  (constants, re-exported)
    EPM_COPY_ENGINE_NO_DIRECT, EPM_COPY_ENGINE_NO_SPLIT_TAIL, EPM_COPY_ENGINE_NO_STREAMING_STORES,
    EPM_COPY_ENGINE_NO_TIMING, EPM_EVENT_TIMING, EPM_FILL_AHEAD_ALL_SLOTS, EPM_KV_ADMIT_ON_DEMAND,
    EPM_KV_ADMIT_PROMISE, EPM_KV_BATCH_ANY_SLOT, EPM_LOG_LEVEL_DEBUG, EPM_LOG_LEVEL_ERROR,
    EPM_LOG_LEVEL_INFO, EPM_LOG_LEVEL_OFF, EPM_LOG_LEVEL_TRACE, EPM_LOG_LEVEL_WARN, EPM_POLICY_CYCLIC,
    EPM_POLICY_LRU, EPM_REGISTER_ALWAYS, EPM_REGISTER_NEVER, EPM_REGISTER_WITHIN_MEMLOCK, EPM_VERSION,
)
from .core import (  # noqa: F401
    Arena, ArenaBlock, CopyEngine, Device, DeviceMemory, Event, Fence, HostRegistration, KvPool, KvBatch,
    KvPrefix, KvSeq, KvSlot, Residency, StagingPool, Stream, checksum_host, kv_admissible,
    kv_layout_token_major, last_error_message, set_log_callback, status_name, version, version_string,
)
from .errors import *  # noqa: F401,F403
from .errors import EpmError, TestingUnavailable  # noqa: F401
from . import testing  # noqa: F401,E402  (include/epmem_testing.h; testing build only)

__version__ = "0.1.0"


def get_library_path():
    """Absolute path of the libepmem.so this package loads: $EPMEM_LIB if set,
    else the copy bundled in the wheel (epmem/lib/libepmem.so). Pass it to
    `onnxruntime.register_execution_provider_library("epmem", ...)`."""
    return _lib.library_path()


def lib():
    """The loaded library (ctypes functions as attributes, e.g. `lib().epm_version()`)."""
    return _lib.lib()
