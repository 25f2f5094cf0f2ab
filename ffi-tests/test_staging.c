/*
 * The staging pool and copy engine from C: page-ins arrive bit-exact through
 * the staged and the direct path, a fence orders another stream without a
 * host wait, the steady state makes no pinned allocations, and bad input is
 * a clean status. Runs on the device EPM_DEVICE names (host in CI, cuda on a
 * GPU machine).
 */
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

#define MIB ((size_t)1 << 20)

/* An engine with 1 MiB slots, so modest sizes cross several chunks and slots. */
static EpmStatus small_engine(EpmStagingPool *pool, EpmCopyEngine **out) {
  EpmCopyEngineConfig cfg;
  cfg.size = sizeof cfg;
  EpmStatus st = epm_copy_engine_config_default(&cfg);
  if (st != EPM_STATUS_OK) return st;
  cfg.chunk_bytes = MIB;
  cfg.fill_threads = 4;
  return epm_copy_engine_create(pool, &cfg, out);
}

static void test_staged_copies_are_bit_exact(void) {
  static const size_t SIZES[] = {1, 4096 + 12, MIB + 4, 9 * MIB + 3};
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmStagingPool *pool = NULL;
  EpmCopyEngine *eng = NULL;
  EpmFence *fence = NULL;
  EpmDevicePtr d = 0;
  unsigned char *src = NULL, *dst = NULL;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_staging_pool_create(dev, 0, 0, &pool));
  REQUIRE_OK(small_engine(pool, &eng));
  for (size_t i = 0; i < sizeof SIZES / sizeof SIZES[0]; i++) {
    size_t n = SIZES[i];
    src = malloc(n);
    dst = malloc(n);
    REQUIRE(src && dst);
    th_fill_random(src, n, 300 + i);
    memset(dst, 0, n);
    REQUIRE_OK(epm_device_alloc(dev, n, &d));
    /* Ordered on `s` both ways: the read-back on `s` sees the copy. */
    REQUIRE_OK(epm_copy_engine_htod(eng, d, src, n, s, &fence));
    REQUIRE_OK(epm_memcpy_dtoh_async(dev, dst, d, n, s));
    REQUIRE_OK(epm_stream_synchronize(s));
    CHECK_OK(epm_fence_query(fence));
    CHECK(memcmp(src, dst, n) == 0);
    CHECK_OK(epm_fence_destroy(fence));
    fence = NULL;
    CHECK_OK(epm_device_free(dev, d));
    d = 0;
    free(src);
    free(dst);
    src = dst = NULL;
  }
  REQUIRE_OK(epm_copy_engine_synchronize(eng));
  EpmStagingStats st;
  st.size = sizeof st;
  REQUIRE_OK(epm_copy_engine_get_stats(eng, &st));
  CHECK(st.size == sizeof st);
  CHECK(st.copies == 4 && st.bypassed == 0);
  CHECK(st.htod_bytes == 1 + 4096 + 12 + MIB + 4 + 9 * MIB + 3);
  CHECK(st.chunks == 1 + 1 + 2 + 10);
  CHECK(st.timed_copies == 4 && st.htod_ms > 0.0 && st.fill_ms > 0.0);

cleanup:
  epm_fence_destroy(fence);
  epm_device_free(dev, d);
  free(src);
  free(dst);
  CHECK_OK(epm_copy_engine_destroy(eng));
  CHECK_OK(epm_staging_pool_destroy(pool));
  CHECK_OK(epm_stream_destroy(s));
  CHECK_OK(epm_device_destroy(dev));
}

/* EPM_COPY_ENGINE_NO_SPLIT_TAIL: full chunks to the end of a copy (for
 * copies issued back to back) instead of halving the last ones; the bytes
 * are the same either way. 9 MiB + 3 in chunks of ~2.3 MiB: 6 chunks with the
 * halving tail, 4 without. Pass 2 adds EPM_COPY_ENGINE_NO_STREAMING_STORES
 * (plain stores for a copy below 64 MiB): the same bytes. */
