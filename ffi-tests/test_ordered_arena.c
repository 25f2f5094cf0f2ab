/*
 * The stream-ordered arena (epm_ordered_arena_*): a block freed on stream S is
 * reused on S at once and by other streams only after S's queued work has
 * run. A gate (epm_device_hold_async) keeps S's work queued while the test
 * looks, so no check depends on timing; fills queued behind the gate prove
 * with data that no two users ever shared a block.
 *
 * Runs on the device EPM_DEVICE names (host in CI, cuda on a GPU machine).
 */
#define _POSIX_C_SOURCE 200809L /* alarm */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "testhelper.h"

#define MIB (1u << 20)

/* Hold `stream` on a new gate, or say why not and skip the test (a driver
 * without stream memory waits): a skip is printed, never a silent pass. */
#define HOLD_OR_SKIP(dev, stream, gate)                                  \
  do {                                                                  \
    EpmStatus hs_got = epm_device_hold_async(dev, stream, gate);        \
    if (hs_got == EPM_STATUS_UNSUPPORTED) {                             \
      printf("SKIPPED %s: %s\n", __func__, epm_last_error_message());   \
      goto cleanup;                                                     \
    }                                                                   \
    REQUIRE_OK(hs_got);                                                 \
  } while (0)

static EpmOrderedArena *make_arena(EpmDevice *dev, uint64_t capacity) {
  EpmArenaConfig cfg;
  EpmOrderedArena *a = NULL;
  cfg.size = sizeof cfg;
  if (epm_arena_config_default(&cfg) != EPM_STATUS_OK) return NULL;
  cfg.capacity_bytes = capacity;
  if (epm_ordered_arena_create(dev, &cfg, &a) != EPM_STATUS_OK) return NULL;
  return a;
}

/* All `n` bytes at device address `p` equal `v`. */
static int filled_with(EpmDevice *dev, uint64_t p, size_t n, unsigned char v) {
  unsigned char *h = malloc(n);
  int ok = h != NULL && epm_memcpy_dtoh(dev, h, p, n) == EPM_STATUS_OK;
  for (size_t i = 0; ok && i < n; i++) ok = h[i] == v;
  free(h);
  return ok;
}

