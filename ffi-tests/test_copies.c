/*
 * Streams, events and copies: data arrives bit-exact, events order work
 * across streams, and the device checksum equals the host checksum.
 * Runs on the device EPM_DEVICE names (host in CI, cuda on a GPU machine).
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "testhelper.h"

/* A gate's watchdog: opens the gate after WATCHDOG_S seconds unless stopped
 * first, so a call that wrongly blocks on the held stream (cuEventQuery did,
 * behind the first design's host function, and hung this suite) returns and
 * the check on `fired` fails, instead of the suite hanging. A passing test
 * never waits for it. Stop it before destroying the gate. */
enum { WATCHDOG_S = 5 };
typedef struct {
  EpmGate *gate;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int stop, fired, started;
  pthread_t thread;
} Watchdog;

static void *watchdog_main(void *p) {
  Watchdog *w = p;
  struct timespec until;
  int r = 0;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += WATCHDOG_S;
  pthread_mutex_lock(&w->mu);
  while (!w->stop && r != ETIMEDOUT) r = pthread_cond_timedwait(&w->cv, &w->mu, &until);
  if (!w->stop) {
    w->fired = 1;
    epm_gate_open(w->gate);
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

static int watchdog_start(Watchdog *w, EpmGate *gate) {
  memset(w, 0, sizeof *w);
  w->gate = gate;
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  w->started = pthread_create(&w->thread, NULL, watchdog_main, w) == 0;
  return w->started;
}

static int watchdog_fired(Watchdog *w) {
  pthread_mutex_lock(&w->mu);
  int f = w->fired;
  pthread_mutex_unlock(&w->mu);
  return f;
}

/* Hold `stream` on a new gate in `*gate`, or, where the device cannot hold a
 * stream (a CUDA driver or GPU without stream memory waits), print why and
 * skip the rest of the test: a skip is said, never a silent pass. */
#define HOLD_OR_SKIP(dev, stream, gate)                                               \
  do {                                                                             \
    EpmStatus hs_got = epm_device_hold_async(dev, stream, gate);                   \
    if (hs_got == EPM_STATUS_UNSUPPORTED) {                                        \
      printf("SKIPPED %s: %s\n", __func__, epm_last_error_message());              \
      goto cleanup;                                                                \
    }                                                                              \
    REQUIRE_OK(hs_got);                                                            \
  } while (0)

/* Stop and join it (idempotent); whether it had fired. */
static int watchdog_stop(Watchdog *w) {
  if (!w->started) return w->fired;
  pthread_mutex_lock(&w->mu);
  w->stop = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->thread, NULL);
  w->started = 0;
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv);
  return w->fired;
}

/* Sizes that are not round, and one big enough to take several chunks. */
static const size_t SIZES[] = {4, 4096 + 12, (1u << 20) + 4, 8u << 20};

static void test_sync_copies_are_bit_exact(void) {
  EpmDevice *dev = NULL;
  EpmDevicePtr d = 0;
  unsigned char *src = NULL, *dst = NULL;

  REQUIRE_OK(epm_device_open(0, &dev));
  for (size_t i = 0; i < sizeof SIZES / sizeof SIZES[0]; i++) {
    size_t n = SIZES[i];
    src = malloc(n);
    dst = malloc(n);
    REQUIRE(src && dst);
    th_fill_random(src, n, 100 + i);
    memset(dst, 0, n);
    REQUIRE_OK(epm_device_alloc(dev, n, &d));
    CHECK(d != 0);
    REQUIRE_OK(epm_memcpy_htod(dev, d, src, n));
    REQUIRE_OK(epm_memcpy_dtoh(dev, dst, d, n));
    CHECK(memcmp(src, dst, n) == 0);
    CHECK_OK(epm_device_free(dev, d));
    d = 0;
    free(src);
    free(dst);
    src = dst = NULL;
  }

cleanup:
  epm_device_free(dev, d);
  free(src);
  free(dst);
  epm_device_destroy(dev);
}

/* Fill d1 on stream A, make stream B wait on an event, then copy d1 to d2 on
 * B. A is held on a gate until B's work is queued: without the wait B would
 * run (and read d1) before A filled it, and B's event could not still be
 * pending while A is held. Only device-to-device copies are queued behind the
 * hold: a copy from or to pageable host memory may make the calling thread
 * wait for the stream (the driver stages it through pinned memory), which
 * would block this thread on the held stream until the watchdog opens it. */
