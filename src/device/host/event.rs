//! Events of the host device: a marker op on a stream. Recording captures
//! (stream, sequence); the event has completed once that stream's completed
//! sequence reaches it. Timing events are stamped by the marker when it runs.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::stream::{Op, StreamShared, lock};
use crate::error::{Error, Result};

#[derive(Debug, Default)]
struct EventState {
    /// The stream and sequence captured by the last record.
    rec: Option<(Arc<StreamShared>, u64)>,
    /// Bumped by every record, so a stale marker does not stamp a newer record.
    generation: u64,
    /// When the marker of the current record ran (timing events).
    at: Option<Instant>,
}

#[derive(Debug, Default)]
pub(super) struct EventShared {
    pub timing: bool,
    state: Mutex<EventState>,
}

impl EventShared {
    pub fn new(timing: bool) -> Self {
        Self { timing, state: Mutex::default() }
    }

    pub fn record(self: &Arc<Self>, s: &Arc<StreamShared>) -> Result<()> {
        // The event lock is held across the push so the marker cannot stamp
        // before `rec` names it; the worker never holds its queue lock while
        // taking an event lock, so this order cannot deadlock.
        let mut st = lock(&self.state);
        let generation = st.generation + 1;
        let seq = s.push(Op::Mark { ev: self.clone(), generation })?;
        st.generation = generation;
        st.at = None;
        st.rec = Some((s.clone(), seq));
        Ok(())
    }

    /// Run by the marker on the stream thread: note when the recorded work
    /// completed, unless the event has been recorded again since.
    pub fn stamp(&self, generation: u64) {
        let mut st = lock(&self.state);
        if st.generation == generation {
            st.at = Some(Instant::now());
        }
    }

    /// (stream, sequence) still pending, or None when complete.
    pub fn pending(&self) -> Option<(Arc<StreamShared>, u64)> {
        let st = lock(&self.state);
        st.rec.as_ref().filter(|(s, seq)| !s.is_done(*seq)).map(|(s, seq)| (s.clone(), *seq))
    }

    pub fn synchronize(&self) {
        if let Some((s, seq)) = self.pending() {
            s.wait_for(seq);
        }
    }

    /// The completion instant, or NotReady / InvalidState. Never blocks.
    pub fn completed_at(&self) -> Result<Instant> {
        crate::ensure!(self.timing, InvalidArgument, "event was created without timing");
        let st = lock(&self.state);
        let Some((s, seq)) = &st.rec else {
            crate::bail!(InvalidState, "event was never recorded");
        };
        if !s.is_done(*seq) {
            return Err(Error::not_ready("event has not completed yet"));
        }
        st.at.ok_or_else(|| Error::internal("completed timing event has no timestamp"))
    }
}