static void test_a_block_freed_on_a_held_stream_goes_to_that_stream_only(void) {
  EpmDevice *dev = NULL;
  EpmStream *a = NULL, *b = NULL;
  EpmGate *gate = NULL;
  EpmOrderedArena *arena = NULL;
  EpmEvent *done = NULL;
  EpmOrderedArenaStats st;
  uint64_t p = 0, q = 0, r = 0, s = 0, t = 0;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &a));
  REQUIRE_OK(epm_stream_create(dev, &b));
  REQUIRE_OK(epm_event_create(dev, 0, &done));
  REQUIRE((arena = make_arena(dev, 64ull * MIB)) != NULL);

  REQUIRE_OK(epm_ordered_arena_alloc(arena, MIB, a, &p));
  HOLD_OR_SKIP(dev, a, &gate);
  /* a's last use of p, queued behind the gate, then the free on a. */
  REQUIRE_OK(epm_memset_d8_async(dev, p, 0xA1, MIB, a));
  REQUIRE_OK(epm_event_record(done, a));
  CHECK_OK(epm_ordered_arena_free(arena, p, a));

  /* Another stream, and a stream-less caller, must get other memory. */
  REQUIRE_OK(epm_ordered_arena_alloc(arena, MIB, b, &q));
  REQUIRE_OK(epm_ordered_arena_alloc(arena, MIB, NULL, &r));
  CHECK(q != p && r != p);
  CHECK(q + MIB <= p || q >= p + MIB);
  CHECK(r + MIB <= p || r >= p + MIB);
  REQUIRE_OK(epm_memset_d8_async(dev, q, 0xB2, MIB, b));
  /* Stream a itself reuses the block at once: its work runs in order. */
  REQUIRE_OK(epm_ordered_arena_alloc(arena, MIB / 2, a, &s));
  CHECK(s == p);
  CHECK_STATUS(epm_event_query(done), EPM_STATUS_NOT_READY); /* the checks ran while a was held */
  st.size = sizeof st;
  CHECK_OK(epm_ordered_arena_get_stats(arena, &st));
  CHECK(st.same_stream_reuses == 1 && st.stream_frees == 1 && st.stream_allocs == 3);
  CHECK(st.pending_ranges == 1 && st.live_allocations == 3);
  CHECK(st.live_bytes == MIB + MIB + MIB / 2);
  CHECK_OK(epm_ordered_arena_free(arena, s, NULL)); /* NULL: the stream it was allocated on */

  CHECK_OK(epm_gate_open(gate));
  CHECK_OK(epm_stream_synchronize(a));
  CHECK_OK(epm_stream_synchronize(b));
  CHECK(filled_with(dev, p, MIB, 0xA1)); /* a's fill landed in a block nobody else wrote */
  CHECK(filled_with(dev, q, MIB, 0xB2));
  /* a's work has run: the block is everyone's again. */
  REQUIRE_OK(epm_ordered_arena_alloc(arena, MIB, b, &t));
  CHECK(t == p);
  st.size = sizeof st;
  CHECK_OK(epm_ordered_arena_get_stats(arena, &st));
  CHECK(st.pending_ranges == 0 && st.pending_bytes == 0);
  CHECK(st.events_created >= 1 && st.events_recorded == 2);
  CHECK(st.peak_live_bytes == 3 * MIB); /* q, r and t */
  CHECK(st.driver_alloc_calls >= 1 && st.committed_bytes >= 3 * MIB);
  CHECK_OK(epm_ordered_arena_free(arena, t, b));
  CHECK_OK(epm_ordered_arena_free(arena, q, b));
  CHECK_OK(epm_ordered_arena_free(arena, r, NULL));
  CHECK_OK(epm_stream_synchronize(b));

cleanup:
  epm_gate_destroy(gate);
  epm_ordered_arena_destroy(arena);
  epm_event_destroy(done);
  epm_stream_destroy(a);
  epm_stream_destroy(b);
  epm_device_destroy(dev);
}

/* A block allocated with no stream and freed in order on a held stream:
 * the stream named at the free owns the reuse. */
static void test_a_free_is_ordered_on_the_stream_it_names(void) {
  EpmDevice *dev = NULL;
  EpmStream *a = NULL, *b = NULL;
  EpmGate *gate = NULL;
  EpmOrderedArena *arena = NULL;
  uint64_t p = 0, q = 0, s = 0;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &a));
  REQUIRE_OK(epm_stream_create(dev, &b));
  REQUIRE((arena = make_arena(dev, 64ull * MIB)) != NULL);
  REQUIRE_OK(epm_ordered_arena_alloc(arena, 3 * MIB, NULL, &p));
  HOLD_OR_SKIP(dev, a, &gate);
  REQUIRE_OK(epm_memset_d8_async(dev, p, 0xC3, 3 * MIB, a));
  CHECK_OK(epm_ordered_arena_free(arena, p, a));
  REQUIRE_OK(epm_ordered_arena_alloc(arena, 3 * MIB, b, &q));
  CHECK(q + 3 * MIB <= p || q >= p + 3 * MIB);
  REQUIRE_OK(epm_ordered_arena_alloc(arena, MIB, a, &s));
  CHECK(s == p);
  CHECK_OK(epm_gate_open(gate));
  CHECK_OK(epm_stream_synchronize(a));
  CHECK(filled_with(dev, p, 3 * MIB, 0xC3));
  CHECK_OK(epm_ordered_arena_free(arena, s, a));
  CHECK_OK(epm_ordered_arena_free(arena, q, b));
  /* Trim waits for the pending frees, then gives every chunk back. */
  uint64_t given = 0;
  EpmOrderedArenaStats st;
  CHECK_OK(epm_ordered_arena_trim(arena, &given));
  st.size = sizeof st;
  CHECK_OK(epm_ordered_arena_get_stats(arena, &st));
  CHECK(given > 0 && st.committed_bytes == 0 && st.driver_free_calls >= 1);
  CHECK(st.peak_committed_bytes >= 6 * MIB);