static void test_event_orders_streams(void) {
  enum { N = 4u << 20 };
  EpmDevice *dev = NULL;
  EpmStream *a = NULL, *b = NULL;
  EpmEvent *filled = NULL, *done = NULL;
  EpmGate *gate = NULL;
  Watchdog wd = {0};
  EpmDevicePtr d0 = 0, d1 = 0, d2 = 0;
  unsigned char *src = malloc(N), *dst = malloc(N);

  REQUIRE(src && dst);
  th_fill_random(src, N, 7);
  memset(dst, 0, N);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &a));
  REQUIRE_OK(epm_stream_create(dev, &b));
  REQUIRE_OK(epm_event_create(dev, 0, &filled));
  REQUIRE_OK(epm_event_create(dev, 0, &done));
  REQUIRE_OK(epm_device_alloc(dev, N, &d0));
  REQUIRE_OK(epm_device_alloc(dev, N, &d1));
  REQUIRE_OK(epm_device_alloc(dev, N, &d2));
  REQUIRE_OK(epm_memcpy_htod(dev, d0, src, N)); /* synchronous: complete on return */
  /* Zeros in d1 and d2: a copy on B that ran before A's fill would leave zeros. */
  REQUIRE_OK(epm_memset_d8_async(dev, d1, 0, N, b));
  REQUIRE_OK(epm_memset_d8_async(dev, d2, 0, N, b));
  REQUIRE_OK(epm_stream_synchronize(b));

  /* Hold A first, so B would certainly run ahead without the wait. */
  HOLD_OR_SKIP(dev, a, &gate);
  REQUIRE(watchdog_start(&wd, gate));
  REQUIRE_OK(epm_memcpy_dtod_async(dev, d1, d0, N, a));
  REQUIRE_OK(epm_event_record(filled, a));
  REQUIRE_OK(epm_stream_wait_event(b, filled));
  REQUIRE_OK(epm_memcpy_dtod_async(dev, d2, d1, N, b));
  REQUIRE_OK(epm_event_record(done, b));
  CHECK_STATUS(epm_event_query(done), EPM_STATUS_NOT_READY); /* B waits on held A */
  CHECK_STATUS(epm_event_query(filled), EPM_STATUS_NOT_READY);
  CHECK(!watchdog_fired(&wd)); /* a query blocked until the watchdog opened the gate */
  REQUIRE_OK(epm_gate_open(gate));
  REQUIRE_OK(epm_event_synchronize(done));
  CHECK_OK(epm_event_query(done));
  CHECK_OK(epm_event_query(filled));
  REQUIRE_OK(epm_memcpy_dtoh(dev, dst, d2, N)); /* after `done`: B's copy is complete */
  CHECK(memcmp(src, dst, N) == 0);

cleanup:
  watchdog_stop(&wd);
  epm_gate_destroy(gate); /* opens it if a check above bailed out first */
  if (a) CHECK_OK(epm_stream_synchronize(a));
  if (b) CHECK_OK(epm_stream_synchronize(b));
  epm_device_free(dev, d0);
  epm_device_free(dev, d1);
  epm_device_free(dev, d2);
  /* The device first, on purpose: streams and events keep it alive. */
  CHECK_OK(epm_device_destroy(dev));
  CHECK_OK(epm_event_destroy(filled));
  CHECK_OK(epm_event_destroy(done));
  CHECK_OK(epm_stream_destroy(a));
  CHECK_OK(epm_stream_destroy(b));
  free(src);
  free(dst);
}

/* The end event sits behind a gate this test opens only after its checks,
 * so NOT_READY is certain however slow the machine (a spin of N ms made it
 * a race with the scheduler). The 20 ms spin after the gate is a floor for
 * the elapsed time, not a ceiling. */
static void test_query_not_ready_then_ok_and_elapsed(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmEvent *start = NULL, *end = NULL;
  EpmGate *gate = NULL;
  Watchdog wd = {0};
  float ms = -1.0f;

  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_event_create(dev, EPM_EVENT_TIMING, &start));
  REQUIRE_OK(epm_event_create(dev, EPM_EVENT_TIMING, &end));
  CHECK_OK(epm_event_query(end)); /* never recorded: complete */
  REQUIRE_OK(epm_event_record(start, s));
  HOLD_OR_SKIP(dev, s, &gate);
  REQUIRE(watchdog_start(&wd, gate));
  REQUIRE_OK(epm_device_spin_async(dev, 20000, s)); /* 20 ms, after the gate */
  REQUIRE_OK(epm_event_record(end, s));
  CHECK_STATUS(epm_event_query(end), EPM_STATUS_NOT_READY);
  CHECK_STATUS(epm_event_elapsed_ms(start, end, &ms), EPM_STATUS_NOT_READY);
  CHECK(ms == -1.0f);
  CHECK_STATUS(epm_event_query(end), EPM_STATUS_NOT_READY); /* still: nothing opened it */
  CHECK(!watchdog_fired(&wd)); /* a query or elapsed blocked until the watchdog opened the gate */
  REQUIRE_OK(epm_gate_open(gate));
  REQUIRE_OK(epm_event_synchronize(end));
  CHECK_OK(epm_event_query(end));
  REQUIRE_OK(epm_event_elapsed_ms(start, end, &ms));
  CHECK(ms >= 15.0f && ms < 60000.0f);