static void test_whole_tail_flag(void) {
  const size_t n = 9 * MIB + 3;
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmStagingPool *pool = NULL;
  EpmCopyEngine *eng = NULL;
  EpmDevicePtr d = 0;
  unsigned char *src = malloc(n), *dst = malloc(n);

  REQUIRE(src && dst);
  th_fill_random(src, n, 77);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_staging_pool_create(dev, 0, 0, &pool));
  REQUIRE_OK(epm_device_alloc(dev, n, &d));
  for (int pass = 0; pass < 3; pass++) {
    const int whole = pass > 0;
    EpmCopyEngineConfig cfg;
    cfg.size = sizeof cfg;
    REQUIRE_OK(epm_copy_engine_config_default(&cfg));
    cfg.chunk_bytes = 4 * MIB;
    cfg.fill_threads = 2;
    cfg.flags = (whole ? EPM_COPY_ENGINE_NO_SPLIT_TAIL : 0) | (pass == 2 ? EPM_COPY_ENGINE_NO_STREAMING_STORES : 0);
    REQUIRE_OK(epm_copy_engine_create(pool, &cfg, &eng));
    memset(dst, 0, n);
    REQUIRE_OK(epm_copy_engine_htod(eng, d, src, n, s, NULL));
    REQUIRE_OK(epm_memcpy_dtoh_async(dev, dst, d, n, s));
    REQUIRE_OK(epm_stream_synchronize(s));
    CHECK(memcmp(src, dst, n) == 0);
    REQUIRE_OK(epm_copy_engine_synchronize(eng));
    EpmStagingStats st;
    st.size = sizeof st;
    REQUIRE_OK(epm_copy_engine_get_stats(eng, &st));
    CHECK(st.chunks == (whole ? 4u : 6u));
    if (st.chunks != (whole ? 4u : 6u)) fprintf(stderr, "  whole %d: %llu chunks\n", whole, (unsigned long long)st.chunks);
    CHECK_OK(epm_copy_engine_destroy(eng));
    eng = NULL;
  }

cleanup:
  epm_device_free(dev, d);
  free(src);
  free(dst);
  CHECK_OK(epm_copy_engine_destroy(eng));
  CHECK_OK(epm_staging_pool_destroy(pool));
  CHECK_OK(epm_stream_destroy(s));
  CHECK_OK(epm_device_destroy(dev));
}

/* The producer stream is busy for 200 ms; the copy is ordered after it, and
 * the consumer waits on the fence, not the host. */
static void test_fence_orders_another_stream(void) {
  const size_t n = 2 * MIB + 5; /* 3 chunks: fits in the 3 slots, no back-pressure */
  EpmDevice *dev = NULL;
  EpmStream *producer = NULL, *consumer = NULL;
  EpmStagingPool *pool = NULL;
  EpmCopyEngine *eng = NULL;
  EpmFence *fence = NULL;
  EpmDevicePtr d = 0;
  unsigned char *src = malloc(n), *dst = malloc(n);

  REQUIRE(src && dst);
  th_fill_random(src, n, 42);
  memset(dst, 0, n);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &producer));
  REQUIRE_OK(epm_stream_create(dev, &consumer));
  REQUIRE_OK(epm_staging_pool_create(dev, 0, 0, &pool));
  REQUIRE_OK(small_engine(pool, &eng));
  REQUIRE_OK(epm_device_alloc(dev, n, &d));
  REQUIRE_OK(epm_memset_d8_async(dev, d, 0, n, producer));
  REQUIRE_OK(epm_device_spin_async(dev, 200000, producer));
  REQUIRE_OK(epm_copy_engine_htod(eng, d, src, n, producer, &fence));
  CHECK_STATUS(epm_fence_query(fence), EPM_STATUS_NOT_READY);
  REQUIRE_OK(epm_fence_stream_wait(fence, consumer));
  REQUIRE_OK(epm_memcpy_dtoh_async(dev, dst, d, n, consumer));
  REQUIRE_OK(epm_stream_synchronize(consumer));
  CHECK(memcmp(src, dst, n) == 0);
  CHECK_OK(epm_fence_wait(fence));
  CHECK_OK(epm_fence_query(fence));

cleanup:
  if (producer) CHECK_OK(epm_stream_synchronize(producer));
  epm_fence_destroy(fence);
  epm_device_free(dev, d);
  free(src);
  free(dst);
  CHECK_OK(epm_copy_engine_destroy(eng));
  CHECK_OK(epm_staging_pool_destroy(pool));
  CHECK_OK(epm_stream_destroy(producer));
  CHECK_OK(epm_stream_destroy(consumer));
  CHECK_OK(epm_device_destroy(dev));
}

