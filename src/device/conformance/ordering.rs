//! Streams and events: ordering across streams, query/synchronize/elapsed,
//! the spin kernel, stream teardown with queued work.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{assert_same, download, no_leaks, random_bytes};
use crate::device::{Device, DeviceBuffer, Event, PinnedBuffer, Stream};
use crate::error::{EpmStatus, Result};

/// The spin whose elapsed time is measured. "Still pending" is not left to
/// it: the stream is held on a gate the check opens itself (a spin alone
/// made pending a race with the scheduler of a loaded machine).
const LONG_SPIN_US: u32 = 300_000;
/// Opens a check's gate only if a call that must not block did block: the
/// check then fails (`Watchdog::fired`) instead of hanging.
const WATCHDOG: Duration = Duration::from_secs(60);

/// Hold `s` on `gate`; `false` (printed, so a skip is never a silent pass)
/// where the device cannot hold a stream (a CUDA driver or GPU without
/// stream memory waits): the check that needs the hold is then skipped.
fn hold(dev: &Arc<dyn Device>, s: &Stream, gate: &crate::device::Gate, check: &str) -> Result<bool> {
    match dev.hold_async(s.raw(), gate) {
        Ok(()) => Ok(true),
        Err(e) if e.status() == EpmStatus::Unsupported => {
            eprintln!("SKIPPED {check}: this device cannot hold a stream: {e}");
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Stream A is held on a gate, then copies 64 MiB and records an event;
/// stream B waits on the event and reads A's destination. B must see A's
/// data (it would see zeros if it ran early), B's work must still be pending
/// while A is held, and the wait must not block the host.
pub fn events_order_work_across_streams(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "events_order_work_across_streams", || {
        let n = 64 << 20;
        let (a, b) = (Stream::new(dev)?, Stream::new(dev)?);
        let buf = DeviceBuffer::new(dev, n)?;
        let copy = DeviceBuffer::new(dev, n)?;
        dev.memset_d8_async(buf.ptr(), 0, n, a.raw())?;
        a.synchronize()?;
        let mut src = PinnedBuffer::new(dev, n)?;
        fastrand::Rng::with_seed(0xA11CE).fill(&mut src);
        let mut dst = PinnedBuffer::new(dev, n)?;
        let ev = Event::new(dev, false)?;

        let gate = crate::device::Gate::new();
        let wd = gate.watchdog(WATCHDOG);
        if !hold(dev, &a, &gate, "events_order_work_across_streams")? {
            return Ok(());
        }
        // SAFETY: `src` and `dst` live until both streams are synchronized below.
        unsafe { dev.memcpy_htod_async(buf.ptr(), src.as_ptr(), n, a.raw())? };
        ev.record(&a)?;
        b.wait_event(&ev)?;
        dev.memcpy_dtod_async(copy.ptr(), buf.ptr(), n, b.raw())?;
        // SAFETY: as above.
        unsafe { dev.memcpy_dtoh_async(dst.as_mut_ptr(), copy.ptr(), n, b.raw())? };
        let b_done = Event::new(dev, false)?;
        b_done.record(&b)?;
        assert!(!wd.fired(), "stream_wait_event blocked the host until the watchdog opened A's gate");
        assert!(!b_done.query()?, "stream B's work completed while the event it waits on was held");
        gate.open();
        b.synchronize()?;
        assert!(ev.query()?, "stream B finished but the event it waited on is not complete");
        assert_same("stream B's copy of stream A's 64 MiB", &dst, &src);
        a.synchronize()
    })
}

/// query is true for a never-recorded event and false while recorded work
/// runs; elapsed never blocks (NotReady while pending); after synchronize
/// both are complete and elapsed covers the work; re-recording moves an event.
pub fn event_query_synchronize_elapsed(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "event_query_synchronize_elapsed", || {
        let s = Stream::new(dev)?;
        let never = Event::new(dev, false)?;
        assert!(never.query()?, "an event never recorded must be complete");
        never.synchronize()?;

        let (start, end) = (Event::new(dev, true)?, Event::new(dev, true)?);
        let gate = crate::device::Gate::new();
        let wd = gate.watchdog(WATCHDOG);
        start.record(&s)?;
        if !hold(dev, &s, &gate, "event_query_synchronize_elapsed")? {
            return Ok(());
        }
        dev.spin_async(LONG_SPIN_US, s.raw())?;
        end.record(&s)?;
        assert!(!end.query()?, "an event behind a closed gate completed");
        match end.elapsed_since(&start) {
            Ok(ms) => panic!("elapsed returned {ms} ms for an event behind a closed gate"),
            Err(e) => assert_eq!(e.status(), EpmStatus::NotReady, "elapsed on a pending event: {e}"),
        }
        assert!(!wd.fired(), "query or elapsed blocked until the watchdog opened the gate");
        gate.open();
        end.synchronize()?;
        assert!(end.query()? && start.query()?, "events not complete after event_synchronize");
        let ms = end.elapsed_since(&start)?;
        let want = LONG_SPIN_US as f32 / 1000.0;
        // The span also covers the gate's wait (host time): only the floor is
        // the spin's, the ceiling is a sanity bound.
        assert!(ms >= 0.7 * want && ms < 60_000.0 + 20.0 * want, "elapsed {ms} ms around a {want} ms spin");

        // Re-recording captures the newer work.
        start.record(&s)?;
        dev.spin_async(30_000, s.raw())?;
        end.record(&s)?;
        s.synchronize()?;
        let again = end.elapsed_since(&start)?;
        assert!(again >= 21.0 && again < ms, "re-recorded events measured {again} ms around a 30 ms spin");

        let plain = Event::new(dev, false)?;
        plain.record(&s)?;
        s.synchronize()?;
        assert!(plain.elapsed_since(&start).is_err(), "elapsed with an event created without timing must fail");
        Ok(())
    })
}

/// A spin of N µs delays the event recorded after it by about N µs.
pub fn spin_delays_a_later_event(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "spin_delays_a_later_event", || {
        let s = Stream::new(dev)?;
        let (e0, e1) = (Event::new(dev, true)?, Event::new(dev, true)?);
        for micros in [5_000u32, 50_000] {
            e0.record(&s)?;
            dev.spin_async(micros, s.raw())?;
            e1.record(&s)?;
            e1.synchronize()?;
            let ms = e1.elapsed_since(&e0)?;
            let want = micros as f32 / 1000.0;
            assert!(ms >= 0.7 * want && ms < 20.0 * want + 500.0, "a {want} ms spin delayed the next event by {ms} ms");
        }
        Ok(())
    })
}

