//! Sharing namespaces: who may find whose pinned prefixes by content.
//!
//! Content-hash sharing maps a pinned prefix into any new sequence whose
//! declared tokens begin with the same ids. Across tenants that is a side
//! channel: a request's admission cost and time to first token tell it that
//! someone else already sent the same prompt. A namespace (a per-tenant cache
//! salt) closes it: a prefix belongs to the namespace of the sequence it was
//! pinned from, and a content lookup only ever considers prefixes of the
//! caller's namespace. The namespace is in the seed of the block-chain hash,
//! so a lookup in another namespace does not even reach the same index
//! entries, and every hit is still confirmed by comparing the namespace and
//! the token ids themselves.
//!
//! The default namespace is the empty one (what the calls without a
//! namespace use). Explicit sharing by prefix handle ignores namespaces: the
//! holder of a handle was given it; the new sequence joins the prefix's
//! namespace.

use crate::error::Result;

/// A sharing namespace: at most [`Namespace::MAX_BYTES`] opaque bytes, no NUL.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Namespace(Box<[u8]>);

impl Namespace {
    /// The longest namespace accepted (a tenant id, or a hex digest of one).
    pub const MAX_BYTES: usize = 128;

    /// A namespace from its bytes; empty is the default namespace. Refused
    /// (InvalidArgument, naming the limit or the NUL's position): more than
    /// MAX_BYTES bytes, or a NUL byte (C callers pass a length, and a NUL
    /// inside would make the same salt read differently as a C string).
    pub fn new(bytes: &[u8]) -> Result<Self> {
        crate::ensure!(
            bytes.len() <= Self::MAX_BYTES,
            InvalidArgument,
            "KV namespace: {} bytes exceed the limit of {} bytes",
            bytes.len(),
            Self::MAX_BYTES
        );
        if let Some(i) = bytes.iter().position(|&b| b == 0) {
            crate::bail!(InvalidArgument, "KV namespace: NUL byte at offset {i} (a namespace may not contain NUL)");
        }
        Ok(Self(bytes.into()))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn is_default(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::EpmStatus as Status;

    #[test]
    fn bad_namespaces_are_refused_with_a_message() {
        let long = vec![b'a'; Namespace::MAX_BYTES + 1];
        let e = Namespace::new(&long).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.message().contains("129 bytes exceed the limit of 128"), "{}", e.message());
        let e = Namespace::new(b"ten\0ant").unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.message().contains("NUL byte at offset 3"), "{}", e.message());
        assert!(Namespace::new(&long[..Namespace::MAX_BYTES]).is_ok());
        assert!(Namespace::new(b"").unwrap().is_default());
        assert_ne!(Namespace::new(b"a").unwrap(), Namespace::default());
    }
}