static void test_registered_range_takes_the_direct_path(void) {
  const size_t n = 4 * MIB + 7;
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmStagingPool *pool = NULL;
  EpmCopyEngine *eng = NULL;
  EpmHostRegistration *reg = NULL;
  EpmDevicePtr d = 0;
  unsigned char *src = malloc(n), *dst = malloc(n);
  EpmStagingStats st;

  REQUIRE(src && dst);
  th_fill_random(src, n, 9);
  memset(dst, 0, n);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_staging_pool_create(dev, 0, 0, &pool));
  REQUIRE_OK(small_engine(pool, &eng));
  REQUIRE_OK(epm_device_alloc(dev, n, &d));
  REQUIRE_OK(epm_copy_engine_register(eng, src, n, &reg));
  REQUIRE_OK(epm_copy_engine_htod(eng, d, src, n, s, NULL)); /* no fence wanted */
  REQUIRE_OK(epm_memcpy_dtoh_async(dev, dst, d, n, s));
  REQUIRE_OK(epm_stream_synchronize(s));
  CHECK(memcmp(src, dst, n) == 0);
  st.size = sizeof st;
  REQUIRE_OK(epm_copy_engine_get_stats(eng, &st));
  CHECK(st.copies == 1 && st.bypassed == 1);
  CHECK(st.chunks == 0 && st.pinned_alloc_calls == 0 && st.fill_ms == 0.0);
  CHECK_OK(epm_host_registration_destroy(reg));
  reg = NULL;

cleanup:
  epm_host_registration_destroy(reg);
  epm_device_free(dev, d);
  free(src);
  free(dst);
  CHECK_OK(epm_copy_engine_destroy(eng));
  CHECK_OK(epm_staging_pool_destroy(pool));
  CHECK_OK(epm_stream_destroy(s));
  CHECK_OK(epm_device_destroy(dev));
}

/* The seed's regression guard, from C: after the first page-in, 63 more of
 * the same size allocate no pinned memory. */
static void test_steady_state_allocates_nothing(void) {
  const size_t n = 3 * MIB;
  EpmDevice *dev = NULL;
  EpmStagingPool *pool = NULL;
  EpmCopyEngine *eng = NULL;
  EpmDevicePtr d = 0;
  unsigned char *src = malloc(n);
  EpmStagingStats warm, st;

  REQUIRE(src);
  th_fill_random(src, n, 1);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_staging_pool_create(dev, 0, 0, &pool));
  REQUIRE_OK(small_engine(pool, &eng));
  REQUIRE_OK(epm_device_alloc(dev, n, &d));
  REQUIRE_OK(epm_copy_engine_htod(eng, d, src, n, NULL, NULL));
  REQUIRE_OK(epm_copy_engine_synchronize(eng));
  warm.size = sizeof warm;
  REQUIRE_OK(epm_copy_engine_get_stats(eng, &warm));
  CHECK(warm.pinned_alloc_calls == 3); /* one per slot */
  for (int i = 0; i < 63; i++) REQUIRE_OK(epm_copy_engine_htod(eng, d, src, n, NULL, NULL));
  REQUIRE_OK(epm_copy_engine_synchronize(eng));
  st.size = sizeof st;
  REQUIRE_OK(epm_copy_engine_get_stats(eng, &st));
  CHECK(st.pinned_alloc_calls == warm.pinned_alloc_calls);
  CHECK(st.pinned_free_calls == 0);
  CHECK(st.pinned_reuses == warm.pinned_reuses + 63 * 3);
  CHECK(st.retained_buffers == 3 && st.retained_bytes == 3 * MIB);
  /* The pool's view of the same counters. */
  REQUIRE_OK(epm_staging_pool_get_stats(pool, &st));
  CHECK(st.pinned_alloc_calls == 3 && st.copies == 0);

cleanup:
  epm_device_free(dev, d);
  free(src);
  CHECK_OK(epm_copy_engine_destroy(eng));
  CHECK_OK(epm_staging_pool_destroy(pool));
  CHECK_OK(epm_device_destroy(dev));
}

