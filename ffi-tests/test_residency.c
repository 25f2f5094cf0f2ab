/*
 * The residency and arena C API: weights paged into a budget arrive
 * bit-exact (checked on the device), the stats add up, and every bad input
 * is a clean status with a message — never a crash. Runs on the device
 * EPM_DEVICE names (host in CI, cuda on a GPU machine).
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

enum { LAYERS = 8, LAYER = 256u << 10 };

/* Page-aligned random weights and their host checksums. */
typedef struct {
  unsigned char *buf;
  uint64_t sums[LAYERS];
} Model;

static int model_new(Model *m) {
  m->buf = aligned_alloc(4096, (size_t)LAYERS * LAYER);
  if (!m->buf) return -1;
  for (int l = 0; l < LAYERS; l++) {
    th_fill_random(m->buf + (size_t)l * LAYER, LAYER, 1000 + l);
    m->sums[l] = epm_checksum_host(m->buf + (size_t)l * LAYER, LAYER);
  }
  return 0;
}

static EpmResidencyConfig config(uint64_t budget) {
  EpmResidencyConfig c;
  c.size = sizeof c;
  epm_residency_config_default(&c);
  c.budget_bytes = budget;
  c.fill_threads = 2;
  c.staging_chunk_bytes = 1u << 20;
  c.staging_pool_bytes = 16u << 20;
  return c;
}

static void test_decode_is_bit_exact_and_stats_add_up(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmResidency *res = NULL;
  EpmDevicePtr slots = 0;
  EpmWeightId ids[LAYERS];
  uint64_t got[LAYERS];
  Model m = {0};
  EpmResidencyConfig cfg = config(3 * LAYER);
  EpmResidencyStats st;

  REQUIRE(model_new(&m) == 0);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_residency_create(dev, &cfg, &res));
  for (int l = 0; l < LAYERS; l++)
    REQUIRE_OK(epm_residency_register_weight(res, m.buf + (size_t)l * LAYER, LAYER, &ids[l]));
  REQUIRE_OK(epm_residency_declare_cycle(res, ids, LAYERS));
  REQUIRE_OK(epm_device_alloc(dev, sizeof got, &slots));
  for (int step = 0; step < 4; step++) {
    for (int l = 0; l < LAYERS; l++) {
      EpmDevicePtr p = 0;
      REQUIRE_OK(epm_residency_acquire(res, ids[l], s, &p));
      CHECK(p != 0);
      REQUIRE_OK(epm_device_checksum_async(dev, p, LAYER, s, slots + 8 * (EpmDevicePtr)l));
      REQUIRE_OK(epm_residency_release(res, ids[l], s));
    }
    REQUIRE_OK(epm_stream_synchronize(s));
    REQUIRE_OK(epm_memcpy_dtoh(dev, got, slots, sizeof got));
    for (int l = 0; l < LAYERS; l++) CHECK(got[l] == m.sums[l]);
  }
  REQUIRE_OK(epm_residency_synchronize(res));
  memset(&st, 0, sizeof st);
  st.size = sizeof st;
  REQUIRE_OK(epm_residency_get_stats(res, &st));
  CHECK(st.size == sizeof st);
  CHECK(st.acquires == 4 * LAYERS);
  /* Every miss is one page-in; prefetches not used (yet) are the rest. */
  CHECK(st.page_ins == st.acquires - st.hits + st.pending_prefetches + st.wasted_prefetches);
  CHECK(st.hits > 0 && st.hits < st.acquires);
  CHECK(st.evictions > 0);
  CHECK(st.resident_bytes <= 3 * LAYER && st.peak_resident_bytes <= 3 * LAYER);
  CHECK(st.budget_bytes == 3 * LAYER);
  CHECK(st.bypassed_page_ins + st.staged_page_ins == st.page_ins);
  CHECK(st.htod_bytes == st.page_ins * (uint64_t)LAYER);
  CHECK(st.registered_weights == LAYERS);
  CHECK(st.arena_driver_alloc_calls >= 1);
  CHECK(st.hit_rate > 0.0 && st.hit_rate < 1.0);
  /* The stream plan's counters: the ring is part of what is resident. */
  CHECK(st.ring_weights <= st.resident_weights && st.ring_bytes <= st.resident_bytes);
  CHECK(st.ring_page_ins <= st.page_ins && st.dropped_rings == 0);
  CHECK(st.planned_resident_bytes + st.ring_bytes <= st.budget_bytes);

cleanup:
  epm_device_free(dev, slots);
  epm_residency_destroy(res);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  free(m.buf);
}

