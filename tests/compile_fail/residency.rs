// The read-fence witness: a program that compiles, and the cases
// tests/compile_fail.rs makes of it by replacing the `@slot` line.
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

// A witness cannot be forged: not by its fields, nor its constructor, nor Default.
// @case E0451 | field `block` of struct `ReadsDone` is private | let note = ReadsDone { block: b };
// @case E0624 | associated function `mint` is private | let note = ReadsDone::mint(b);
// @case E0277 | the trait bound `ReadsDone: Default` is not satisfied | let note: ReadsDone = Default::default();
// Nor duplicated, nor spent twice.
// @case E0599 | no method named `clone` found for struct `ReadsDone` | let note = a_done.clone();
// @case E0382 | moved value: `a_done` | let note = a_done.free();
// A bare block cannot be freed with a witness beside it (A's proof for B), nor without one.
// @case E0599 | no method named `free` found for struct `DeviceBlock` | let note = b.free(a_done);
// @case E0599 | no method named `free` found for struct `DeviceBlock` | let note = b.free();
// A's witness cannot be moved onto B: its block cannot be taken out or replaced.
// @case E0616 | field `block` of struct `ReadsDone` is private | let note = std::mem::replace(&mut a_done.block, b);
// A fenced block gives no way to its memory but the completions above.
// @case E0599 | no method named `free` found for struct `Fenced` | let note = a.free();
