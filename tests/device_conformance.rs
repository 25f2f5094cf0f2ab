//! The device conformance suite (src/device/conformance), one test per check.
//!
//! Runs on whatever `EPM_DEVICE` selects: the host device under plain
//! `cargo test`, CUDA with `EPM_DEVICE=cuda`. On a GPU, run each test in its
//! own process (`device_conformance-<hash> --exact <name>`) so a check that
//! poisons the CUDA context cannot fail the others.

use std::sync::Arc;

use epmem::device::{self, Device, conformance};

fn open() -> Arc<dyn Device> {
    let dev = device::open_from_env(0).unwrap_or_else(|e| panic!("opening the device from EPM_DEVICE: {e}"));
    eprintln!("device: {}", conformance::describe(&dev));
    dev
}

macro_rules! checks {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            let dev = open();
            if let Err(e) = conformance::$name(&dev) {
                panic!("{} on {}: {e}", stringify!($name), conformance::describe(&dev));
            }
        }
    )*};
}

checks!(
    info_is_consistent,
    copies_are_bit_exact,
    memset_is_exact,
    checksum_matches_host,
    events_order_work_across_streams,
    event_query_synchronize_elapsed,
    spin_delays_a_later_event,
    hold_keeps_work_pending_until_opened,
    stream_destroy_lets_queued_work_finish,
    adopted_native_streams_are_forgotten_not_destroyed,
    granule_aliased_at_two_addresses,
    readonly_write_is_refused_and_non_sticky,
    readonly_postures_in_one_reservation,
    released_handle_stays_alive_while_mapped,
    bad_handles_are_errors,
    bad_device_addresses_are_errors,
    straddling_device_ranges_are_errors,
    live_and_driver_counts_are_exact,
    pinned_and_registered_host_memory,
    decode_is_bit_exact,
    decode_bad_arguments_are_refused,
    decode_pieces_are_bit_exact,
);
