// A bare block cannot be freed with a witness beside it (A's proof for B), nor without one.
// Fails with E0599: no method named `free` found for struct `DeviceBlock`
use epmem::residency::read_fence::{DeviceBlock, Fenced, ReadsDone, TryReadsDone};

fn give_back(a: Fenced, b: DeviceBlock) -> epmem::Result<()> {
    let a_done: ReadsDone = match a.try_complete()? {
        TryReadsDone::Done(done, _spent) => done,
        TryReadsDone::Pending(a) => a.wait()?.0,
    };
    let note = b.free();
    let addr = a_done.addr();
    a_done.free();
    let _ = (note, addr);
    Ok(())
}

fn main() {
    let _ = give_back;
}
