//! Weight residency.
