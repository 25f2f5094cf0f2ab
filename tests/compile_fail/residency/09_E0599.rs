// A fenced block gives no way to its memory but the completions above.
// Fails with E0599: no method named `free` found for struct `Fenced`
use epmem::residency::read_fence::{DeviceBlock, Fenced, ReadsDone, TryReadsDone};

fn give_back(a: Fenced, b: DeviceBlock) -> epmem::Result<()> {
    let a_done: ReadsDone = match a.try_complete()? {
        TryReadsDone::Done(done, _spent) => done,
        TryReadsDone::Pending(a) => a.wait()?.0,
    };
    let note = a.free();
    let addr = a_done.addr();
    a_done.free();
    let _ = (note, addr);
    Ok(())
}

fn main() {
    let _ = give_back;
}
