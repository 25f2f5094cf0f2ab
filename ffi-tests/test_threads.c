/*
 * Handles from many threads at once: independent work on one shared device
 * stays bit-exact, each thread has its own last error, and destroying a
 * handle while other threads use it gives them OK or INVALID_HANDLE — never
 * a crash or another status. Worth running under ASan (make test does).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "testhelper.h"

enum { THREADS = 6, ROUNDS = 40, N = 64 * 1024 };

static EpmDevice *shared_dev;

/* Worker threads count their own failures (the CHECK counters are not
 * thread-safe) and main adds them up. */
#define WCHECK(cond)                                                            \
  do {                                                                          \
    if (!(cond)) {                                                              \
      fails++;                                                                  \
      fprintf(stderr, "%s:%d: thread FAIL: %s (%s)\n", __FILE__, __LINE__,      \
              #cond, epm_last_error_message());                                 \
    }                                                                           \
  } while (0)

static void *copy_worker(void *arg) {
  int seed = (int)(intptr_t)arg, fails = 0;
  unsigned char *src = malloc(N), *dst = malloc(N);

  if (!src || !dst) { free(src); free(dst); return (void *)(intptr_t)1; }
  for (int r = 0; r < ROUNDS; r++) {
    EpmStream *s = NULL;
    EpmEvent *e = NULL;
    EpmDevicePtr d = 0;
    th_fill_random(src, N, (unsigned long long)(seed * 1000 + r));
    memset(dst, 0, N);
    WCHECK(epm_stream_create(shared_dev, &s) == EPM_STATUS_OK);
    WCHECK(epm_event_create(shared_dev, 0, &e) == EPM_STATUS_OK);
    WCHECK(epm_device_alloc(shared_dev, N, &d) == EPM_STATUS_OK);
    WCHECK(epm_memcpy_htod_async(shared_dev, d, src, N, s) == EPM_STATUS_OK);
    WCHECK(epm_memcpy_dtoh_async(shared_dev, dst, d, N, s) == EPM_STATUS_OK);
    WCHECK(epm_event_record(e, s) == EPM_STATUS_OK);
    WCHECK(epm_event_synchronize(e) == EPM_STATUS_OK);
    WCHECK(memcmp(src, dst, N) == 0);
    /* This thread's last error is its own. */
    WCHECK(epm_stream_destroy((EpmStream *)e) == EPM_STATUS_INVALID_HANDLE);
    WCHECK(strstr(epm_last_error_message(), "EpmStream") != NULL);
    WCHECK(epm_device_free(shared_dev, d) == EPM_STATUS_OK);
    WCHECK(epm_event_destroy(e) == EPM_STATUS_OK);
    WCHECK(epm_stream_destroy(s) == EPM_STATUS_OK);
  }
  free(src);
  free(dst);
  return (void *)(intptr_t)fails;
}

static _Atomic(EpmStream *) contested;
static atomic_int stop;
static atomic_long calls;

static void *user_worker(void *arg) {
  int fails = 0;
  (void)arg;
  while (!atomic_load(&stop)) {
    EpmStatus st = epm_stream_synchronize(atomic_load(&contested));
    WCHECK(st == EPM_STATUS_OK || st == EPM_STATUS_INVALID_HANDLE);
    atomic_fetch_add(&calls, 1);
  }
  return (void *)(intptr_t)fails;
}

static void test_independent_work_from_many_threads(void) {
  pthread_t t[THREADS];
  int started = 0;

  REQUIRE_OK(epm_device_open(0, &shared_dev));
  for (; started < THREADS; started++)
    REQUIRE(pthread_create(&t[started], NULL, copy_worker, (void *)(intptr_t)(started + 1)) == 0);

cleanup:
  for (int i = 0; i < started; i++) {
    void *fails = NULL;
    pthread_join(t[i], &fails);
    th_checks++;
    th_failures += (int)(intptr_t)fails;
  }
  CHECK_OK(epm_device_destroy(shared_dev));
  shared_dev = NULL;
}

static void test_destroy_while_in_use(void) {
  pthread_t t[THREADS];
  int started = 0;
  EpmDevice *dev = NULL;

  REQUIRE_OK(epm_device_open(0, &dev));
  {
    EpmStream *s = NULL;
    REQUIRE_OK(epm_stream_create(dev, &s));
    atomic_store(&contested, s);
  }
  atomic_store(&stop, 0);
  atomic_store(&calls, 0);
  for (; started < THREADS; started++)
    REQUIRE(pthread_create(&t[started], NULL, user_worker, NULL) == 0);
  /* Keep replacing the handle until the users have made plenty of calls
   * against it (bounded, in case they never get scheduled). */
  for (long r = 0; r < 200 || (atomic_load(&calls) < 2000 && r < 1000000); r++) {
    EpmStream *fresh = NULL, *old;
    REQUIRE_OK(epm_stream_create(dev, &fresh));
    old = atomic_exchange(&contested, fresh);
    REQUIRE_OK(epm_stream_destroy(old));
  }
  CHECK(atomic_load(&calls) >= 2000);

cleanup:
  atomic_store(&stop, 1);
  for (int i = 0; i < started; i++) {
    void *fails = NULL;
    pthread_join(t[i], &fails);
    th_checks++;
    th_failures += (int)(intptr_t)fails;
  }
  epm_stream_destroy(atomic_exchange(&contested, NULL));
  epm_device_destroy(dev);
}

int main(void) {
  RUN(test_independent_work_from_many_threads);
  RUN(test_destroy_while_in_use);
  TEST_SUMMARY();
}
