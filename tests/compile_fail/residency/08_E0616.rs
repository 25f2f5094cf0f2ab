// A's witness cannot be moved onto B: its block cannot be taken out or replaced.
// Fails with E0616: field `block` of struct `ReadsDone` is private
use epmem::residency::read_fence::{DeviceBlock, Fenced, ReadsDone, TryReadsDone};

fn give_back(a: Fenced, b: DeviceBlock) -> epmem::Result<()> {
    let a_done: ReadsDone = match a.try_complete()? {
        TryReadsDone::Done(done, _spent) => done,
        TryReadsDone::Pending(a) => a.wait()?.0,
    };
    let note = std::mem::replace(&mut a_done.block, b);
    let addr = a_done.addr();
    a_done.free();
    let _ = (note, addr);
    Ok(())
}

fn main() {
    let _ = give_back;
}
