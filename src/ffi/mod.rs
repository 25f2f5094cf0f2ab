//! STUB: the C ABI layer.
