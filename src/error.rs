//! One error type for the whole crate, and the stable status codes C sees.
//!
//! Every layer returns [`Result<T>`]. The FFI layer turns an [`Error`] into an
//! [`EpmStatus`] plus a thread-local message; nothing else is needed to cross
//! the boundary.

use std::fmt;

/// Status codes returned by every fallible `epm_*` function.
///
/// Values are stable and never reused: a retired code stays reserved. Codes
/// are grouped in blocks — 0 success, 1–99 caller errors, 100–199 resource
/// errors, 200–299 device errors, 900+ internal.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EpmStatus {
    /// Success.
    Ok = 0,
    /// An argument is out of range or inconsistent (zero size, bad alignment, bad option).
    InvalidArgument = 1,
    /// A required pointer argument was NULL.
    NullPointer = 2,
    /// A handle is NULL, destroyed, or of the wrong type.
    InvalidHandle = 3,
    /// The operation is not valid in the object's current state (e.g.
    /// unregistering a weight that is acquired, releasing one more often than
    /// it was acquired, or any call on a handle poisoned by an earlier panic).
    InvalidState = 4,
    /// The operation is not supported by this device or build.
    Unsupported = 5,
    /// Asynchronous work has not completed yet; try again later.
    NotReady = 6,
    /// An environment variable or option holds a value epmem does not understand.
    InvalidConfig = 7,
    /// Host memory could not be allocated.
    OutOfHostMemory = 100,
    /// Device memory could not be allocated.
    OutOfDeviceMemory = 101,
    /// A budget (VRAM residency budget, KV ledger budget) cannot hold the request.
    OutOfBudget = 102,
    /// Everything resident is in use: nothing can be evicted right now.
    AllInUse = 103,
    /// No usable device: no CUDA driver, no GPU at this ordinal, or the device failed to open.
    DeviceUnavailable = 200,
    /// A CUDA driver call failed; the message names the call and the CUresult.
    CudaError = 201,
    /// The device refused an access (e.g. a write into a read-only mapping).
    AccessDenied = 202,
    /// The CUDA context is lost (a sticky error): the device must be re-opened.
    ContextLost = 203,
    /// An operating-system call failed; the message names it and errno.
    OsError = 204,
    /// A bug in epmem: an invariant did not hold. Please report it.
    Internal = 900,
    /// A Rust panic was caught at the C boundary. The library state may be inconsistent.
    Panic = 901,
}

/// The crate's error: a status plus a human-readable message.
#[derive(Clone, PartialEq, Eq)]
pub struct Error {
    status: EpmStatus,
    message: String,
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error with the given status and message.
    pub fn new(status: EpmStatus, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }
    /// The stable status code.
    pub fn status(&self) -> EpmStatus {
        self.status
    }
    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
    /// Prefix the message with context, keeping the status.
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }

    pub fn invalid_argument(msg: impl Into<String>) -> Self {
        Self::new(EpmStatus::InvalidArgument, msg)
    }
    pub fn invalid_state(msg: impl Into<String>) -> Self {
        Self::new(EpmStatus::InvalidState, msg)
    }
    pub fn unsupported(msg: impl Into<String>) -> Self {
        Self::new(EpmStatus::Unsupported, msg)
    }
    pub fn internal(msg: impl Into<String>) -> Self {
        Self::new(EpmStatus::Internal, msg)
    }
    pub fn not_ready(msg: impl Into<String>) -> Self {
        Self::new(EpmStatus::NotReady, msg)
    }
    /// An OS call failed; captures `errno` now.
    pub fn last_os_error(call: &str) -> Self {
        let e = std::io::Error::last_os_error();
        let status =
            if e.raw_os_error() == Some(libc::ENOMEM) { EpmStatus::OutOfHostMemory } else { EpmStatus::OsError };
        Self::new(status, format!("{call} failed: {e}"))
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.status, self.message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({:?})", self.message, self.status)
    }
}

impl std::error::Error for Error {}

/// Early-return with an error: `bail!(InvalidArgument, "size {} is zero", n)`.
#[macro_export]
macro_rules! bail {
    ($status:ident, $($arg:tt)*) => {
        return Err($crate::error::Error::new($crate::error::EpmStatus::$status, format!($($arg)*)))
    };
}

/// Check a condition or return an error: `ensure!(n > 0, InvalidArgument, "size is zero")`.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $status:ident, $($arg:tt)*) => {
        if !$cond {
            $crate::bail!($status, $($arg)*);
        }
    };
}