/// Destroying a stream lets its queued work finish (an event recorded on it
/// still completes, the data arrives), and destroying an idle stream returns.
pub fn stream_destroy_lets_queued_work_finish(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "stream_destroy_lets_queued_work_finish", || {
        let n = 1 << 20;
        let buf = DeviceBuffer::new(dev, n)?;
        let mut src = PinnedBuffer::new(dev, n)?;
        src.copy_from_slice(&random_bytes(0xDE57, n));
        let ev = Event::new(dev, false)?;
        {
            let s = Stream::new(dev)?;
            dev.spin_async(20_000, s.raw())?;
            // SAFETY: `src` lives until `ev` (recorded after this copy) is synchronized below.
            unsafe { dev.memcpy_htod_async(buf.ptr(), src.as_ptr(), n, s.raw())? };
            ev.record(&s)?;
        }
        ev.synchronize()?;
        let reader = Stream::new(dev)?;
        assert_same("data copied by a destroyed stream", &download(dev, &reader, buf.ptr(), n)?, &src);
        let t = Instant::now();
        drop(Stream::new(dev)?);
        assert!(t.elapsed() < Duration::from_secs(5), "destroying an idle stream took {:?}", t.elapsed());
        Ok(())
    })
}

/// A native stream adopted with `stream_wrap_native` orders work like any
/// stream, and destroying the adopted handle only forgets it: the native
/// stream (here, one of ours) keeps working. The host device has no native
/// streams and says so.
pub fn adopted_native_streams_are_forgotten_not_destroyed(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "adopted_native_streams_are_forgotten_not_destroyed", || {
        let owner = Stream::new(dev)?;
        let native = dev.stream_native(owner.raw())?;
        if dev.info().kind == crate::device::DeviceKind::Host {
            let e = dev.stream_wrap_native(native).expect_err("the host device has no native streams");
            assert_eq!(e.status(), EpmStatus::Unsupported, "{e}");
            return Ok(());
        }
        let adopted = dev.stream_wrap_native(native)?;
        assert_eq!(dev.stream_native(adopted)?, native, "an adopted stream reports its native handle");
        let n = 1 << 20;
        let buf = DeviceBuffer::new(dev, n)?;
        let data = random_bytes(0xAD0, n);
        // SAFETY: `data` outlives the copy (the adopted stream is synchronized next).
        let r = unsafe { dev.memcpy_htod_async(buf.ptr(), data.as_ptr(), n, adopted) };
        let sync = dev.stream_synchronize(adopted);
        dev.stream_destroy(adopted)?;
        r.and(sync)?;
        assert!(dev.stream_synchronize(adopted).is_err(), "a forgotten adopted stream is still usable");
        assert_same("a copy on an adopted stream", &download(dev, &owner, buf.ptr(), n)?, &data);
        Ok(())
    })
}

/// A hold orders by an event the test controls: work queued behind it (and
/// on a stream waiting on an event behind it) stays pending, with its data
/// not yet written, until the gate opens; then it completes. No wall clock
/// decides the outcome (the watchdog only turns a wrongly blocking call into
/// a failure instead of a hang).
pub fn hold_keeps_work_pending_until_opened(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "hold_keeps_work_pending_until_opened", || {
        let (a, b) = (Stream::new(dev)?, Stream::new(dev)?);
        let n = 4096;
        let buf = DeviceBuffer::new(dev, n)?;
        dev.memset_d8_async(buf.ptr(), 1, n, a.raw())?;
        a.synchronize()?;
        let gate = crate::device::Gate::new();
        let wd = gate.watchdog(Duration::from_secs(60));
        if !hold(dev, &a, &gate, "hold_keeps_work_pending_until_opened")? {
            return Ok(());
        }
        dev.memset_d8_async(buf.ptr(), 2, n, a.raw())?;
        let (on_a, on_b) = (Event::new(dev, false)?, Event::new(dev, false)?);
        on_a.record(&a)?;
        b.wait_event(&on_a)?;
        on_b.record(&b)?;
        assert!(!on_a.query()?, "an event behind a closed gate completed");
        assert!(!on_b.query()?, "an event ordered after a closed gate completed");
        gate.open();
        on_b.synchronize()?;
        assert!(on_a.query()?, "b passed its wait before a's event completed");
        assert_eq!(download(dev, &b, buf.ptr(), n)?, vec![2u8; n], "the memset behind the gate ran once opened");
        assert!(!wd.fired(), "a query or record blocked on the held stream until the watchdog opened it");
        a.synchronize()
    })
}
