//! Opaque handles checked against typed, generation-counted tables.
//!
//! C sees `typedef struct EpmDevice EpmDevice;` and holds `EpmDevice*`. The
//! pointer's VALUE is an id, never an address, and epmem never dereferences
//! it:
//!
//! ```text
//!  63  62 ........ 48  47 ........ 24  23 ......... 0
//!  1 | type tag (15)  | generation (24)| slot (24)
//! ```
//!
//! Bit 63 makes every id a non-canonical address on x86-64 and AArch64, so it
//! is never NULL and never a real pointer. Each C type has its own table of
//! `Arc<Object>` slots; a slot's generation is bumped when its handle is
//! destroyed, and freed slots are reused oldest-first, so a destroyed,
//! double-destroyed, wrong-typed or garbage handle is `EPM_STATUS_INVALID_HANDLE`
//! with a message naming the expected type — never undefined behaviour.
//! (A stale handle could only alias a live one after 2^24 reuses of its slot.)
//!
//! Lookups clone the `Arc` under a short lock, so one thread may destroy a
//! handle while another is using it: the user finishes with its own `Arc`.
//!
//! Poisoning: a panic caught at the C boundary may have left the objects the
//! call was using half-updated (their locks are taken with
//! `unwrap_or_else(into_inner)` throughout, so nothing else would notice).
//! Every handle looked up during a call is remembered in a per-thread
//! [`CallScope`]; when the boundary catches a panic it marks each of them
//! poisoned, and from then on every lookup of such a handle is
//! `EPM_STATUS_INVALID_STATE` ("poisoned by an earlier panic"). Only destroy
//! still works on it.
//!
//! Adding a handle type (copy this):
//! ```ignore
//! /// A doc comment: this becomes the C typedef's documentation.
//! pub struct EpmThing {
//!     _opaque: [u8; 0],
//! }
//! impl_handle!(EpmThing => crate::thing::Thing, tag = 0x21);
//! // insert: `out.set(handle::insert::<EpmThing>(Arc::new(thing))?)`
//! // use:      `let thing = try_handle!(thing);`  (an Arc<Thing>)
//! // destroy:  `handle::destroy(thing)`           (NULL is a no-op)
//! ```
//!
//! Tags are allotted in blocks, one per layer, so helpers never collide:
//! 0x01–0x0f ffi/device (0x01 EpmDevice, 0x02 EpmStream, 0x03 EpmEvent),
//! 0x10–0x1f staging, 0x20–0x2f residency, 0x30–0x3f arena, 0x40–0x4f kv,
//! 0x50–0x5f ort, 0x60–0x6f stats/bench. A duplicate tag is still caught at
//! run time: inserting the second type fails with `EPM_STATUS_INTERNAL`.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::error::{EpmStatus, Error, Result};
use crate::slab::{Lookup, Slab};

#[cfg(not(target_pointer_width = "64"))]
compile_error!("epmem handles encode 64-bit ids in pointers");

const MARK: u64 = 1 << 63;
const TAG_SHIFT: u32 = 48;
const TAG_MASK: u64 = 0x7fff;
const GEN_SHIFT: u32 = 24;
const GEN_MASK: u64 = 0xff_ffff;
const SLOT_MASK: u64 = 0xff_ffff;

/// A C handle type (the opaque `Epm*` struct) and what it refers to.
pub trait Handle: Sized + 'static {
    /// What the table holds an `Arc` of.
    type Object: ?Sized + Send + Sync + 'static;
    /// The C type name, for messages ("EpmDevice").
    const NAME: &'static str;
    /// Unique per type, 1..=0x7fff; see the block table above.
    const TAG: u16;
    fn table() -> &'static HandleTable<Self::Object>;
}