static void test_bad_input_is_a_clean_status(void) {
  EpmDevice *dev = NULL;
  EpmStagingPool *pool = NULL, *tiny = NULL;
  EpmCopyEngine *eng = NULL, *never = NULL;
  EpmFence *fence = NULL;
  EpmDevicePtr d = 0;
  unsigned char buf[64] = {0};
  EpmCopyEngineConfig cfg;
  EpmStagingStats st;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_staging_pool_create(dev, 0, 0, &pool));
  REQUIRE_OK(small_engine(pool, &eng));
  REQUIRE_OK(epm_device_alloc(dev, sizeof buf, &d));

  CHECK_STATUS(epm_copy_engine_htod(NULL, d, buf, sizeof buf, NULL, &fence), EPM_STATUS_INVALID_HANDLE);
  CHECK_STATUS(epm_copy_engine_htod(eng, d, NULL, sizeof buf, NULL, &fence), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_copy_engine_htod(eng, d, buf, 0, NULL, &fence), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_copy_engine_htod((EpmCopyEngine *)pool, d, buf, sizeof buf, NULL, &fence),
               EPM_STATUS_INVALID_HANDLE);
  CHECK_MESSAGE_HAS("EpmCopyEngine");
  CHECK(fence == NULL); /* out-params untouched on failure */
  /* A device address nobody allocated: an error, and the engine still works. */
  CHECK(epm_copy_engine_htod(eng, 0x10, buf, sizeof buf, NULL, &fence) != EPM_STATUS_OK);
  CHECK(fence == NULL);
  CHECK_OK(epm_copy_engine_htod(eng, d, buf, sizeof buf, NULL, &fence));
  CHECK_OK(epm_fence_wait(fence));

  cfg.size = sizeof cfg;
  REQUIRE_OK(epm_copy_engine_config_default(&cfg));
  CHECK(cfg.slots == 3 && cfg.chunk_bytes == 16 * MIB && cfg.flags == 0 && cfg.target_chunks == 4);
  CHECK(cfg.fill_threads >= 1 && cfg.fill_threads <= 12);
  cfg.slots = 9;
  CHECK_STATUS(epm_copy_engine_create(pool, &cfg, &never), EPM_STATUS_INVALID_CONFIG);
  cfg.slots = 3;
  cfg.target_chunks = 0;
  CHECK_STATUS(epm_copy_engine_create(pool, &cfg, &never), EPM_STATUS_INVALID_CONFIG);
  cfg.target_chunks = 16;
  cfg.flags = 0x80;
  CHECK_STATUS(epm_copy_engine_create(pool, &cfg, &never), EPM_STATUS_INVALID_ARGUMENT);
  cfg.flags = EPM_COPY_ENGINE_NO_STREAMING_STORES << 1; /* the next bit: not a flag yet */
  CHECK_STATUS(epm_copy_engine_create(pool, &cfg, &never), EPM_STATUS_INVALID_ARGUMENT);
  cfg.flags = 0;
  cfg.size = 4;
  CHECK_STATUS(epm_copy_engine_create(pool, &cfg, &never), EPM_STATUS_INVALID_ARGUMENT);
  /* A pool that cannot retain 3 slots of 8 MiB would allocate forever. */
  REQUIRE_OK(epm_staging_pool_create(dev, 2, 0, &tiny));
  CHECK_STATUS(epm_copy_engine_create(tiny, NULL, &never), EPM_STATUS_INVALID_CONFIG);
  CHECK(never == NULL);

  st.size = 8;
  CHECK_STATUS(epm_copy_engine_get_stats(eng, &st), EPM_STATUS_INVALID_ARGUMENT);
  CHECK_STATUS(epm_copy_engine_get_stats(eng, NULL), EPM_STATUS_NULL_POINTER);
  CHECK_STATUS(epm_fence_query(NULL), EPM_STATUS_INVALID_HANDLE);
  CHECK_OK(epm_fence_destroy(NULL));
  CHECK_OK(epm_copy_engine_destroy(NULL));
  CHECK_OK(epm_staging_pool_destroy(NULL));
  CHECK_OK(epm_host_registration_destroy(NULL));

cleanup:
  epm_fence_destroy(fence);
  epm_device_free(dev, d);
  CHECK_OK(epm_copy_engine_destroy(eng));
  CHECK_OK(epm_staging_pool_destroy(pool));
  CHECK_OK(epm_staging_pool_destroy(tiny));
  CHECK_OK(epm_device_destroy(dev));
}

int main(void) {
  RUN(test_staged_copies_are_bit_exact);
  RUN(test_whole_tail_flag);
  RUN(test_fence_orders_another_stream);
  RUN(test_registered_range_takes_the_direct_path);
  RUN(test_steady_state_allocates_nothing);
  RUN(test_bad_input_is_a_clean_status);
  TEST_SUMMARY();
}
