// A witness cannot be forged: not by its fields, nor its constructor, nor Default.
// Fails with E0624: associated function `mint` is private
use epmem::residency::read_fence::{DeviceBlock, Fenced, ReadsDone, TryReadsDone};

fn give_back(a: Fenced, b: DeviceBlock) -> epmem::Result<()> {
    let a_done: ReadsDone = match a.try_complete()? {
        TryReadsDone::Done(done, _spent) => done,
        TryReadsDone::Pending(a) => a.wait()?.0,
    };
    let note = ReadsDone::mint(b);
    let addr = a_done.addr();
    a_done.free();
    let _ = (note, addr);
    Ok(())
}

fn main() {
    let _ = give_back;
}
