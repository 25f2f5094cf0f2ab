//! STUB: the device conformance suite (written once, run on every device).