cleanup:
  epm_gate_destroy(gate);
  epm_ordered_arena_destroy(arena);
  epm_stream_destroy(a);
  epm_stream_destroy(b);
  epm_device_destroy(dev);
}

/* Steady state on one stream: no driver allocation once warm. */
static void test_steady_reuse_makes_no_driver_calls(void) {
  EpmDevice *dev = NULL;
  EpmStream *a = NULL;
  EpmOrderedArena *arena = NULL;
  EpmOrderedArenaStats st;
  uint64_t p = 0, q = 0, warm = 0;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &a));
  REQUIRE((arena = make_arena(dev, 64ull * MIB)) != NULL);
  for (int i = 0; i < 200; i++) {
    REQUIRE_OK(epm_ordered_arena_alloc(arena, 4096 + (size_t)(i % 7) * 512, a, &p));
    REQUIRE_OK(epm_ordered_arena_alloc(arena, 65536, a, &q));
    REQUIRE_OK(epm_ordered_arena_free(arena, p, NULL));
    REQUIRE_OK(epm_ordered_arena_free(arena, q, NULL));
    if (i == 9) {
      st.size = sizeof st;
      REQUIRE_OK(epm_ordered_arena_get_stats(arena, &st));
      warm = st.driver_alloc_calls;
    }
  }
  st.size = sizeof st;
  REQUIRE_OK(epm_ordered_arena_get_stats(arena, &st));
  CHECK(warm >= 1 && st.driver_alloc_calls == warm);
  CHECK(st.stream_allocs == 400 && st.same_stream_reuses >= 390);
  CHECK(st.events_created <= 2);
  CHECK(st.live_allocations == 0 && st.live_bytes == 0 && st.failed_allocs == 0);
  CHECK(st.alloc_ns > 0 && st.free_ns > 0);
  CHECK_OK(epm_stream_synchronize(a));

cleanup:
  epm_ordered_arena_destroy(arena);
  epm_stream_destroy(a);
  epm_device_destroy(dev);
}

/* The stats struct is versioned: its first size is accepted, one less is not. */
static void test_stats_are_versioned(void) {
  EpmDevice *dev = NULL;
  EpmOrderedArena *arena = NULL;
  EpmOrderedArenaStats st;

  CHECK(sizeof(EpmOrderedArenaStats) >= EPM_ORDERED_ARENA_STATS_SIZE_V1);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE((arena = make_arena(dev, 64ull * MIB)) != NULL);
  memset(&st, 0xEE, sizeof st);
  st.size = EPM_ORDERED_ARENA_STATS_SIZE_V1;
  CHECK_OK(epm_ordered_arena_get_stats(arena, &st));
  CHECK(st.size == EPM_ORDERED_ARENA_STATS_SIZE_V1 && st.alloc_calls == 0 && st.reserved_bytes >= 64ull * MIB);
  st.size = 16;
  CHECK_STATUS(epm_ordered_arena_get_stats(arena, &st), EPM_STATUS_INVALID_ARGUMENT);

cleanup:
  epm_ordered_arena_destroy(arena);
  epm_device_destroy(dev);
}

int main(void) {
  alarm(300); /* a hang (a wait on a held stream) fails the run instead of stalling it */
  RUN(test_a_block_freed_on_a_held_stream_goes_to_that_stream_only);
  RUN(test_a_free_is_ordered_on_the_stream_it_names);
  RUN(test_steady_reuse_makes_no_driver_calls);
  RUN(test_stats_are_versioned);
  TEST_SUMMARY();
}