/// Implement [`Handle`] for an opaque C type; see the module docs.
macro_rules! impl_handle {
    ($c:ident => $obj:ty, tag = $tag:expr) => {
        impl $crate::ffi::handle::Handle for $c {
            type Object = $obj;
            const NAME: &'static str = stringify!($c);
            const TAG: u16 = $tag;
            fn table() -> &'static $crate::ffi::handle::HandleTable<$obj> {
                static TABLE: $crate::ffi::handle::HandleTable<$obj> = $crate::ffi::handle::HandleTable::new();
                &TABLE
            }
        }
    };
}
pub(crate) use impl_handle;

/// Look up a handle argument: `let dev = try_handle!(dev);` gives an `Arc`,
/// or returns `EPM_STATUS_INVALID_HANDLE` with a message naming the argument.
macro_rules! try_handle {
    ($h:ident) => {
        $crate::ffi::handle::get($h).map_err(|e| e.context(format_args!("argument `{}`", stringify!($h))))?
    };
}
pub(crate) use try_handle;

struct Slot<T: ?Sized> {
    value: Arc<T>,
    /// A call using this handle panicked (see the module docs).
    poisoned: bool,
}

/// The live objects of one handle type: 24-bit slots and generations, the
/// widths the id has room for; slots are reused oldest-first (crate::slab).
pub struct HandleTable<T: ?Sized> {
    slab: Mutex<Slab<Slot<T>>>,
    tag_claimed: OnceLock<std::result::Result<(), String>>,
}

