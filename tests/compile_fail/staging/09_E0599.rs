// The witness of a copy from another kind of buffer does not fit.
// Fails with E0599: no method named `retire` found for struct `CopyCompleted<PinnedBuffer>`
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
    let note = p_done.retire();
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