cleanup:
  watchdog_stop(&wd);
  epm_gate_destroy(gate); /* opens it if a check above bailed out first */
  epm_event_destroy(start);
  epm_event_destroy(end);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

static void test_checksum_device_matches_host(void) {
  enum { N = (2u << 20) + 36 };
  EpmDevice *dev = NULL;
  EpmStream *s = NULL;
  EpmDevicePtr d = 0, sum = 0;
  unsigned char *buf = malloc(N);
  uint64_t dev_sum = 0, host_sum;

  REQUIRE(buf);
  th_fill_random(buf, N, 99);
  host_sum = epm_checksum_host(buf, N);
  CHECK(host_sum != 0);
  REQUIRE_OK(epm_device_open(0, &dev));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_device_alloc(dev, N, &d));
  REQUIRE_OK(epm_device_alloc(dev, sizeof dev_sum, &sum));
  REQUIRE_OK(epm_memcpy_htod_async(dev, d, buf, N, s));
  REQUIRE_OK(epm_device_checksum_async(dev, d, N, s, sum));
  REQUIRE_OK(epm_memcpy_dtoh_async(dev, &dev_sum, sum, sizeof dev_sum, s));
  REQUIRE_OK(epm_stream_synchronize(s));
  CHECK(dev_sum == host_sum);

  /* Position sensitive: swapping two words changes it; memset is seen. */
  REQUIRE_OK(epm_memset_d8_async(dev, d, 0, N, s));
  REQUIRE_OK(epm_device_checksum_async(dev, d, N, s, sum));
  REQUIRE_OK(epm_memcpy_dtoh_async(dev, &dev_sum, sum, sizeof dev_sum, s));
  REQUIRE_OK(epm_stream_synchronize(s));
  CHECK(dev_sum == 0);
  {
    uint32_t w[2] = {1, 2}, v[2] = {2, 1};
    CHECK(epm_checksum_host(w, sizeof w) == 1 + 2 * 3);
    CHECK(epm_checksum_host(v, sizeof v) == 2 + 1 * 3);
  }
  CHECK(epm_checksum_host(NULL, 16) == 0);
  CHECK_STATUS(epm_device_checksum_async(dev, d, 6, s, sum), EPM_STATUS_INVALID_ARGUMENT);

cleanup:
  if (s) epm_stream_synchronize(s);
  epm_device_free(dev, d);
  epm_device_free(dev, sum);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
  free(buf);
}

/* A native stream: NULL on the host device (which cannot adopt one); on CUDA
 * a CUstream that can be adopted as a second EpmStream. */
static void test_native_streams(void) {
  EpmDevice *dev = NULL;
  EpmStream *s = NULL, *adopted = NULL;
  EpmEvent *e = NULL;
  EpmDeviceInfo info;
  void *native = (void *)&info;

  REQUIRE_OK(epm_device_open(0, &dev));
  info.size = sizeof info;
  REQUIRE_OK(epm_device_get_info(dev, &info));
  REQUIRE_OK(epm_stream_create(dev, &s));
  REQUIRE_OK(epm_stream_native(s, &native));
  if (info.kind == EPM_DEVICE_KIND_HOST) {
    CHECK(native == NULL);
    CHECK_STATUS(epm_stream_wrap_native(dev, native, &adopted), EPM_STATUS_NULL_POINTER);
    CHECK_STATUS(epm_stream_wrap_native(dev, (void *)&info, &adopted), EPM_STATUS_UNSUPPORTED);
    CHECK(adopted == NULL);
  } else {
    CHECK(native != NULL);
    REQUIRE_OK(epm_stream_wrap_native(dev, native, &adopted));
    REQUIRE_OK(epm_event_create(dev, 0, &e));
    REQUIRE_OK(epm_device_spin_async(dev, 1000, adopted));
    REQUIRE_OK(epm_event_record(e, adopted));
    REQUIRE_OK(epm_event_synchronize(e));
    /* Forgetting the adopted wrapper leaves the owner's stream working. */
    REQUIRE_OK(epm_stream_destroy(adopted));
    adopted = NULL;
    CHECK_OK(epm_device_spin_async(dev, 1000, s));
    CHECK_OK(epm_stream_synchronize(s));
  }

cleanup:
  epm_event_destroy(e);
  epm_stream_destroy(adopted);
  epm_stream_destroy(s);
  epm_device_destroy(dev);
}

int main(void) {
  RUN(test_sync_copies_are_bit_exact);
  RUN(test_event_orders_streams);
  RUN(test_query_not_ready_then_ok_and_elapsed);
  RUN(test_checksum_device_matches_host);
  RUN(test_native_streams);
  TEST_SUMMARY();
}