impl<T: ?Sized> HandleTable<T> {
    pub const fn new() -> Self {
        Self { slab: Mutex::new(Slab::new(SLOT_MASK as u32 + 1, GEN_MASK as u32)), tag_claimed: OnceLock::new() }
    }
    fn lock(&self) -> MutexGuard<'_, Slab<Slot<T>>> {
        // Nothing panics while the lock is held, but a poisoned slab is still
        // consistent (every mutation is a single assignment), so keep going.
        self.slab.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: ?Sized> Default for HandleTable<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// Tag → type name, to catch duplicate tags and to name wrong-typed handles.
static TAGS: Mutex<Vec<(u16, &'static str)>> = Mutex::new(Vec::new());

fn claim_tag<H: Handle>() -> Result<()> {
    let claimed = H::table().tag_claimed.get_or_init(|| {
        let mut tags = TAGS.lock().unwrap_or_else(|p| p.into_inner());
        match tags.iter().find(|(t, _)| *t == H::TAG) {
            Some((_, other)) if *other != H::NAME => {
                Err(format!("handle tag {:#x} is used by both {other} and {}", H::TAG, H::NAME))
            }
            Some(_) => Ok(()),
            None if H::TAG == 0 || u64::from(H::TAG) > TAG_MASK => {
                Err(format!("handle tag {:#x} of {} is out of range", H::TAG, H::NAME))
            }
            None => {
                tags.push((H::TAG, H::NAME));
                Ok(())
            }
        }
    });
    claimed.clone().map_err(Error::internal)
}

fn type_name_of_tag(tag: u64) -> Option<&'static str> {
    let tags = TAGS.lock().unwrap_or_else(|p| p.into_inner());
    tags.iter().find(|(t, _)| u64::from(*t) == tag).map(|(_, n)| *n)
}

fn encode<H: Handle>(slot: u32, generation: u32) -> *mut H {
    let id = MARK | (u64::from(H::TAG) << TAG_SHIFT) | (u64::from(generation) << GEN_SHIFT) | u64::from(slot);
    // An id, not an address: no provenance, never dereferenced.
    std::ptr::without_provenance_mut(id as usize)
}

/// Decode and check the type; returns (slot, generation).
fn decode<H: Handle>(ptr: *const H) -> Result<(u32, u32)> {
    let id = ptr.addr() as u64;
    let bad = |why: String| Err(Error::new(EpmStatus::InvalidHandle, why));
    if id == 0 {
        return bad(format!("NULL {} handle", H::NAME));
    }
    if id & MARK == 0 {
        return bad(format!("{id:#x} is not an epmem handle (expected {})", H::NAME));
    }
    let tag = (id >> TAG_SHIFT) & TAG_MASK;
    if tag != u64::from(H::TAG) {
        return match type_name_of_tag(tag) {
            Some(other) => bad(format!("expected an {} handle, got an {other} handle", H::NAME)),
            None => bad(format!("{id:#x} is not an epmem handle (expected {})", H::NAME)),
        };
    }
    Ok(((id & SLOT_MASK) as u32, ((id >> GEN_SHIFT) & GEN_MASK) as u32))
}

fn stale<H: Handle>(ptr: *const H) -> Error {
    Error::new(EpmStatus::InvalidHandle, format!("{} handle {:#x} is stale: it was destroyed", H::NAME, ptr.addr()))
}

/// Insert an object into its table; the returned handle is what C holds.
pub fn insert<H: Handle>(object: Arc<H::Object>) -> Result<*mut H> {
    claim_tag::<H>()?;
    let mut slab = H::table().lock();
    match slab.insert(Slot { value: object, poisoned: false }) {
        Ok((slot, generation)) => Ok(encode::<H>(slot, generation)),
        Err(_) => crate::bail!(OutOfHostMemory, "too many live {} handles ({})", H::NAME, SLOT_MASK + 1),
    }
}

/// The object behind a live handle. Inside a boundary call the handle is
/// remembered, so a panic later in the call poisons it.
pub fn get<H: Handle>(ptr: *const H) -> Result<Arc<H::Object>> {
    let (slot, generation) = decode(ptr)?;
    let slab = H::table().lock();
    match slab.get(slot, generation) {
        Lookup::Live(Slot { poisoned: true, .. }) => Err(Error::new(
            EpmStatus::InvalidState,
            format!(
                "{} handle {:#x} is poisoned by an earlier panic inside a call using it \
                 (that call returned EPM_STATUS_PANIC); its state may be inconsistent: destroy it",
                H::NAME,
                ptr.addr()
            ),
        )),
        Lookup::Live(Slot { value, poisoned: false }) => {
            CallScope::note(H::table(), slot, generation);
            Ok(value.clone())
        }
        Lookup::Stale => Err(stale(ptr)),
        Lookup::Unknown => {
            Err(Error::new(EpmStatus::InvalidHandle, format!("{:#x} is not a live {} handle", ptr.addr(), H::NAME)))
        }
    }
}

/// Remove a handle from its table and return its object (the caller drops it, outside
/// the table lock). NULL is `Ok(None)`: `*_destroy(NULL)` is a no-op.
pub fn remove<H: Handle>(ptr: *const H) -> Result<Option<Arc<H::Object>>> {
    if ptr.is_null() {
        return Ok(None);
    }
    let (slot, generation) = decode(ptr)?;
    let mut slab = H::table().lock();
    match slab.remove(slot, generation) {
        Lookup::Live(s) => Ok(Some(s.value)),
        Lookup::Stale => Err(stale(ptr)),
        Lookup::Unknown => {
            Err(Error::new(EpmStatus::InvalidHandle, format!("{:#x} is not a live {} handle", ptr.addr(), H::NAME)))
        }
    }
}

/// The body of every `epm_*_destroy`: remove and drop. NULL is a no-op.
/// The object itself lives on while other handles still hold it (a stream
/// keeps its device alive), so C may destroy handles in any order.
pub fn destroy<H: Handle>(ptr: *mut H) -> Result<()> {
    drop(remove(ptr)?);
    Ok(())
}

/// Whether a live handle is poisoned (see the module docs). False for a
/// dead or foreign handle.
pub fn is_poisoned<H: Handle>(ptr: *const H) -> bool {
    let Ok((slot, generation)) = decode(ptr) else { return false };
    let slab = H::table().lock();
    matches!(slab.get(slot, generation), Lookup::Live(Slot { poisoned: true, .. }))
}

/// A table seen through its type-erased poison switch.
trait Poison: Sync {
    fn poison(&self, slot: u32, generation: u32);
}

impl<T: ?Sized + Send + Sync> Poison for HandleTable<T> {
    fn poison(&self, slot: u32, generation: u32) {
        let mut slab = self.lock();
        if let Lookup::Live(s) = slab.get_mut(slot, generation) {
            s.poisoned = true;
        }
    }
}

thread_local! {
    /// Handles looked up by the boundary calls running on this thread
    /// (nested calls stack: each scope owns the entries after its mark).
    static USED: std::cell::RefCell<Vec<(&'static dyn Poison, u32, u32)>> = const { std::cell::RefCell::new(Vec::new()) };
    static DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The handles one boundary call looked up; see the module docs. Created by
/// `ffi_boundary!` on entry; [`CallScope::poison_used`] when it caught a panic.
pub struct CallScope {
    mark: usize,
}

impl CallScope {
    pub fn enter() -> Self {
        DEPTH.with(|d| d.set(d.get() + 1));
        Self { mark: USED.with(|u| u.borrow().len()) }
    }

    fn note<T: ?Sized + Send + Sync + 'static>(table: &'static HandleTable<T>, slot: u32, generation: u32) {
        if DEPTH.with(|d| d.get()) > 0 {
            // try_borrow: never panic here, even if a lookup ran inside a
            // Drop during a poisoning pass.
            USED.with(|u| {
                if let Ok(mut u) = u.try_borrow_mut() {
                    u.push((table, slot, generation));
                }
            });
        }
    }

    /// Mark every handle this call looked up as poisoned.
    pub fn poison_used(&self) {
        let used: Vec<_> = USED.with(|u| u.borrow_mut().drain(self.mark..).collect());
        for (reg, slot, generation) in used {
            reg.poison(slot, generation);
        }
    }
}

impl Drop for CallScope {
    fn drop(&mut self) {
        USED.with(|u| {
            if let Ok(mut u) = u.try_borrow_mut() {
                u.truncate(self.mark);
            }
        });
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Number of live handles of one type (leak checks in tests).
pub fn live_count<H: Handle>() -> usize {
    H::table().lock().len()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub struct EpmTestA {
        _opaque: [u8; 0],
    }
    pub struct EpmTestB {
        _opaque: [u8; 0],
    }
    pub struct EpmTestDup {
        _opaque: [u8; 0],
    }
    impl_handle!(EpmTestA => String, tag = 0x7f01);
    impl_handle!(EpmTestB => dyn Fn() -> u32 + Send + Sync, tag = 0x7f02);
    impl_handle!(EpmTestDup => u8, tag = 0x7f01);

    fn status_of<T>(r: Result<T>) -> EpmStatus {
        match r {
            Ok(_) => EpmStatus::Ok,
            Err(e) => e.status(),
        }
    }

    #[test]
    fn insert_get_destroy_then_stale() {
        let h = insert::<EpmTestA>(Arc::new("a".to_owned())).unwrap();
        assert!(!h.is_null());
        assert_eq!(*get(h).unwrap(), "a");
        destroy(h).unwrap();
        let e = get(h).unwrap_err();
        assert_eq!(e.status(), EpmStatus::InvalidHandle);
        assert!(e.message().contains("EpmTestA") && e.message().contains("destroyed"), "{e}");
        // Double destroy is an error, not UB and not a no-op.
        assert_eq!(status_of(destroy(h)), EpmStatus::InvalidHandle);
    }

    #[test]
    fn reused_slot_does_not_revive_a_stale_handle() {
        let old = insert::<EpmTestA>(Arc::new("old".into())).unwrap();
        destroy(old).unwrap();
        let mut fresh = Vec::new();
        for i in 0..64 {
            fresh.push(insert::<EpmTestA>(Arc::new(format!("new{i}"))).unwrap());
        }
        assert_eq!(status_of(get(old)), EpmStatus::InvalidHandle);
        for h in fresh {
            assert!(get(h).unwrap().starts_with("new"));
            destroy(h).unwrap();
        }
    }

    #[test]
    fn wrong_type_and_garbage_are_named() {
        let a = insert::<EpmTestA>(Arc::new("a".into())).unwrap();
        let b = insert::<EpmTestB>(Arc::new(|| 7u32)).unwrap();
        assert_eq!((get(b).unwrap())(), 7);
        let e = get::<EpmTestB>(a.cast()).err().unwrap();
        assert_eq!(e.status(), EpmStatus::InvalidHandle);
        assert!(e.message().contains("expected an EpmTestB handle, got an EpmTestA handle"), "{e}");
        let garbage = std::ptr::without_provenance_mut::<EpmTestA>(0xdead_beef);
        let e = get(garbage).unwrap_err();
        assert!(e.message().contains("not an epmem handle") && e.message().contains("EpmTestA"), "{e}");
        let e = get(std::ptr::null_mut::<EpmTestA>()).unwrap_err();
        assert_eq!(e.status(), EpmStatus::InvalidHandle);
        assert!(e.message().contains("NULL EpmTestA"), "{e}");
        // A well-formed id for a slot that never existed.
        let never = encode::<EpmTestA>(0xff_fff0, 1);
        assert_eq!(status_of(get(never)), EpmStatus::InvalidHandle);
        destroy(a).unwrap();
        destroy(b).unwrap();
    }

    #[test]
    fn a_panic_poisons_the_handles_its_call_used_and_only_those() {
        let used = insert::<EpmTestA>(Arc::new("used".into())).unwrap();
        let bystander = insert::<EpmTestA>(Arc::new("bystander".into())).unwrap();
        let s = crate::ffi::panic::status_boundary(|| {
            let _ = get(bystander)?; // looked up in another call: see below
            Ok(())
        });
        assert_eq!(s, EpmStatus::Ok);
        let s = crate::ffi::panic::status_boundary(|| {
            let v = get(used)?;
            if v.len() == 4 {
                panic!("inside a call using the handle");
            }
            Ok(())
        });
        assert_eq!(s, EpmStatus::Panic);
        assert!(is_poisoned(used) && !is_poisoned(bystander));
        let e = get(used).unwrap_err();
        assert_eq!(e.status(), EpmStatus::InvalidState);
        assert!(e.message().contains("EpmTestA") && e.message().contains("poisoned by an earlier panic"), "{e}");
        assert_eq!(*get(bystander).unwrap(), "bystander");
        // Destroy still works, and the slot's next handle starts clean.
        destroy(used).unwrap();
        assert_eq!(status_of(get(used)), EpmStatus::InvalidHandle);
        let fresh: Vec<_> = (0..4).map(|i| insert::<EpmTestA>(Arc::new(format!("f{i}"))).unwrap()).collect();
        for h in fresh {
            assert!(!is_poisoned(h) && get(h).is_ok());
            destroy(h).unwrap();
        }
        destroy(bystander).unwrap();
    }

    #[test]
    fn lookups_outside_a_boundary_are_not_remembered() {
        let h = insert::<EpmTestA>(Arc::new("plain".into())).unwrap();
        let _ = get(h).unwrap();
        USED.with(|u| assert!(u.borrow().is_empty()));
        destroy(h).unwrap();
    }

    #[test]
    fn destroy_null_is_noop() {
        destroy(std::ptr::null_mut::<EpmTestA>()).unwrap();
    }

    #[test]
    fn object_outlives_destroy_while_in_use() {
        let h = insert::<EpmTestA>(Arc::new("held".into())).unwrap();
        let held = get(h).unwrap();
        destroy(h).unwrap();
        assert_eq!(*held, "held");
    }

    #[test]
    fn duplicate_tag_is_an_internal_error() {
        let _a = insert::<EpmTestA>(Arc::new("a".into())).unwrap();
        let e = insert::<EpmTestDup>(Arc::new(1)).unwrap_err();
        assert_eq!(e.status(), EpmStatus::Internal);
        assert!(e.message().contains("EpmTestA") && e.message().contains("EpmTestDup"), "{e}");
    }
}