static void test_budget_errors_are_clear(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmResidency *res = NULL;
  EpmWeightId a = 0, b = 0, big = 77;
  EpmDevicePtr p = 0, sentinel = 0xdead;
  Model m = {0};
  EpmResidencyConfig cfg = config(2 * LAYER);

  REQUIRE(model_new(&m) == 0);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_residency_create(dev, &cfg, &res));
  CHECK_STATUS(epm_residency_register_weight(res, m.buf, 3 * LAYER, &big), EPM_STATUS_OUT_OF_BUDGET);
  CHECK(big == 77); /* out-params untouched on failure */
  REQUIRE_OK(epm_residency_register_weight(res, m.buf, 2 * LAYER, &a));
  REQUIRE_OK(epm_residency_register_weight(res, m.buf + 2 * LAYER, LAYER, &b));
  REQUIRE_OK(epm_residency_acquire(res, a, s, &p));
  /* `a` fills the budget and is still acquired: nothing can be evicted. */
  CHECK_STATUS(epm_residency_acquire(res, b, s, &sentinel), EPM_STATUS_ALL_IN_USE);
  CHECK_MESSAGE_HAS("release");
  CHECK(sentinel == 0xdead);
  CHECK_STATUS(epm_residency_unregister_weight(res, a), EPM_STATUS_INVALID_STATE);
  REQUIRE_OK(epm_residency_release(res, a, s));
  CHECK_STATUS(epm_residency_release(res, a, s), EPM_STATUS_INVALID_STATE);
  CHECK_OK(epm_residency_acquire(res, b, s, &p));
  CHECK_OK(epm_residency_release(res, b, s));
  CHECK_OK(epm_residency_unregister_weight(res, a));
  CHECK_STATUS(epm_residency_unregister_weight(res, a), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_residency_acquire(res, a, s, &p), EPM_STATUS_INVALID_ARGUMENT);

cleanup:
  epm_residency_destroy(res);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  free(m.buf);
}

