// The staging witness: a program that compiles, and the cases
// tests/compile_fail.rs makes of it by replacing the `@slot` line. Each case
// names the error code it must fail with and a fragment of the message
// (the offending name); any other error fails the harness.
use epmem::transfer::witness::{self, CopyCompleted, TryComplete};
use epmem::device::{self, DeviceBuffer, PinnedBuffer, Stream};
use epmem::staging::{PinnedStagingPool, PoolConfig, PooledStaging};

fn main() -> epmem::Result<()> {
    let dev = device::open_from_env(0)?;
    let stream = Stream::new(&dev)?;
    let dst = DeviceBuffer::new(&dev, 4096)?;
    let pool = PinnedStagingPool::new(&dev, PoolConfig::default())?;
    let (a, b) = (pool.acquire(4096)?, pool.acquire(4096)?);
    let mut pinned = PinnedBuffer::new(&dev, 4096)?;
    pinned.fill(7);
    let a_done: CopyCompleted<PooledStaging> = witness::enqueue_htod(&stream, dst.ptr(), a, 4096, None)?.wait()?;
    let b_flight = witness::enqueue_htod(&stream, dst.ptr(), b, 4096, None)?;
    let p_done: CopyCompleted<PinnedBuffer> = witness::enqueue_htod(&stream, dst.ptr(), pinned, 4096, None)?.wait()?;
    let mut spare = pool.acquire(4096)?;
    let note = (); // @slot
    pool.release(a_done);
    let b_done = match b_flight.try_complete()? {
        TryComplete::Done(done) => done,
        TryComplete::Pending(flight) => flight.wait()?,
    };
    pool.release(b_done);
    assert_eq!(p_done[0], 7);
    let _ = note;
    Ok(())
}

// A witness cannot be forged: not by its fields, nor its constructor, nor Default.
// @case E0451 | field `proven` of struct `CopyCompleted` is private | let note = CopyCompleted { proven: spare };
// @case E0624 | associated function `mint` is private | let note = CopyCompleted::mint(spare);
// @case E0277 | the trait bound `CopyCompleted<PooledStaging>: Default` is not satisfied | let note: CopyCompleted<PooledStaging> = Default::default();
// Nor duplicated: no Clone, no Copy (a second use of a moved witness).
// @case E0599 | no method named `clone` found for struct `CopyCompleted<PooledStaging>` | let note = a_done.clone();
// @case E0382 | use of moved value: `a_done` | let note = (a_done, ());
// A bare buffer has no way back into the pool, with or without a witness beside it.
// @case E0308 | expected `CopyCompleted<PooledStaging>`, found `PooledStaging` | let note = pool.release(spare);
// @case E0599 | no method named `retire` found for struct `PooledStaging` | let note = spare.retire(a_done);
// The witness of a copy from another kind of buffer does not fit.
// @case E0308 | expected `CopyCompleted<PooledStaging>`, found `CopyCompleted<PinnedBuffer>` | let note = pool.release(p_done);
// @case E0599 | no method named `retire` found for struct `CopyCompleted<PinnedBuffer>` | let note = p_done.retire();
// A's witness cannot be moved onto B: its buffer cannot be swapped or taken out.
// @case E0596 | cannot borrow data in dereference of `CopyCompleted<PooledStaging>` as mutable | let note = std::mem::swap(&mut *a_done, &mut spare);
// @case E0616 | field `proven` of struct `CopyCompleted` is private | let note = a_done.proven;
// A buffer in flight cannot be touched, freed or retired.
// @case E0608 | cannot index into a value of type `InFlight<PooledStaging>` | let note = b_flight[0];
// @case E0382 | borrow of moved value: `a` | let note = a[0];
// @case E0382 | use of moved value: `b` | let note = drop(b);
// @case E0599 | no method named `retire` found for struct `InFlight<T>` | let note = b_flight.retire();
