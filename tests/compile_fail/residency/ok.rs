// The program every case in this folder is one line away from: it must
// compile (and run), so no case can fail for an unrelated reason.
use epmem::residency::read_fence::{DeviceBlock, Fenced, ReadsDone, TryReadsDone};

fn give_back(a: Fenced, b: DeviceBlock) -> epmem::Result<()> {
    let a_done: ReadsDone = match a.try_complete()? {
        TryReadsDone::Done(done, _spent) => done,
        TryReadsDone::Pending(a) => a.wait()?.0,
    };
    let note = (); // @slot
    let addr = a_done.addr();
    a_done.free();
    let _ = (note, addr);
    Ok(())
}

fn main() {
    let _ = give_back;
}