static void test_bad_input(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmResidency *res = NULL, *gone = NULL;
  EpmWeightId w = 0, order[2];
  EpmHostRangeId r = 0;
  EpmDevicePtr p = 0;
  EpmResidencyStats st;
  Model m = {0};
  EpmResidencyConfig cfg = config(4 * LAYER), bad;

  REQUIRE(model_new(&m) == 0);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  CHECK_STATUS(epm_residency_config_default(NULL), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_residency_create(dev, NULL, &res), EPM_STATUS_NULL_POINTER);
  bad = cfg;
  bad.budget_bytes = 0;
  CHECK_STATUS(epm_residency_create(dev, &bad, &res), EPM_STATUS_INVALID_ARGUMENT);
  bad = cfg;
  bad.policy = 9;
  CHECK_STATUS(epm_residency_create(dev, &bad, &res), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("policy");
  bad = cfg;
  bad.register_sources = 5;
  CHECK_STATUS(epm_residency_create(dev, &bad, &res), EPM_STATUS_INVALID_ARGUMENT);
  bad = cfg;
  bad.size = 8;
  CHECK_STATUS(epm_residency_create(dev, &bad, &res), EPM_STATUS_INVALID_ARGUMENT);
  CHECK(res == NULL);
  CHECK_STATUS(epm_residency_create(NULL, &cfg, &res), EPM_STATUS_INVALID_HANDLE);

  REQUIRE_OK(epm_residency_create(dev, &cfg, &res));
  CHECK_STATUS(epm_residency_register_weight(res, NULL, LAYER, &w), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_residency_register_weight(res, m.buf, 0, &w), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_residency_register_weight(res, m.buf, LAYER, NULL), EPM_STATUS_NULL_POINTER);
  REQUIRE_OK(epm_residency_register_weight(res, m.buf, LAYER, &order[0]));
  REQUIRE_OK(epm_residency_register_weight(res, m.buf + LAYER, LAYER, &order[1]));
  CHECK_STATUS(epm_residency_declare_cycle(res, NULL, 2), EPM_STATUS_NULL_POINTER);
  CHECK_OK(epm_residency_declare_cycle(res, NULL, 0));
  w = order[1];
  order[1] = order[0];
  CHECK_STATUS(epm_residency_declare_cycle(res, order, 2), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("twice");
  order[1] = 12345;
  CHECK_STATUS(epm_residency_declare_cycle(res, order, 2), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_residency_prefetch(res, order, 2, NULL), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_residency_acquire(res, 12345, s, &p), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_residency_acquire(res, w, NULL, &p), EPM_STATUS_INVALID_HANDLE);
  CHECK_STATUS(epm_residency_acquire(res, w, s, NULL), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_residency_release(res, w, s), EPM_STATUS_INVALID_STATE);
  /* A stream passed where a residency manager belongs, and the reverse. */
  CHECK_STATUS(epm_residency_acquire((EpmResidency *)s, w, s, &p), EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("EpmResidency");
  CHECK_STATUS(epm_residency_acquire(res, w, (EpmStream *)res, &p), EPM_STATUS_INVALID_HANDLE);
  st.size = 4;
  CHECK_STATUS(epm_residency_get_stats(res, &st), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_residency_get_stats(res, NULL), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_residency_register_host_range(res, NULL, LAYER, &r), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_residency_unregister_host_range(res, 99), EPM_STATUS_INVALID_ARGUMENT);
  {
    size_t issued = 99;
    CHECK_OK(epm_residency_prefetch(res, &w, 1, &issued));
    CHECK(issued == 1);
  }
  CHECK_OK(epm_residency_destroy(NULL));
  gone = res;
  res = NULL;
  CHECK_OK(epm_residency_destroy(gone));
  CHECK_STATUS(epm_residency_destroy(gone), EPM_STATUS_INVALID_HANDLE);
  CHECK_STATUS(epm_residency_acquire(gone, w, s, &p), EPM_STATUS_INVALID_HANDLE);

cleanup:
  epm_residency_destroy(res);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  free(m.buf);
}

static void test_registered_host_range_bypasses_staging(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmResidency *res = NULL;
  EpmWeightId ids[LAYERS];
  EpmHostRangeId r = 0;
  EpmDevicePtr p = 0;
  EpmResidencyStats st;
  Model m = {0};
  EpmResidencyConfig cfg = config(2 * LAYER);

  cfg.register_sources = EPM_REGISTER_NEVER;
  REQUIRE(model_new(&m) == 0);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_residency_create(dev, &cfg, &res));
  REQUIRE_OK(epm_residency_register_host_range(res, m.buf, (size_t)LAYERS * LAYER, &r));
  for (int l = 0; l < LAYERS; l++)
    REQUIRE_OK(epm_residency_register_weight(res, m.buf + (size_t)l * LAYER, LAYER, &ids[l]));
  for (int l = 0; l < LAYERS; l++) {
    REQUIRE_OK(epm_residency_acquire(res, ids[l], s, &p));
    REQUIRE_OK(epm_residency_release(res, ids[l], s));
  }
  REQUIRE_OK(epm_residency_synchronize(res));
  st.size = sizeof st;
  REQUIRE_OK(epm_residency_get_stats(res, &st));
  CHECK(st.page_ins == LAYERS);
  CHECK(st.bypassed_page_ins == LAYERS && st.staged_page_ins == 0);
  CHECK_OK(epm_residency_unregister_host_range(res, r));
  CHECK_STATUS(epm_residency_unregister_host_range(res, r), EPM_STATUS_INVALID_ARGUMENT);

cleanup:
  epm_residency_destroy(res);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  free(m.buf);
}

static void test_arenas(void) {
  EpmDevice *dev = NULL;
  EpmArena *da = NULL, *pa = NULL;
  EpmArenaConfig c;
  EpmArenaStats st;
  uint64_t a = 0, b = 0, h = 0, sentinel = 7, given = 0;

  REQUIRE_OK(epm_device_open(0, &dev));
  c.size = sizeof c;
  REQUIRE_OK(epm_arena_config_default(&c));
  CHECK(c.capacity_bytes == 0);
  CHECK_STATUS(epm_arena_create_device(dev, &c, &da), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE_HAS("capacity");
  c.capacity_bytes = 8u << 20;
  c.chunk_bytes = 2u << 20;
  REQUIRE_OK(epm_arena_create_device(dev, &c, &da));
  REQUIRE_OK(epm_arena_alloc(da, 1000, 0, &a));
  REQUIRE_OK(epm_arena_alloc(da, 5000, 4096, &b));
  CHECK(a % 256 == 0 && b % 4096 == 0 && (a + 1000 <= b || b + 5000 <= a));
  CHECK_STATUS(epm_arena_alloc(da, 0, 0, &sentinel), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_arena_alloc(da, 16, 3, &sentinel), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_arena_alloc(da, 9u << 20, 0, &sentinel), EPM_STATUS_OUT_OF_BUDGET);
  CHECK(sentinel == 7);
  st.size = sizeof st;
  REQUIRE_OK(epm_arena_get_stats(da, &st));
  CHECK(st.live_allocations == 2 && st.alloc_calls == 2 && st.driver_alloc_calls == 1);
  CHECK(st.committed_bytes == 2u << 20 && st.reserved_bytes == 8u << 20);
  CHECK_OK(epm_arena_free(da, a));
  CHECK_STATUS(epm_arena_free(da, a), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_OK(epm_arena_free(da, 0));
  CHECK_OK(epm_arena_free(da, b));
  CHECK_OK(epm_arena_trim(da, &given));
  CHECK(given == 2u << 20);
  REQUIRE_OK(epm_arena_get_stats(da, &st));
  CHECK(st.committed_bytes == 0 && st.driver_free_calls == 1 && st.in_use_bytes == 0);

  c.capacity_bytes = 4u << 20;
  REQUIRE_OK(epm_arena_create_pinned(dev, &c, &pa));
  REQUIRE_OK(epm_arena_alloc(pa, 3000, 0, &h));
  memset((void *)(uintptr_t)h, 0x5a, 3000); /* host-writable */
  CHECK(((unsigned char *)(uintptr_t)h)[2999] == 0x5a);
  CHECK_OK(epm_arena_free(pa, h));
  CHECK_STATUS(epm_arena_get_stats((EpmArena *)dev, &st), EPM_STATUS_INVALID_HANDLE);
  CHECK_OK(epm_arena_destroy(NULL));

cleanup:
  epm_arena_destroy(da);
  epm_arena_destroy(pa);
  epm_device_destroy(dev);
}

int main(void) {
  RUN(test_decode_is_bit_exact_and_stats_add_up);
  RUN(test_budget_errors_are_clear);
  RUN(test_bad_input);
  RUN(test_registered_host_range_bypasses_staging);
  RUN(test_arenas);
  TEST_SUMMARY();
}
